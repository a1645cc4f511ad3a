"""Image prompts through `tandem target`'s Step RPC: a Gemma 3 multimodal checkpoint's target encodes the images a
request brings as bytes (tandem.models.image_encoder) and decodes transformers' greedy tokens; too many images,
bytes that are not an image, and a target started with no image allowed each refuse the item, naming why."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration

from tandem.grpc_util import channel_options
from tandem.wire import target_pb2, target_pb2_grpc
from tests.helpers.gemma4_checkpoints import VOCAB, write_tiny_gemma3_multimodal
from tests.integration.stack import target_process

BOI, EOI, IMAGE = VOCAB - 3, VOCAB - 2, VOCAB - 1
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3_multimodal(tmp_path_factory.mktemp("gemma3-served"), seed=4)


def png(seed: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (20, 36, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def prompt_with(count: int) -> list[int]:
    prompt = [2, 40, 41]
    for index in range(count):
        prompt += [BOI, *[IMAGE] * 4, EOI, 50 + index]
    return prompt


def starts(prompt: list[int]) -> list[int]:
    return [index + 1 for index, token in enumerate(prompt) if token == BOI]


def expected(checkpoint: Path, prompt: list[int], images: list[bytes]) -> list[int]:
    processor = AutoImageProcessor.from_pretrained(checkpoint, backend="pil")
    pixels = processor(images=[Image.open(io.BytesIO(data)) for data in images], return_tensors="pt")["pixel_values"]
    model = Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long(), do_sample=False,
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@contextmanager
def served(
    checkpoint: Path, ready: Path, images: int, tp: int = 1
) -> Iterator[tuple[Callable[[target_pb2.StepItem], Any], list[str]]]:
    """A `tandem target` of `tp` ranks allowing `images` images a prompt: a function calling its Step with one item,
    and the process's log lines once it has stopped."""
    log: list[str] = []
    limit = f'{{"image": {images}}}'
    with (
        target_process(checkpoint, tp, ready, "--limit-mm-per-prompt", limit) as target,
        grpc.insecure_channel(target.address, options=channel_options()) as channel,
    ):
        stub = target_pb2_grpc.TargetStub(channel)
        yield (lambda item: stub.Step(target_pb2.StepRequest(items=[item])).results[0]), log
    assert target.process.stdout is not None
    log += target.process.stdout.read().splitlines()


def opening(request_id: str, prompt: list[int], images: list[bytes]) -> target_pb2.StepItem:
    pictures = [
        target_pb2.PromptImage(data=data, start=start) for data, start in zip(images, starts(prompt), strict=False)
    ]
    open_request = target_pb2.OpenRequest(prompt=prompt, images=pictures)
    return target_pb2.StepItem(request_id=request_id, num_tokens=len(prompt), open=open_request)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_target_serves_image_prompts_as_transformers(checkpoint: Path, tmp_path: Path, tp: int) -> None:
    # At tp 2 rank 0 encodes the images and sends the features to rank 1 with the step.
    with served(checkpoint, tmp_path / "ready", 2, tp) as (step, log):
        for count in (1, 2):
            prompt, images = prompt_with(count), [png(seed) for seed in range(count)]
            first = step(opening(f"r{count}", prompt, images))
            assert not first.HasField("error"), first.error
            tokens = list(first.new_tokens)
            while len(tokens) < NEW_TOKENS:
                tokens += step(target_pb2.StepItem(request_id=f"r{count}", num_tokens=1)).new_tokens
            assert tokens == expected(checkpoint, prompt, images)
        three = step(opening("r3", prompt_with(3), [png(seed) for seed in range(3)]))
        assert three.error.message == "images: 3 in one prompt, at most 2 (--limit-mm-per-prompt)"
        wrong = step(opening("r4", prompt_with(1), [b"GIF89a not really"]))
        assert wrong.error.message.startswith("images[0]: 17 bytes that are not an image Pillow reads")
    assert any("image encoder loaded: 4 tokens an image, at most 2 images a prompt" in line for line in log)


def test_no_image_allowed_loads_no_tower(checkpoint: Path, tmp_path: Path) -> None:
    with served(checkpoint, tmp_path / "ready", 0) as (step, log):
        refused = step(opening("r", prompt_with(1), [png(0)]))
        assert refused.error.message.startswith("images: this target serves no images")
        plain = step(target_pb2.StepItem(request_id="t", num_tokens=3, open=target_pb2.OpenRequest(prompt=[2, 40, 41])))
        assert not plain.HasField("error") and len(plain.new_tokens) == 1
    assert log and not any("image encoder loaded" in line for line in log)

"""Image prompts: chat requests with images through the official `openai` client to `tandem serve` (tensor parallel 2,
an EAGLE3 draft; Gemma 3, Gemma 4 and Kimi-K2.5) answer transformers' greedy tokens, with speculation and without
(disable_speculation), on the prompt its processor writes; `tandem target`'s Step RPC encodes the images a request
brings as bytes (tandem.models.image_encoder). Too many images, bytes that are not an image, and a target started
with no image allowed each refuse the request, naming why, and serving goes on."""

from __future__ import annotations

import base64
import io
import re
import shutil
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import grpc
import numpy as np
import openai
import pytest
import torch
from PIL import Image
from transformers import (
    AutoImageProcessor,
    AutoProcessor,
    AutoTokenizer,
    Gemma3ForConditionalGeneration,
    Gemma4ForConditionalGeneration,
    Kimi_K25ForConditionalGeneration,
    PreTrainedTokenizerBase,
)
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

from tandem.grpc_util import channel_options
from tandem.wire import target_pb2, target_pb2_grpc
from tests.helpers.deepseek_checkpoints import TinyDeepseekSpec
from tests.helpers.gemma4_checkpoints import (
    GEMMA4_IMAGE_TOKENS,
    SPECS,
    VOCAB,
    gemma4_image_chat,
    write_gemma3_eagle3,
    write_tiny_gemma3_multimodal,
    write_tiny_gemma4_multimodal,
)
from tests.helpers.kimi_checkpoints import kimi_image_chat, to_hub_layout, write_kimi_eagle3_mla, write_tiny_kimi_k25
from tests.helpers.torchvision_stand_in import transformers_kimi_image_processing, transformers_kimi_processor
from tests.integration.stack import serve, target_process

BOI, EOI, IMAGE = VOCAB - 3, VOCAB - 2, VOCAB - 1
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3_multimodal(tmp_path_factory.mktemp("gemma3-served"), seed=4)


def png(seed: int, size: tuple[int, int] = (20, 36)) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(out, "PNG")
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


def test_a_target_serves_image_prompts_as_transformers(checkpoint: Path, tmp_path: Path) -> None:
    with served(checkpoint, tmp_path / "ready", 2) as (step, log):
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
    assert any(
        "image encoder loaded: FixedCount(tokens_per_image=4), at most 2 images a prompt" in line for line in log
    )


def test_no_image_allowed_loads_no_tower(checkpoint: Path, tmp_path: Path) -> None:
    with served(checkpoint, tmp_path / "ready", 0) as (step, log):
        refused = step(opening("r", prompt_with(1), [png(0)]))
        assert refused.error.message.startswith("images: this target serves no images")
        plain = step(target_pb2.StepItem(request_id="t", num_tokens=3, open=target_pb2.OpenRequest(prompt=[2, 40, 41])))
        assert not plain.HasField("error") and len(plain.new_tokens) == 1
    assert log and not any("image encoder loaded" in line for line in log)


def data_url(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


def chat(urls: list[str]) -> list[dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [
        {"role": "user", "content": [{"type": "text", "text": "Look at"}, *parts, {"type": "text", "text": "Why?"}]}
    ]


def both_ways(client: openai.OpenAI, model: str, messages: list[dict[str, Any]]) -> tuple[Any, str | None]:
    """The greedy reply to the chat with speculation, and the content of the same request with it off."""
    replies = [
        client.chat.completions.create(
            model=model,
            messages=cast(Any, messages),
            temperature=0,
            max_tokens=NEW_TOKENS,
            extra_body={"ignore_eos": True, "disable_speculation": off},
        )
        for off in (False, True)
    ]
    return replies[0], replies[1].choices[0].message.content


def processed(checkpoint: Path, images: list[bytes]) -> tuple[list[int], list[int]]:
    """transformers' answer to chat(images): the prompt its processor writes, and the greedy tokens after it."""
    processor = AutoProcessor.from_pretrained(checkpoint)
    messages = chat(["image"] * len(images))
    content = messages[0]["content"]
    for index, data in enumerate(images):
        content[1 + index] = {"type": "image", "image": Image.open(io.BytesIO(data)).convert("RGB")}
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    prompt = inputs["input_ids"][0].tolist()
    model = Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    return prompt, out[0, len(prompt) :].tolist()


def test_chat_images_through_the_openai_client_at_tp_2_with_drafts(checkpoint: Path, tmp_path: Path) -> None:
    # At tp 2 rank 0 encodes the images and sends the features to rank 1 with the step; the EAGLE3 head drafts over
    # the image's rows (a random head: its drafts are verified, the output is the target's), embedding the image's
    # tokens as the target's input (its config's image_embeddings "merged": the target sends it the features).
    media = tmp_path / "media"
    media.mkdir()
    (media / "b.png").write_bytes(png(1))
    draft = write_gemma3_eagle3(tmp_path, checkpoint, image_embeddings="merged")
    limit = '{"image": 2}'
    flags = ["--tp", "2", "--limit-mm-per-prompt", limit, "--allowed-local-media-path", str(media)]
    with serve(checkpoint, draft, *flags) as stack:
        client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        for urls, images in [
            ([data_url(png(0))], [png(0)]),
            ([data_url(png(0)), f"file://{media}/b.png"], [png(0), png(1)]),
        ]:
            reply, plain = both_ways(client, checkpoint.name, chat(urls))
            prompt, tokens = processed(checkpoint, images)
            assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)
            assert reply.choices[0].message.content == plain == tokenizer.decode(tokens, skip_special_tokens=True)
        for urls, param, says in [
            ([data_url(png(0))] * 3, "messages[0].content[3]", "3 images in the request; at most 2 per prompt"),
            ([data_url(b"GIF89a not really")], "messages[0].content[1]", "17 bytes that are not a PNG, JPEG or WebP"),
            (["file:///etc/hostname"], "messages[0].content[1]", "/etc/hostname is not under"),
        ]:
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model=checkpoint.name, messages=chat(urls), max_tokens=2)
            error = refused.value.body
            assert isinstance(error, dict) and error["param"] == param and says in error["message"], error
        metrics = urllib.request.urlopen(f"{stack.http_url}/metrics", timeout=10).read().decode()
        [drafted] = re.findall(r"^vllm:spec_decode_num_draft_tokens_total\{.*\} ([\d.e+]+)$", metrics, re.MULTILINE)
        assert float(drafted) > 0


def gemma4_processed(checkpoint: Path, images: list[bytes]) -> tuple[list[int], list[int]]:
    """transformers' answer to chat(images) on Gemma 4: the template's text with each image token replaced as
    Gemma4Processor replaces it (its full processor needs torchvision), and the greedy tokens after it."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    messages = chat(["image"] * len(images))
    for index in range(len(images)):
        messages[0]["content"][1 + index] = {"type": "image"}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    inputs = AutoImageProcessor.from_pretrained(checkpoint, backend="pil")(images=pictures, return_tensors="pt")
    names = SimpleNamespace(**GEMMA4_IMAGE_TOKENS)
    pieces = text.split(names.image_token)
    written = pieces[0] + "".join(
        Gemma4Processor.replace_image_token(names, inputs, index) + after for index, after in enumerate(pieces[1:])
    )
    prompt = tokenizer.encode(written, add_special_tokens=False)
    ids = torch.tensor([prompt])
    model = Gemma4ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            ids, pixel_values=inputs["pixel_values"], image_position_ids=inputs["image_position_ids"],
            mm_token_type_ids=(ids == VOCAB - 1).long(), do_sample=False, max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
        )  # fmt: skip
    return prompt, out[0, len(prompt) :].tolist()


def test_gemma4_chat_images_of_their_own_sizes_at_tp_2_with_drafts(tmp_path: Path) -> None:
    # Each image takes the soft tokens its size gives (66 and 56 here); its tokens see each other both ways on the
    # sliding layers ("vision"); an EAGLE3 head drafts over them.
    spec = replace(SPECS["dense"], extra={"use_bidirectional_attention": "vision"})
    checkpoint = write_tiny_gemma4_multimodal(tmp_path / "gemma4", spec)
    gemma4_image_chat(checkpoint)
    draft = write_gemma3_eagle3(tmp_path, checkpoint)
    with serve(checkpoint, draft, "--tp", "2", "--limit-mm-per-prompt", '{"image": 2}') as stack:
        client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        for images in ([png(0, (40, 70))], [png(0, (40, 70)), png(1, (90, 30))]):
            reply, plain = both_ways(client, checkpoint.name, chat([data_url(data) for data in images]))
            prompt, tokens = gemma4_processed(checkpoint, images)
            assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)
            assert reply.choices[0].message.content == plain == tokenizer.decode(tokens, skip_special_tokens=True)
        metrics = urllib.request.urlopen(f"{stack.http_url}/metrics", timeout=10).read().decode()
        [drafted] = re.findall(r"^vllm:spec_decode_num_draft_tokens_total\{.*\} ([\d.e+]+)$", metrics, re.MULTILINE)
        assert float(drafted) > 0


def kimi_processed(
    checkpoint: Path, tokenizer: PreTrainedTokenizerBase, images: list[bytes]
) -> tuple[list[int], list[int]]:
    """transformers' answer to chat(images) on Kimi-K2.5: the prompt its Kimi_K25Processor (over the torchvision
    stand-in, settings from the checkpoint's preprocessor_config.json) writes for the chat, and the greedy tokens."""
    messages = chat(["image"] * len(images))
    for index, data in enumerate(images):
        messages[0]["content"][1 + index] = {"type": "image", "image": Image.open(io.BytesIO(data)).convert("RGB")}
    with transformers_kimi_image_processing() as module:
        processor = transformers_kimi_processor(module.Kimi_K25ImageProcessor.from_pretrained(checkpoint), tokenizer)
        inputs = processor.apply_chat_template(
            messages, chat_template=tokenizer.chat_template, add_generation_prompt=True, tokenize=True,
            return_dict=True, return_tensors="pt",
        )  # fmt: skip
    prompt = inputs["input_ids"][0].tolist()
    model = Kimi_K25ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            inputs["input_ids"], pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
            do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
        )  # fmt: skip
    return prompt, out[0, len(prompt) :].tolist()


def test_kimi_k25_chat_images_of_their_own_sizes_at_tp_2_with_drafts(tmp_path: Path) -> None:
    # The release's layout served, transformers' layout as the reference; each image takes one <|media_pad|> per
    # 2 x 2 patches of its resized grid (12 and 8 here), between the markers the chat template writes; an EAGLE3 MLA
    # head drafts over them.
    written = write_tiny_kimi_k25(tmp_path / "transformers", TinyDeepseekSpec(num_layers=3))
    tokenizer = kimi_image_chat(written)
    checkpoint = to_hub_layout(Path(shutil.copytree(written, tmp_path / "kimi")))
    draft = write_kimi_eagle3_mla(tmp_path, checkpoint)
    pad = tokenizer.convert_tokens_to_ids("<|media_pad|>")
    with serve(checkpoint, draft, "--tp", "2", "--limit-mm-per-prompt", '{"image": 2}') as stack:
        client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
        for images, placeholders in (([png(0, (40, 70))], 12), ([png(0, (40, 70)), png(1, (90, 30))], 20)):
            reply, plain = both_ways(client, checkpoint.name, chat([data_url(data) for data in images]))
            prompt, tokens = kimi_processed(written, tokenizer, images)
            assert prompt.count(pad) == placeholders
            assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)
            assert reply.choices[0].message.content == plain == tokenizer.decode(tokens, skip_special_tokens=True)
        metrics = urllib.request.urlopen(f"{stack.http_url}/metrics", timeout=10).read().decode()
        [drafted] = re.findall(r"^vllm:spec_decode_num_draft_tokens_total\{.*\} ([\d.e+]+)$", metrics, re.MULTILINE)
        assert float(drafted) > 0

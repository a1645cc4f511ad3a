"""Gemma 3's pan-and-scan, where the checkpoint's image processor asks for it: a wide or tall image is also encoded
as crops, each with its own placeholders after the image's, in the processor's words. The crop count equals
transformers' image processor's; the chat prompt the orchestrator writes equals Gemma3Processor's token for token, its
images' runs map to (image, crop), and the target's greedy tokens equal transformers' generate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, Gemma3ForConditionalGeneration, Gemma3Processor
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from orchestrator.api.chat import chat_prompt_ids
from orchestrator.loop.prompt_images import ImageLayout, prompt_images
from tandem.models.image_encoder import image_encoder_for
from tandem.models.image_prompt import PanAndScan
from tandem.models.registry import load_target
from tandem.sampling.params import SamplingParams
from tandem.settings import KVCacheSettings
from target_server.items import ImageBytes, OpenRequest, StepItem
from target_server.main import target_info
from target_server.runner import TargetRunner
from tests.helpers.gemma4_checkpoints import GEMMA3_CHAT_TEMPLATE, write_tiny_gemma3_multimodal
from tests.helpers.images import opened, png

SETTINGS = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 20, "pan_and_scan_max_num_crops": 3}
NEW_TOKENS = 6


def test_crop_counts_equal_transformers_image_processor() -> None:
    processor = Gemma3ImageProcessorPil()
    generator = np.random.default_rng(3)
    for min_crop_size, max_num_crops, ratio in ((256, 4, 1.2), (20, 3, 1.2), (64, 5, 2.0)):
        ours = PanAndScan(min_crop_size, max_num_crops, ratio)
        for height, width in [*generator.integers(1, 1200, (60, 2)).tolist(), (200, 600), (200, 300), (100, 100)]:
            crops = processor.pan_and_scan(np.zeros((3, height, width)), min_crop_size, max_num_crops, ratio)
            assert ours.crops(height, width) == len(crops), (height, width, min_crop_size, max_num_crops, ratio)
    assert PanAndScan(256, 4, 1.2).crops(200, 600) == 0  # 200 tall: crops of 200 x 200 are under 256


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    written = write_tiny_gemma3_multimodal(tmp_path_factory.mktemp("pan-and-scan"), seed=8)
    settings = json.loads((written / "processor_config.json").read_text())
    settings["image_processor"] |= SETTINGS
    (written / "processor_config.json").write_text(json.dumps(settings))
    return written


def test_a_chat_with_crops_is_served_as_transformers(checkpoint: Path) -> None:
    # A 30 x 90 image (3 crops of 30 x 30), then a square one (none).
    images = [png(30, 90, seed=1), png(40, 40, seed=2)]
    content = [{"type": "text", "text": "Look"}, {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]
    messages = [{"role": "user", "content": content}]
    # transformers' processor crops when its call asks (its own default is off whatever the image processor's file
    # says); asked with the checkpoint's settings, as vLLM's --mm-processor-kwargs asks.
    processor = Gemma3Processor.from_pretrained(checkpoint)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pictures = [opened(data).convert("RGB") for data in images]
    expected_inputs = processor(text=text, images=pictures, return_tensors="pt", **SETTINGS)
    assert expected_inputs["pixel_values"].shape[0] == 5  # the wide image, its 3 crops, the square one
    model = Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**expected_inputs, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    prompt = expected_inputs["input_ids"][0].tolist()
    encoder = image_encoder_for(checkpoint, torch.float32, "cpu")
    assert encoder is not None and encoder.prompt.pan_and_scan == PanAndScan(20, 3, 1.2)
    runner = TargetRunner(load_target(checkpoint), KVCacheSettings(num_blocks=96, block_size=4), 256, images=encoder)
    runner.admission.image_limit = 2
    layout = ImageLayout.announced(target_info(runner, "float32"))
    assert layout is not None and layout.prompt.pan_and_scan == PanAndScan(20, 3, 1.2)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    sizes = [opened(data).size[::-1] for data in images]
    ids = chat_prompt_ids(tokenizer, GEMMA3_CHAT_TEMPLATE, messages, 10_000, images=(layout, sizes))
    assert ids == prompt
    placed = prompt_images(ids, images, layout)
    assert [(image.crop, image.end - image.start) for image in placed] == [(0, 4), (1, 4), (2, 4), (3, 4), (0, 4)]
    opening = OpenRequest(ids, SamplingParams(), images=tuple(ImageBytes(p.start, p.data, p.crop) for p in placed))
    (result,) = runner.step([StepItem("r", len(ids), open=opening)])
    assert result.message == "", result.message
    tokens = result.new_tokens
    while len(tokens) < NEW_TOKENS:
        tokens += runner.verify("r").new_tokens
    assert tokens[:NEW_TOKENS] == out[0, len(prompt) :].tolist()

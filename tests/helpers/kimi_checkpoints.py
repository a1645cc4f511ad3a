"""Tiny random Kimi-K2.5 checkpoints (Kimi_K25ForConditionalGeneration) written with transformers' own classes.

The language model is the tiny DeepSeek-V3 of tests.helpers.deepseek_checkpoints (low-rank queries, interleaved rope,
YaRN, a dense first layer then MoE layers), inside transformers' multimodal Kimi-K2.5 with a tiny vision tower that
the target must not read. Two layouts of the same weights:
- "transformers": what transformers 5.24's save_pretrained writes: `language_model.model.blocks.*` (see `hub_name`),
  `language_model.lm_head.*`, towers under `vision_tower.*`, `mm_projector.*` and `model.mm_projector.*`;
- "hub": the names Moonshot's release uses (`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`,
  `mm_projector.*`, the towers' inner names as the release has them), config `architectures:
  ["KimiK25ForConditionalGeneration"]` and text model_type kimi_k2.
The head is untied, as in the release (top-level tie_word_embeddings false).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM, GenerationConfig, Kimi_K25Config, Kimi_K25ForConditionalGeneration

from tests.helpers.checkpoints import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID
from tests.helpers.deepseek_checkpoints import VOCAB_SIZE, TinyDeepseekSpec, redraw_weights, tiny_deepseek_config
from tests.helpers.tokenizer import write_tokenizer

# Tensor name prefixes of the release that are not the language model.
HUB_TOWERS = ("vision_tower.", "mm_projector.")
# Kimi_K25Config takes them as extra keyword arguments (its typed fields do not list them).
TOKEN_IDS: dict[str, Any] = {"pad_token_id": PAD_TOKEN_ID, "bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID}


def tiny_kimi_k25_config(spec: TinyDeepseekSpec) -> Kimi_K25Config:
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "patch_size": 4,
        "pos_emb_height": 4,
        "pos_emb_width": 4,
    }
    return Kimi_K25Config(
        text_config=tiny_deepseek_config(spec).to_dict(),
        vision_config=vision,
        projection_hidden_size=32,
        # Within the text vocabulary, as the release's are (163605 and 163606 of 163840).
        image_token_id=VOCAB_SIZE - 5,
        video_token_id=VOCAB_SIZE - 4,
        tie_word_embeddings=False,
        dtype="float32",
        **TOKEN_IDS,
    )


def write_tiny_kimi_k25(directory: Path, spec: TinyDeepseekSpec) -> Path:
    """Writes a random Kimi_K25ForConditionalGeneration as transformers' save_pretrained does, plus the tokenizer."""
    with torch.random.fork_rng(devices=[]):
        model = Kimi_K25ForConditionalGeneration(tiny_kimi_k25_config(spec))
    # The DeepSeek-V3 drawing rule applies by parameter name suffix, so it covers the multimodal model as well.
    redraw_weights(cast(DeepseekV3ForCausalLM, model), torch.Generator().manual_seed(spec.seed))
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID
    )
    model.save_pretrained(directory)
    write_tokenizer(directory, VOCAB_SIZE)
    return directory


def to_hub_layout(directory: Path) -> Path:
    """Rewrites a checkpoint written by `write_tiny_kimi_k25` in place with the release's names and config.json."""
    tensors = load_file(str(directory / "model.safetensors"))
    save_file(
        {hub_name(name): tensor for name, tensor in tensors.items()},
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config: dict[str, Any] = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["KimiK25ForConditionalGeneration"]
    config["model_type"] = "kimi_k25"
    config["text_config"] = config["text_config"] | {
        "model_type": "kimi_k2",
        "architectures": ["DeepseekV3ForCausalLM"],
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def hub_name(name: str) -> str:
    """A name as transformers 5.24 saves it -> the release's. transformers writes the language model's layers as
    `language_model.model.blocks.{i}`: its load renames include `blocks` -> `layers` (meant for the vision tower), and
    saving reverts that rename everywhere. Two tower names transformers does not write back as the release has them
    (`vision_tower.encoder.patch_embed.*` and `model.mm_projector.*`) get the release's spelling as well."""
    for saved, hub in (
        ("language_model.model.blocks.", "language_model.model.layers."),
        ("model.mm_projector.", "mm_projector."),
        ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
    ):
        if name.startswith(saved):
            return hub + name[len(saved) :]
    return name

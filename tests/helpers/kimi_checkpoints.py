"""Tiny random Kimi-K2.5 checkpoints (Kimi_K25ForConditionalGeneration) written with transformers' own classes.

The language model is the tiny DeepSeek-V3 of tests.helpers.deepseek_checkpoints (low-rank queries, interleaved rope,
YaRN, a dense first layer then MoE layers), inside transformers' multimodal Kimi-K2.5 with a tiny vision tower that
the target must not read. Two layouts of the same weights:
- "transformers": what transformers 5.24's save_pretrained writes: `language_model.model.blocks.*` (see `hub_name`),
  `language_model.lm_head.*`, towers under `vision_tower.*`, `mm_projector.*` and `model.mm_projector.*`;
- "hub": the names Moonshot's release uses (`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`,
  `mm_projector.*`, the towers' inner names as the release has them), config `architectures:
  ["KimiK25ForConditionalGeneration"]` and text model_type kimi_k2.
The head is untied, as in the release (top-level tie_word_embeddings false). `kimi_image_chat` gives a checkpoint
what a chat with images needs: Kimi-K2.5's markers in the tokenizer, a chat template, preprocessor_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoTokenizer,
    DeepseekV3ForCausalLM,
    GenerationConfig,
    Kimi_K25Config,
    Kimi_K25ForConditionalGeneration,
    PreTrainedTokenizerBase,
)

from tandem.models.kimi_image_processor import KimiImageProcessor
from tests.helpers.checkpoints import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID
from tests.helpers.deepseek_checkpoints import VOCAB_SIZE, TinyDeepseekSpec, redraw_weights, tiny_deepseek_config
from tests.helpers.eagle3_mla_checkpoints import TinyEagle3MLASpec, write_tiny_eagle3_mla
from tests.helpers.tokenizer import write_tokenizer

# Tensor name prefixes of the release that are not the language model.
HUB_TOWERS = ("vision_tower.", "mm_projector.")
# Kimi_K25Config takes them as extra keyword arguments (its typed fields do not list them).
TOKEN_IDS: dict[str, Any] = {"pad_token_id": PAD_TOKEN_ID, "bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID}
# The image chat's tokenizer ends with these, added as special tokens after a test tokenizer of VOCAB_SIZE - 9 tokens
# (so that every id the model can emit decodes): Kimi-K2.5's turn and media markers, `<|media_pad|>` at the config's
# image_token_id (VOCAB_SIZE - 5) and the video placeholder at its video_token_id, so that no marker the template
# writes has the video id (transformers embeds a token of either id as token 0).
KIMI_TOKENS = (
    *("<|im_end|>", "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"),
    *("<|kimi_k25_video_placeholder|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"),
)
# Kimi-K2.5's chat template, shortened (no system turn, tools or thinking): a turn per message, an image part written
# as the release's is.
KIMI_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_' + message['role'] + '|>' + message['role'] + '<|im_middle|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|media_begin|>image<|media_content|><|media_pad|><|media_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}"
)
# The tiny tower's patches are 4 pixels and its position table 4 x 4: at most 8 patches a side and 48 in all.
KIMI_PROCESSING: dict[str, Any] = {
    "patch_size": 4,
    "merge_size": 2,
    "size": {"max_height": 8, "max_width": 8},
    "max_patches": 48,
}


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


def kimi_image_chat(directory: Path) -> PreTrainedTokenizerBase:
    """Gives the Kimi-K2.5 checkpoint in `directory` (written by `write_tiny_kimi_k25`) a tokenizer with Kimi-K2.5's
    markers as special tokens (KIMI_TOKENS, `<|media_pad|>` at the config's image_token_id), the shortened chat
    template, and preprocessor_config.json with the tiny tower's settings; returns the tokenizer as read back."""
    write_tokenizer(directory, VOCAB_SIZE - len(KIMI_TOKENS))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens(list(KIMI_TOKENS), special_tokens=True)
    tokenizer.chat_template = KIMI_CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    KimiImageProcessor(**KIMI_PROCESSING).save_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    assert len(tokenizer) == VOCAB_SIZE
    assert tokenizer.convert_tokens_to_ids(list(KIMI_TOKENS)) == list(range(VOCAB_SIZE - len(KIMI_TOKENS), VOCAB_SIZE))
    named = tokenizer.convert_tokens_to_ids(["<|media_pad|>", "<|kimi_k25_video_placeholder|>"])
    assert named == [config["image_token_id"], config["video_token_id"]]
    return tokenizer


def write_kimi_eagle3_mla(directory: Path, checkpoint: Path) -> Path:
    """A random EAGLE3 MLA head (Kimi-K2.5's draft layout, with its own embedding) for the text model of the
    Kimi-K2.5 `checkpoint`, capturing the inputs of its layers 0, 1 and 2."""
    shape = directory / "target-shape"
    shape.mkdir(parents=True)
    (shape / "config.json").write_text(json.dumps(json.loads((checkpoint / "config.json").read_text())["text_config"]))
    return write_tiny_eagle3_mla(directory / "draft", shape, TinyEagle3MLASpec(layer_ids=(0, 1, 2)))

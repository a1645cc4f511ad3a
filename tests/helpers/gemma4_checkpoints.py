"""Tiny random Gemma 4 checkpoints written with transformers' own classes and save_pretrained: the text model
(Gemma4ForCausalLM) and the multimodal wrappers of Gemma 3 and Gemma 4 (Gemma3ForConditionalGeneration,
Gemma4ForConditionalGeneration) with small vision (and audio) towers, plus the test tokenizer.

Every weight is redrawn (norm weights around 1, or around 0 for Gemma 3's (1 + w) norms), and so are the buffers
transformers initialises to 1 (each layer's layer_scalar), the router's scales and, where the vision config asks for
them, the vision tower's clamp bounds (infinite at initialisation) and its standardizing bias and scale, so that a
weight or a scalar applied in the wrong place shows. The sliding window (8) is shorter than the test sequences.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoTokenizer,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3Processor,
    Gemma3TextConfig,
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

from tests.helpers.checkpoints import TinyEagle3Spec, redraw_parameters, write_tiny_eagle3
from tests.helpers.gemma3_checkpoints import GLOBAL, LOCAL, WINDOW
from tests.helpers.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, write_tokenizer

VOCAB = 320
LAYER_TYPES = (LOCAL, LOCAL, GLOBAL, LOCAL, LOCAL, GLOBAL)
GEMMA4_SOFT_TOKENS = 70  # the smallest budget Gemma 4's image processor takes (the releases': 280)


@dataclass(frozen=True)
class TinyGemma4Spec:
    layer_types: tuple[str, ...] = LAYER_TYPES
    num_key_value_heads: int = 2
    global_head_dim: int = 32  # the sliding layers' head_dim is 16
    num_global_key_value_heads: int | None = 2
    attention_k_eq_v: bool = True
    partial_rotary_factor: float = 0.5
    per_layer_input_size: int = 8  # 0: none
    num_kv_shared_layers: int = 2
    use_double_wide_mlp: bool = True
    enable_moe_block: bool = False
    final_logit_softcapping: float | None = 3.0
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    sliding_window: int = WINDOW


SPECS = {
    # Per-layer inputs, the last two layers KV-shared (one of each type) with double-wide MLPs, full layers with
    # their own head dim and K=V heads, a strong softcap.
    "dense": TinyGemma4Spec(),
    # Routed experts beside the dense MLPs, full layers with v_proj and two KV heads, an untied head with biases.
    "moe": TinyGemma4Spec(
        num_global_key_value_heads=2,
        attention_k_eq_v=False,
        per_layer_input_size=0,
        num_kv_shared_layers=0,
        use_double_wide_mlp=False,
        enable_moe_block=True,
        final_logit_softcapping=None,
        tie_word_embeddings=False,
        attention_bias=True,
        seed=1,
    ),
}
# The dense target with a window longer than the tests' sequences: every layer sees every row.
LONG_WINDOW = replace(SPECS["dense"], sliding_window=64)


def gemma4_text_config(spec: TinyGemma4Spec) -> Gemma4TextConfig:
    # The hub's spelling of the full layers' shapes; transformers saves them as per_layer_config.
    full_layers: dict[str, Any] = {
        "global_head_dim": spec.global_head_dim,
        "num_global_key_value_heads": spec.num_global_key_value_heads,
    }
    moe: dict[str, Any] = (
        {"num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 24} if spec.enable_moe_block else {}
    )
    return Gemma4TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(spec.layer_types),
        num_attention_heads=4,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=16,
        attention_k_eq_v=spec.attention_k_eq_v,
        max_position_embeddings=512,
        sliding_window=spec.sliding_window,
        layer_types=list(spec.layer_types),
        rope_parameters={
            GLOBAL: {
                "rope_type": "proportional",
                "partial_rotary_factor": spec.partial_rotary_factor,
                "rope_theta": 50_000.0,
            },
            LOCAL: {"rope_type": "default", "rope_theta": 1_000.0},
        },
        hidden_size_per_layer_input=spec.per_layer_input_size,
        vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=spec.num_kv_shared_layers,
        use_double_wide_mlp=spec.use_double_wide_mlp,
        enable_moe_block=spec.enable_moe_block,
        final_logit_softcapping=spec.final_logit_softcapping,
        attention_bias=spec.attention_bias,
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN),
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        dtype="float32",
        **full_layers,
        **moe,
        **spec.extra,
    )


def redraw_gemma4(model: PreTrainedModel, seed: int) -> None:
    """Redraws every weight, each layer's layer_scalar and the routers' scales (module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    redraw_parameters(model, generator, norm_center=1.0)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("layer_scalar"):  # below 1, as in the releases, which keeps the streams small
                tensor.copy_(0.3 + 0.5 * torch.rand(tensor.shape, generator=generator))
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                # The softmax scale is 1 and q, k are normed to length sqrt(head_dim): halved q/k norm weights keep
                # the scores within a few units, where float32 rounding is not amplified past the tolerance.
                tensor.mul_(0.5)
            elif name.endswith(("router.scale", "router.per_expert_scale")):
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=generator))
            elif "vision_tower" in name and name.endswith(("input_max", "output_max", "input_min", "output_min")):
                # Bounds of 1 to 2 in size: the tails of a linear's inputs and outputs are clamped (the audio
                # tower's stay infinite).
                sign = -1.0 if name.endswith("min") else 1.0
                tensor.copy_(sign * (1.0 + torch.rand(tensor.shape, generator=generator)))
            elif name.endswith("std_bias"):
                tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith("std_scale"):
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=generator))


def write_tiny_gemma4(directory: Path, spec: TinyGemma4Spec) -> Path:
    """A random Gemma4ForCausalLM saved with transformers' save_pretrained, plus the test tokenizer."""
    with torch.random.fork_rng(devices=[]):
        model = Gemma4ForCausalLM(gemma4_text_config(spec))
    redraw_gemma4(model, spec.seed)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory, VOCAB)
    return directory


def write_tiny_gemma4_multimodal(directory: Path, spec: TinyGemma4Spec, vision: dict[str, Any] | None = None) -> Path:
    """A random Gemma4ForConditionalGeneration (vision and audio towers, `vision` overriding the vision config) saved
    by transformers, plus its image processor (GEMMA4_SOFT_TOKENS per image at most) and the tokenizer."""
    config = Gemma4Config(
        text_config=gemma4_text_config(spec),
        # The image's ids within the tiny vocabulary, as the release's are within its own (Gemma 3's: the same).
        boi_token_id=VOCAB - 3,
        eoi_token_id=VOCAB - 2,
        image_token_id=VOCAB - 1,
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 8,
            **(vision or {}),
        },
        audio_config={
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "output_proj_dims": 16,
            "subsampling_conv_channels": [4, 4],
            "conv_kernel_size": 3,
        },
    )
    with torch.random.fork_rng(devices=[]):
        model = Gemma4ForConditionalGeneration(config)
    redraw_gemma4(model, spec.seed)
    model.save_pretrained(directory, safe_serialization=True)
    vision_config = config.vision_config
    Gemma4ImageProcessorPil(
        patch_size=vision_config.patch_size,
        pooling_kernel_size=vision_config.pooling_kernel_size,
        max_soft_tokens=GEMMA4_SOFT_TOKENS,
    ).save_pretrained(directory)
    write_tokenizer(directory, VOCAB)
    return directory


def gemma3_text_config() -> Gemma3TextConfig:
    """The Gemma 3 test text model (tests.helpers.gemma3_checkpoints): local, local, global, local layers, a window
    of 8, both rope bases changed and the global one linearly scaled, a softcap."""
    return Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=[LOCAL, LOCAL, GLOBAL, LOCAL],
        rope_parameters={
            GLOBAL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 50_000.0},
            LOCAL: {"rope_type": "default", "rope_theta": 1_000.0},
        },
        final_logit_softcapping=2.0,
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN),
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
    )


def write_tiny_gemma3_multimodal(
    directory: Path, seed: int = 0, vision: dict[str, Any] | None = None, tokens_per_image: int = 4
) -> Path:
    """A random Gemma3ForConditionalGeneration (a small SigLIP tower, `vision` overriding its config; the text model
    of gemma3_text_config with an untied head) saved by transformers, plus its processor and tokenizer."""
    config = Gemma3Config(
        text_config=gemma3_text_config(),
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
            **(vision or {}),
        },
        mm_tokens_per_image=tokens_per_image,
        # The image tokens at the top of the small vocabulary (the released ones lie past it: 255999, 256000, 262144).
        boi_token_index=VOCAB - 3,
        eoi_token_index=VOCAB - 2,
        image_token_index=VOCAB - 1,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        model = Gemma3ForConditionalGeneration(config)
    # Gemma 3's norms scale by (1 + weight): weights near 0.
    redraw_parameters(model, torch.Generator().manual_seed(seed), norm_center=0.0)
    model.save_pretrained(directory, safe_serialization=True)
    # The checkpoint's processor, as Gemma 3's releases ship it (there 896 x 896, no pan-and-scan): the image
    # processor, the tokenizer with the image tokens and a chat template writing an image part as its begin token.
    size = config.vision_config.image_size
    images = Gemma3ImageProcessorPil(size={"height": size, "width": size})
    tokenizer = gemma3_image_tokenizer(directory)
    Gemma3Processor(images, tokenizer, GEMMA3_CHAT_TEMPLATE, image_seq_length=tokens_per_image).save_pretrained(
        directory
    )
    return directory


# Gemma 3's chat template, shortened (no system turn): a turn per message, an image part written as <start_of_image>.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}{% elif item['type'] == 'text' %}{{ item['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
# Gemma 4's names for them; its template writes an image part as the image token, which its processor expands.
GEMMA4_IMAGE_TOKENS = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>"}
GEMMA4_CHAT_TEMPLATE = GEMMA3_CHAT_TEMPLATE.replace("<start_of_image>", "<|image|>")


def gemma3_image_tokenizer(directory: Path, names: dict[str, str] = IMAGE_TOKENS) -> PreTrainedTokenizerBase:
    """The test tokenizer with the image tokens as its last three (VOCAB - 3: begin, end, placeholder), named as
    Gemma's tokenizers name them (boi_token, eoi_token, image_token), saved in `directory` and read back."""
    write_tokenizer(directory, VOCAB - len(names))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens(list(names.values()), special_tokens=True)
    tokenizer.save_pretrained(directory)
    config_file = directory / "tokenizer_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"extra_special_tokens": names}))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert tokenizer.convert_tokens_to_ids(list(names.values())) == [VOCAB - 3, VOCAB - 2, VOCAB - 1]
    return tokenizer


def gemma4_image_chat(directory: Path) -> None:
    """A Gemma 4 multimodal checkpoint's tokenizer with its image tokens, and a chat template writing an image part
    as Gemma 4's does (the image token)."""
    tokenizer = gemma3_image_tokenizer(directory, GEMMA4_IMAGE_TOKENS)
    tokenizer.chat_template = GEMMA4_CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)


def write_gemma3_eagle3(directory: Path, checkpoint: Path, image_embeddings: str | None = None) -> Path:
    """A random EAGLE3 head for the text model of the multimodal `checkpoint`: narrower than the target with its own
    embedding, or, with `image_embeddings` (the config key), as wide as the target, taking the target's table."""
    shape = directory / "target-shape"
    shape.mkdir(parents=True)
    (shape / "config.json").write_text(json.dumps(json.loads((checkpoint / "config.json").read_text())["text_config"]))
    if image_embeddings is None:
        spec = TinyEagle3Spec(hidden_size=32, include_embedding=True, layer_ids=[0, 1, 2])
        return write_tiny_eagle3(directory / "draft", shape, spec)
    draft = write_tiny_eagle3(directory / "draft", shape, TinyEagle3Spec(layer_ids=[0, 1, 2]))
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(config | {"image_embeddings": image_embeddings}))
    return draft

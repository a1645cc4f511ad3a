"""Tiny random Gemma3ForCausalLM checkpoints written with transformers' own classes, plus the test tokenizer.

The sliding window of 8 is shorter than the test sequences, layer types are mixed (local, local, global, local),
both rope bases differ from the defaults and the global one is linearly scaled, and query_pre_attn_scalar differs
from head_dim, so a layer given the wrong rope, window or scale shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Gemma3ForCausalLM as ReferenceGemma3
from transformers import Gemma3TextConfig

from tests.helpers.checkpoints import redraw_parameters
from tests.helpers.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, write_tokenizer

LOCAL, GLOBAL = "sliding_attention", "full_attention"
WINDOW = 8


@dataclass(frozen=True)
class TinyGemma3Spec:
    layer_types: tuple[str, ...] = (LOCAL, LOCAL, GLOBAL, LOCAL)
    sliding_window: int = WINDOW
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    vocab_size: int = 320
    seed: int = 0


SPECS = {
    "tied": TinyGemma3Spec(),
    # A cap of 2 bends logits of a few units strongly, so a missing or misplaced softcap shows.
    "softcap-untied-bias": TinyGemma3Spec(final_logit_softcapping=2.0, tie_word_embeddings=False, attention_bias=True),
}


def write_tiny_gemma3(directory: Path, spec: TinyGemma3Spec) -> Path:
    """Writes a random Gemma3ForCausalLM with transformers' own classes, plus the test tokenizer."""
    config = Gemma3TextConfig(
        vocab_size=spec.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(spec.layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        query_pre_attn_scalar=24,
        sliding_window=spec.sliding_window,
        layer_types=list(spec.layer_types),
        rope_parameters={
            GLOBAL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 50_000.0},
            LOCAL: {"rope_type": "default", "rope_theta": 1_000.0},
        },
        final_logit_softcapping=spec.final_logit_softcapping,
        attention_bias=spec.attention_bias,
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN),
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        model = ReferenceGemma3(config)
    # Gemma norms scale by (1 + weight): weights near 0 give scales near 1, but not exactly 1.
    redraw_parameters(model, torch.Generator().manual_seed(spec.seed), norm_center=0.0)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory, config.vocab_size)
    return directory

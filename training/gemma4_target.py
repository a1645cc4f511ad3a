"""A Gemma 4 target to measure Gemma 4's drafters on: a text Gemma4ForCausalLM, trained from scratch here.

It learns the demo's corpus (training.data, the same held-out packages) with the demo target's tokenizer, through
transformers' own Gemma4ForCausalLM (the family's reference) and the demo target's loop (training.target), and is
saved with save_pretrained, so that Tandem's loader and transformers read the same files. Its shape keeps what
Gemma 4's assistant depends on: sliding and full layers (the window shorter than the sequences trained and served),
full layers with their own head dim and shared keys and values (`attention_k_eq_v`), scaled embeddings, a tied and
softcapped LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Gemma4ForCausalLM, Gemma4TextConfig, GenerationConfig, PreTrainedTokenizerFast

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Gemma4Shape:
    hidden_size: int = 512
    intermediate_size: int = 1536
    layer_types: tuple[str, ...] = (SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL)
    num_heads: int = 8
    num_kv_heads: int = 4  # sliding layers
    head_dim: int = 64  # sliding layers
    num_global_kv_heads: int = 2  # full layers: keys are values (attention_k_eq_v)
    global_head_dim: int = 128
    sliding_window: int = 128
    final_logit_softcapping: float = 30.0
    max_position_embeddings: int = 2048

    def hf_config(self, vocab_size: int, end_of_text_id: int, pad_id: int) -> Gemma4TextConfig:
        full_shapes: dict[str, Any] = {"num_global_key_value_heads": self.num_global_kv_heads}
        full_shapes["global_head_dim"] = self.global_head_dim
        return Gemma4TextConfig(
            architectures=["Gemma4ForCausalLM"],
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=len(self.layer_types),
            layer_types=list(self.layer_types),
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            attention_k_eq_v=True,
            sliding_window=self.sliding_window,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
                SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            },
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=vocab_size,
            num_kv_shared_layers=0,
            final_logit_softcapping=self.final_logit_softcapping,
            tie_word_embeddings=True,
            bos_token_id=end_of_text_id,
            eos_token_id=end_of_text_id,
            pad_token_id=pad_id,
            dtype="bfloat16",
            # The full layers' own shapes, as the releases spell them (transformers saves them per layer).
            **full_shapes,
        )


def build_gemma4_target(config: Gemma4TextConfig, seed: int) -> Gemma4ForCausalLM:
    """A freshly initialised target, as transformers initialises the class (normal weights of std 0.02)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Gemma4ForCausalLM(config).float()


def gemma4_loss(model: Gemma4ForCausalLM, blocks: torch.Tensor) -> torch.Tensor:  # blocks [batch, length + 1]
    """Mean next-token cross-entropy of the softcapped logits."""
    logits = model(input_ids=blocks[:, :-1], use_cache=False).logits  # [batch, length, vocab]
    return F.cross_entropy(logits.flatten(0, 1).float(), blocks[:, 1:].flatten())


def save_gemma4_target(model: Gemma4ForCausalLM, tokenizer: PreTrainedTokenizerFast, directory: Path) -> None:
    """save_pretrained in bf16, the generation config and the tokenizer files."""
    config: Any = model.config
    nn.Module.to(model, torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    model.float()
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(directory)
    tokenizer.save_pretrained(directory)

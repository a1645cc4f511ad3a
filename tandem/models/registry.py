"""Builds and loads target models from Hugging Face directories."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tandem.models.config import ModelConfig, read_hf_config
from tandem.models.llama import LlamaForCausalLM
from tandem.weights.loader import NameMap, iter_tensors, load_weights

LOG = logging.getLogger(__name__)

# Tensors a target checkpoint may carry that the target model does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_target(model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LlamaForCausalLM:
    config = ModelConfig.from_hf(read_hf_config(model_dir))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    unused = load_weights(model, iter_tensors(model_dir), NameMap(), source=str(model_dir))
    tied_head = ["lm_head.weight"] if config.tie_word_embeddings else []
    unexpected = [name for name in unused if name not in tied_head and not name.endswith(_IGNORED_SUFFIXES)]
    if unexpected:
        LOG.warning("%s: %d checkpoint tensors not used, e.g. %s", model_dir, len(unexpected), unexpected[:3])
    model.eval()
    return model

"""EAGLE3 draft head in the SpecForge / SGLang checkpoint format.

One decoder layer (the target families' DecoderLayer with 2*hidden attention input). For each row:
    residual  = fc(aux features)           first step: target features [num_aux * target_hidden]
              = previous draft hidden      later steps (width hidden, fc skipped)
    attention input = concat([input_layernorm(embed(token)), hidden_norm(residual)])   # embedding first
    stream    = layer(residual, attention input)
    logits    = lm_head(norm(stream))      over the draft vocabulary; target id = draft id + d2t[draft id]
    carried   = stream (pre-norm), or norm(stream) when norm_output is set
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.layers.kv_cache import AttentionMetadata, PagedKVCache
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.config import ConfigError, FamilyTraits, ModelConfig, read_hf_config
from tandem.models.llama import DecoderLayer
from tandem.weights.loader import NameMap, checkpoint_files, iter_tensors, load_weights

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")

# Checkpoint prefixes -> module names; specific renames first (first match wins).
EAGLE3_NAME_MAP = NameMap(
    renames=(
        ("midlayer.hidden_norm.", "hidden_norm."),
        ("layers.0.hidden_norm.", "hidden_norm."),
        ("midlayer.", "layer."),
        ("layers.0.", "layer."),
        ("aux_norm_low.", "fc_norm.0."),
        ("aux_norm_mid.", "fc_norm.1."),
        ("aux_norm_high.", "fc_norm.2."),
    )
)


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the decoder layer's shapes; layer.vocab_size is the TARGET vocabulary
    target_hidden_size: int
    draft_vocab_size: int
    num_aux: int
    aux_layer_ids: tuple[int, ...] | None
    fc_norm: bool  # one RMSNorm per aux chunk before fc
    norm_before_fc: bool  # one RMSNorm over the whole concatenation before fc
    norm_output: bool  # carry the post-norm hidden to the next step instead of the pre-norm stream

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Eagle3Config:
        architecture = (hf.get("architectures") or ["?"])[0]
        if architecture not in EAGLE3_ARCHITECTURES:
            known = ", ".join(EAGLE3_ARCHITECTURES)
            raise ConfigError(f"architectures: {architecture!r} is not an EAGLE3 head ({known})")
        if int(hf.get("num_hidden_layers", 1)) != 1:
            raise ConfigError(f"num_hidden_layers: EAGLE3 heads have 1 layer, got {hf['num_hidden_layers']}")
        layer = ModelConfig.from_hf(hf, traits=FamilyTraits())
        eagle = hf.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids", hf.get("eagle_aux_hidden_state_layer_ids"))
        aux_ids = tuple(int(i) for i in ids) if ids else None
        num_aux = int(hf.get("num_aux_hidden_states") or (len(aux_ids) if aux_ids else 3))
        return cls(
            layer=layer,
            target_hidden_size=int(hf.get("target_hidden_size") or layer.hidden_size),
            draft_vocab_size=int(hf.get("draft_vocab_size") or layer.vocab_size),
            num_aux=num_aux,
            aux_layer_ids=aux_ids,
            fc_norm=bool(hf.get("fc_norm", hf.get("use_aux_norm", False))),
            norm_before_fc=bool(eagle.get("norm_before_fc", hf.get("norm_before_fc", False))),
            norm_output=bool(hf.get("norm_output", False)),
        )


@dataclass(frozen=True)
class DraftStep:
    hidden: torch.Tensor  # [num_tokens, hidden] carried to the next step
    logits: torch.Tensor  # [num_tokens, draft_vocab] float32


class Eagle3Draft(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        aux_width = config.num_aux * config.target_hidden_size
        self.rotary = RotaryEmbedding(config.layer.head_dim, config.layer.rope)
        self.embed_tokens = nn.Embedding(config.layer.vocab_size, hidden)
        self.fc_norm = (
            nn.ModuleList(RMSNorm(config.target_hidden_size, config.layer.rms_norm_eps) for _ in range(config.num_aux))
            if config.fc_norm
            else None
        )
        self.norm_before_fc = RMSNorm(aux_width, config.layer.rms_norm_eps) if config.norm_before_fc else None
        self.fc = nn.Linear(aux_width, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.layer.rms_norm_eps)
        self.layer = DecoderLayer(config.layer, 0, self.rotary, attention_input_size=2 * hidden)
        self.norm = RMSNorm(hidden, config.layer.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """[num_tokens, num_aux * target_hidden] target aux features -> [num_tokens, hidden]."""
        if self.fc_norm is not None:
            chunks = features.split(self.config.target_hidden_size, dim=-1)
            features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        if self.norm_before_fc is not None:
            features = self.norm_before_fc(features)
        return self.fc(features)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] target vocabulary ids
        hidden: torch.Tensor,  # [num_tokens, hidden] projected target features or the previous draft hidden
        metadata: AttentionMetadata,
        cache: PagedKVCache,
    ) -> DraftStep:
        embedded = self.layer.input_layernorm(self.embed_tokens(input_ids))
        attention_input = torch.cat([embedded, self.hidden_norm(hidden)], dim=-1)  # [num_tokens, 2 * hidden]
        stream = self.layer(hidden, metadata, cache, attention_input=attention_input)
        normed = self.norm(stream)
        logits = self.lm_head(normed).float()
        return DraftStep(hidden=normed if self.config.norm_output else stream, logits=logits)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:  # [n] draft ids -> [n] target ids
        d2t: torch.Tensor = self.d2t  # type: ignore[assignment]
        return draft_ids + d2t[draft_ids]


def checkpoint_has(model_dir: Path, name: str) -> bool:
    from safetensors import safe_open

    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            if name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                return True
    return False


def load_eagle3(model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> tuple[Eagle3Draft, bool]:
    """Loads an EAGLE3 head; returns (model, has_embedding). Without an embedding in the checkpoint the
    caller must fill `embed_tokens` from the target."""
    config = Eagle3Config.from_hf(read_hf_config(model_dir))
    with torch.device("meta"):
        model = Eagle3Draft(config)
    model = model.to_empty(device=device).to(dtype)
    # The embedding usually comes from the target; d2t may be absent when the draft vocabulary is the full one.
    full_vocabulary = config.draft_vocab_size == config.layer.vocab_size
    optional = frozenset({"embed_tokens.weight", "d2t"} if full_vocabulary else {"embed_tokens.weight"})
    model.d2t.zero_()  # type: ignore[operator]
    load_weights(model, iter_tensors(model_dir), EAGLE3_NAME_MAP, source=str(model_dir), optional=optional)
    d2t: torch.Tensor = model.d2t  # type: ignore[assignment]
    target_ids = torch.arange(config.draft_vocab_size, device=d2t.device) + d2t
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= config.layer.vocab_size:
        raise ConfigError(
            f"d2t: maps draft ids to target ids {int(target_ids.min())}..{int(target_ids.max())}, "
            f"outside the target vocabulary 0..{config.layer.vocab_size - 1}"
        )
    model.eval()
    return model, checkpoint_has(model_dir, "embed_tokens.weight")

"""DFlash2 (z-lab's `DFlash2DraftModel`): DFlash's block drafter (tandem.models.dflash) with two additions, and how
every block drafter is loaded by its architecture name.

1. A dynamic convolution around each sublayer of each layer, over the rows of one block (causal inside the block,
   never reaching the context or another request's block). Per sublayer (attention, MLP), from its normed input x:

       d       = kernel_projection(x)           [rows, 2, taps, groups]: a pre and a post coefficient per tap and group
       conv(y, side)[i] = sum over taps t <= i of (base_kernel[side, t] + d[i, side, t]) * y[i - t]
                          (base_kernel [2, taps, hidden]; d's value of a group spans its conv_group_size channels)
       out     = conv(sublayer(conv(x, 0)), 1)   added to the residual as the sublayer's output was

   The context rows' K/V stay DFlash's (k/v_proj of the context, no convolution): only the block's rows go through it.
2. A path selector that chooses each draft among the top candidates of its row instead of the argmax. With the
   logits of DFlash (the target's LM head over the final norm, scaled and capped as the config says):

       candidates  = the selector_top_k largest logits of row j (ids c, values u), largest first
       score[c]    = u[c] + sum over r of predecessor_codebook[previous, r] * hidden_projection(h_j)[r]
                                                                    * successor_codebook[c, r]
       draft_j     = the candidate of the highest score (the first of equal ones)

   `previous` is the anchor for the first drafting row, then the draft before: a greedy walk, left to right.
   A request's penalties, bias and min_tokens shape the logits before the candidates are taken.

Config: DFlash's, plus `conv_kernel_size` (taps), `conv_group_size`, `selector_rank`, `selector_top_k` in
`dflash_config` (or the top level). Weights: DFlash's, plus `layers.N.{attention,mlp}_conv.base_kernel` and
`.kernel_projection.weight`, and `candidate_selector.{predecessor,successor}_codebook` ([vocab, rank]) and
`.hidden_projection.weight`. What crosses the wire is DFlash's: the target layers' features.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.kv_cache import PagedKVCache
from tandem.layers.matmul import Linear
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.block_format import (
    DFLASH2_ARCHITECTURES,
    DFLASH_ARCHITECTURES,
    DSPARK_ARCHITECTURES,
    architecture_name,
    draft_value,
)
from tandem.models.config import ConfigError, read_hf_config
from tandem.models.dflash import BlockStep, DFlashConfig, DFlashDraft, DFlashLayer, load_block_weights, load_dflash


@dataclass(frozen=True)
class DFlash2Fields:
    taps: int  # conv_kernel_size
    group_size: int  # conv_group_size: channels that share a dynamic coefficient
    rank: int  # selector_rank
    top_k: int  # selector_top_k: candidates per row

    @classmethod
    def from_hf(cls, hf: dict[str, Any], hidden_size: int, vocab_size: int) -> DFlash2Fields:
        names = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        values = {name: draft_value(hf, name) for name in names}
        for name, value in values.items():
            if value is None or int(value) < 1:
                raise ConfigError(f"dflash_config.{name}: {value!r}; a DFlash2 draft needs a positive one")
        fields = cls(*(int(values[name]) for name in names))
        if hidden_size % fields.group_size:
            raise ConfigError(f"conv_group_size: {fields.group_size} does not divide hidden_size {hidden_size}")
        if fields.top_k > vocab_size:
            raise ConfigError(f"selector_top_k: {fields.top_k} candidates, but vocab_size is {vocab_size}")
        return fields


class DynamicConv(nn.Module):
    """The convolution around one sublayer (module docstring, 1.)."""

    def __init__(self, hidden: int, fields: DFlash2Fields, block_size: int) -> None:
        super().__init__()
        self.taps, self.group_size, self.block_size = fields.taps, fields.group_size, block_size
        self.base_kernel = nn.Parameter(torch.empty(2, fields.taps, hidden))
        self.kernel_projection = Linear(hidden, 2 * fields.taps * (hidden // fields.group_size), bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [rows, hidden]
        """The sublayer's input convolved, and the post coefficients ([rows, taps, groups]) for `finish`."""
        coefficients = self.kernel_projection(x).view(x.shape[0], 2, self.taps, -1)
        return self.convolve(x, coefficients[:, 0], 0), coefficients[:, 1]

    def finish(self, y: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        return self.convolve(y, coefficients, 1)

    def convolve(self, y: torch.Tensor, coefficients: torch.Tensor, side: int) -> torch.Tensor:
        rows, hidden = y.shape
        blocks = y.view(rows // self.block_size, self.block_size, -1, self.group_size)  # [blocks, B, groups, size]
        kernel = self.base_kernel[side].view(self.taps, -1, self.group_size)
        dynamic = coefficients.reshape(blocks.shape[0], self.block_size, self.taps, -1, 1)
        out = torch.zeros_like(blocks)
        for tap in range(min(self.taps, self.block_size)):
            # Row i reads row i - tap of its own block; the first `tap` rows of a block have none (zeros).
            shifted = F.pad(blocks[:, : self.block_size - tap], (0, 0, 0, 0, tap, 0))
            out = out + (kernel[tap] + dynamic[:, :, tap]) * shifted
        return out.view(rows, hidden)


class DFlash2Layer(DFlashLayer):
    def __init__(self, config: DFlashConfig, index: int, rotary: RotaryEmbedding, fields: DFlash2Fields) -> None:
        super().__init__(config, index, rotary)
        self.attention_conv = DynamicConv(config.hidden_size, fields, config.block_size)
        self.mlp_conv = DynamicConv(config.hidden_size, fields, config.block_size)

    def forward(
        self, block: torch.Tensor, context: torch.Tensor, step: BlockStep, cache: PagedKVCache
    ) -> torch.Tensor:  # [blocks * B, hidden] -> the same
        x, after = self.attention_conv.prepare(self.input_layernorm(block))
        block = block + self.attention_conv.finish(self.self_attn(torch.cat([context, x]), step, cache), after)
        x, after = self.mlp_conv.prepare(self.post_attention_layernorm(block))
        return block + self.mlp_conv.finish(self.mlp(x), after)


class CandidateSelector(nn.Module):
    """The path selector's low-rank transition score (module docstring, 2.)."""

    def __init__(self, hidden: int, vocab: int, fields: DFlash2Fields) -> None:
        super().__init__()
        self.top_k = fields.top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, fields.rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, fields.rank))
        self.hidden_projection = Linear(hidden, fields.rank, bias=False)

    def forward(
        self, logits: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor
    ) -> torch.Tensor:  # [n, vocab] float32, [n, hidden], [n] -> [n] the chosen candidates
        unary, candidates = logits.topk(self.top_k, dim=-1)
        context = self.predecessor_codebook[previous].float() * self.hidden_projection(hidden).float()  # [n, rank]
        transition = torch.einsum("nr,nkr->nk", context, self.successor_codebook[candidates].float())
        return candidates.gather(1, (unary + transition).argmax(dim=-1, keepdim=True)).squeeze(1)


class DFlash2Draft(DFlashDraft):
    def __init__(self, config: DFlashConfig, fields: DFlash2Fields) -> None:
        super().__init__(config)
        self.fields = fields
        self.layers = nn.ModuleList(
            DFlash2Layer(config, index, self.rotary, fields) for index in range(config.layer.num_layers)
        )
        self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size, fields)

    @property
    def row_by_row(self) -> bool:
        return True

    def choose(self, logits: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        return self.candidate_selector(logits, hidden, previous)


def load_dflash2(
    model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[DFlashDraft, tuple[str, ...]]:
    """Loads a DFlash2 drafter; its checkpoint, like DFlash's, has no embedding or LM head (both returned missing)."""
    hf = read_hf_config(model_dir)
    config = DFlashConfig.from_hf(hf)
    fields = DFlash2Fields.from_hf(hf, config.hidden_size, config.vocab_size)
    return load_block_weights(model_dir, lambda: DFlash2Draft(config, fields), dtype, device)


BlockLoader = Callable[[Path, torch.dtype, str], tuple[DFlashDraft, tuple[str, ...]]]
BLOCK_LOADERS: dict[str, BlockLoader] = {
    **dict.fromkeys(DFLASH_ARCHITECTURES + DSPARK_ARCHITECTURES, load_dflash),
    **dict.fromkeys(DFLASH2_ARCHITECTURES, load_dflash2),
}


def load_block_draft(
    model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[DFlashDraft, tuple[str, ...]]:
    """Any block drafter (DFlash, DFlash2, DSpark), by its config's architecture name, and the tables it lacks."""
    architecture = architecture_name(read_hf_config(model_dir))
    if architecture not in BLOCK_LOADERS:
        raise ConfigError(f"architectures: {architecture!r} is not a block drafter ({', '.join(BLOCK_LOADERS)})")
    return BLOCK_LOADERS[architecture](model_dir, dtype, device)

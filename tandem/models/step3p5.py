"""Step-3.5 / Step-3.7 text causal LM on the paged KV cache, assembled from the shared blocks.

Served from the hub's text-only `Step3p5ForCausalLM` checkpoints and from `Step3p7ForConditionalGeneration` ones (its
text model; the vision tower's tensors are not read). Both store the text model in the same (hub) layout, which is
also what transformers 5.24's save_pretrained writes: `model.embed_tokens`, `model.layers.N.*`, `model.norm`,
`lm_head`. The configuration is translated in tandem.models.step3p5_config.

What differs from the Llama family, each a flag of a shared block or a line here:
- full and sliding-window layers (`layer_types`), the sliding ones possibly with more query heads
  (`num_sliding_attention_heads`, legacy `attention_other_setting`); the KV heads and head size are the same
  everywhere, so the KV cache is uniform;
- a head-wise sigmoid gate on the attention output (`g_proj`, packed with q/k/v, tandem.layers.attention);
- q/k norms per head, and every norm a (1 + weight) RMSNorm in float32 (transformers' Step3p7RMSNorm);
- rope theta and partial rotary factor per layer type: only the first head_dim * partial_rotary_factor dimensions
  of each head turn (tandem.layers.rotary);
- dense layers (`mlp`) and MoE layers (routed experts at `moe`, tandem.models.step3p5_moe, plus the shared expert
  `share_expert`), chosen per layer (`mlp_layer_types`, legacy `moe_layers_enum`);
- clamped SwiGLU: the routed experts by `swiglu_limits`, the dense MLP and the shared expert by
  `swiglu_limits_shared` (transformers applies the shared limits to dense layers too).
The checkpoint also carries the MTP layers after the last layer (model.layers.{num_hidden_layers + i}); they are the
MTP draft's, and the target does not read them (`skips_layers_after_last` in the registry).

Tensor parallel (`group`): query heads (and their gate rows), KV heads, MLP units and each expert's units are split
across ranks, the embedding and LM head by the vocab-parallel rule; a tp that does not divide one of them is
refused naming the field.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.layers.attention import Attention
from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.kv_cache import PagedKVCache
from tandem.layers.mlp import GatedMLP
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.stack import Backbone, CausalLM
from tandem.models.step3p5_config import Step3p5Config
from tandem.models.step3p5_moe import Step3p5Experts
from tandem.parallel.group import SINGLE_PROCESS, ParallelGroup
from tandem.parallel.layers import ParallelLMHead, VocabParallelEmbedding
from tandem.weights.loader import PACKED_PARTS, NameMap

# q/k/v and the gate pack into one projection; gate/up pack per MLP and, stacked, per MoE layer
# (`moe.gate_proj.weight` -> the experts' `moe.gate_up_proj`).
CHECKPOINT_NAMES = NameMap(packed=PACKED_PARTS | {"g_proj": ("qkv_proj", "g")})


class Step3p5DecoderLayer(nn.Module):
    """The pre-norm layer of tandem.models.stack.DecoderLayer under the checkpoint's names, whose MLP is either the
    dense `mlp` or the routed experts `moe` plus the shared expert `share_expert`:

        hidden = hidden + self_attn(input_layernorm(hidden))
        hidden = hidden + mlp(normed)  or  hidden + moe(normed) + share_expert(normed),
        with normed = post_attention_layernorm(hidden)
    """

    def __init__(self, config: Step3p5Config, layer_index: int, rotary: RotaryEmbedding, group: ParallelGroup) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        sliding = config.sliding_layers[layer_index]
        num_heads = config.layer_heads[layer_index]
        group.split(num_heads, "num_sliding_attention_heads" if sliding else "num_attention_heads")
        self.input_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.self_attn = Attention(
            layer_index=layer_index,
            input_size=hidden,
            output_size=hidden,
            num_heads=num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            rotary=rotary,
            qkv_bias=False,
            o_bias=False,
            qk_norm_eps=eps,
            qk_norm_unit_offset=True,
            scaling=config.query_pre_attn_scalar**-0.5,
            sliding_window=config.sliding_window if sliding else None,
            group=group,
            output_gate=True,
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        shared_limit = config.swiglu_limits_shared[layer_index]
        self.mlp: GatedMLP | None = None
        self.moe: Step3p5Experts | None = None
        self.share_expert: GatedMLP | None = None
        if config.moe_layers[layer_index]:
            moe = config.moe
            group.split(moe.shared_intermediate_size, "share_expert_dim")
            self.moe = Step3p5Experts(moe, config.swiglu_limits[layer_index], group)
            self.share_expert = GatedMLP(hidden, moe.shared_intermediate_size, group=group, limit=shared_limit)
        else:
            self.mlp = GatedMLP(hidden, config.intermediate_size, group=group, limit=shared_limit)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden] residual stream entering the layer
        metadata: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:  # -> [num_tokens, hidden] residual stream leaving the layer
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), metadata, cache)
        normed = self.post_attention_layernorm(hidden)
        if self.moe is not None and self.share_expert is not None:
            return hidden + (self.moe(normed) + self.share_expert(normed))
        assert self.mlp is not None
        return hidden + self.mlp(normed)


class Step3p5Backbone(Backbone):
    def __init__(self, config: Step3p5Config, group: ParallelGroup) -> None:
        super().__init__()
        full, sliding = config.ropes
        self.full_rotary = RotaryEmbedding(full.rotary_dim, full.rope)
        self.sliding_rotary = RotaryEmbedding(sliding.rotary_dim, sliding.rope)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        self.layers = nn.ModuleList(
            Step3p5DecoderLayer(config, index, self.sliding_rotary if is_sliding else self.full_rotary, group)
            for index, is_sliding in enumerate(config.sliding_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)


class Step3p5ForCausalLM(CausalLM[Step3p5Config]):
    def __init__(self, config: Step3p5Config, group: ParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__(
            config, group, Step3p5Backbone(config, group), ParallelLMHead(config.vocab_size, config.hidden_size, group)
        )

"""Step-3.5's mixture of experts: routed experts stored stacked per layer, chosen by a sigmoid router with a bias,
plus one always-on shared expert (which lives beside it in the layer, `share_expert`).

The router for one token (transformers' Step3p7TopKRouter). Its logits are computed in float32, as the authors'
serving code does (`need_fp32_gate`); transformers computes them in the weight dtype, which is the same at float32
and differs in bfloat16:
1. scores = sigmoid(gate logits), one per routed expert, in float32;
2. choice = scores + router_bias: the bias only decides which experts run, never how much they weigh;
3. the num_experts_per_tok experts with the best choice values are chosen (plain top-k, no groups);
4. their weights are their plain scores divided by the sum of those scores.
The chosen experts' outputs, weighted, are summed in the model dtype and the sum is multiplied by
moe_router_scaling_factor. Example with 4 experts, 2 per token, scores [.9 .8 .1 .2] and bias [0 -.5 0 .3]: choice
[.9 .3 .1 .5] chooses experts 0 and 3, weighted .9 / 1.1 and .2 / 1.1, though expert 1 scored second best.

Each expert is a clamped SwiGLU (tandem.layers.mlp.gated_product, the layer's `swiglu_limits` entry). Checkpoint
names (hub layout, also what transformers' save_pretrained writes): `moe.gate.weight` [experts, hidden],
`moe.router_bias` [experts], `moe.gate_proj.weight` / `moe.up_proj.weight` [experts, moe_intermediate, hidden]
(packed into one stacked projection, tandem.layers.linear.PackedLinear with `experts`), `moe.down_proj.weight`
[experts, hidden, moe_intermediate].

Tensor parallel: every rank routes all tokens (the router is replicated) and computes its slice of every chosen
expert's intermediate units; the down projections' partial sums meet in one all-reduce of the routed output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.linear import PackedLinear
from tandem.layers.mlp import gated_product
from tandem.models.step3p5_config import Step3p5MoEConfig
from tandem.parallel.group import SINGLE_PROCESS, ParallelGroup, all_reduce
from tandem.parallel.layers import ShardSpec


class StackedDownProjections(nn.Module):
    """The experts' down projections as one parameter [experts, hidden, intermediate / tp]: row parallel per expert,
    each rank holding its columns of every expert."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, group: ParallelGroup) -> None:
        super().__init__()
        self.local_intermediate_size = group.split(intermediate_size, "moe_intermediate_size")
        self.group = group
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.local_intermediate_size))

    def shard_spec(self, parameter_name: str, part: str | None) -> ShardSpec:
        experts, hidden, local = self.weight.shape
        start = self.group.rank * local
        return ShardSpec((experts, hidden, local * self.group.world_size), dim=2, start=start, size=local)


class Step3p5Experts(nn.Module):
    """The checkpoint's `moe.` module: the router (`gate`, `router_bias`) and the stacked routed experts."""

    router_bias: torch.Tensor  # a buffer, loaded from the checkpoint; kept in float32 (registry float32_buffers)

    def __init__(self, config: Step3p5MoEConfig, limit: float | None, group: ParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__()
        group.split(config.expert_intermediate_size, "moe_intermediate_size")  # refuses naming the config field
        self.config = config
        self.limit = limit
        self.group = group
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # replicated on every rank
        self.register_buffer("router_bias", torch.zeros(config.num_experts))
        units = config.expert_intermediate_size
        self.gate_up_proj = PackedLinear(
            config.hidden_size, {"gate": units, "up": units}, bias=False, group=group, experts=config.num_experts
        )
        self.down_proj = StackedDownProjections(config.num_experts, config.hidden_size, units, group)

    def route(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # -> experts, weights: [num_tokens, experts_per_token] each
        scores = F.linear(hidden.float(), self.gate.weight.float()).sigmoid()  # [num_tokens, num_experts]
        choice = scores + self.router_bias.float()
        experts = choice.topk(self.config.experts_per_token, dim=-1).indices
        weights = scores.gather(1, experts)
        return experts, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> [num_tokens, hidden]
        experts, weights = self.route(hidden)
        routed = torch.zeros_like(hidden)
        # Each chosen expert runs once over the tokens that chose it; (token, slot) locate its weight.
        for expert in experts.unique().tolist():
            tokens, slots = (experts == expert).nonzero(as_tuple=True)
            chosen = hidden[tokens]  # [tokens of this expert, hidden]
            gate = F.linear(chosen, self.gate_up_proj.expert_rows("gate", expert))
            up = F.linear(chosen, self.gate_up_proj.expert_rows("up", expert))
            output = F.linear(gated_product(F.silu(gate), up, self.limit), self.down_proj.weight[expert])
            routed.index_add_(0, tokens, (output * weights[tokens, slots, None]).to(hidden.dtype))
        return all_reduce(routed, self.group) * self.config.routed_scaling_factor

"""DeepSeek-V3 mixture of experts: routed experts chosen by a grouped top-k router, plus always-on shared experts.

The router (DeepSeek-V3's "noaux_tc", sigmoid scoring) for one token:
1. scores = sigmoid(gate logits), one per routed expert, in float32;
2. choice = scores + e_score_correction_bias: the bias balances the load and steers only which experts are
   chosen, never how much their outputs weigh;
3. the experts are split into n_group consecutive groups; a group is ranked by the sum of its two best choice
   values, and only the topk_group best groups stay eligible;
4. the num_experts_per_tok eligible experts with the best choice values are chosen;
5. their weights are their plain scores, divided by the sum of those scores (norm_topk_prob), times
   routed_scaling_factor.
Example with 8 experts in 2 groups, topk_group 1, 2 experts per token: choice values
[.9 .1 .2 .3 | .6 .5 .7 .1] give group sums .9 + .3 = 1.2 and .7 + .6 = 1.3, so only experts 4..7 are eligible
and experts 6 and 4 are chosen, although expert 0 has the best single value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.mlp import GatedMLP
from tandem.parallel.group import SINGLE_PROCESS, ParallelGroup, all_reduce


@dataclass(frozen=True)
class MoEConfig:
    hidden_size: int
    expert_intermediate_size: int  # moe_intermediate_size: one routed expert's, and one shared expert's share
    num_experts: int  # n_routed_experts
    num_shared_experts: int  # n_shared_experts: fused into one MLP num_shared_experts times as wide
    experts_per_token: int  # num_experts_per_tok
    num_groups: int  # n_group
    groups_per_token: int  # topk_group
    routed_scaling_factor: float
    normalize_weights: bool  # norm_topk_prob


@dataclass(frozen=True)
class Routing:
    experts: torch.Tensor  # [num_tokens, experts_per_token] routed expert ids, in no particular order
    weights: torch.Tensor  # [num_tokens, experts_per_token] float32 weight of each chosen expert


class GroupedTopKRouter(nn.Module):
    """The checkpoint's `mlp.gate`: weight [num_experts, hidden] and e_score_correction_bias [num_experts]."""

    e_score_correction_bias: torch.Tensor  # a buffer, loaded from the checkpoint

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))

    def forward(self, hidden: torch.Tensor) -> Routing:  # hidden: [num_tokens, hidden]
        config = self.config
        num_tokens = hidden.shape[0]
        scores = F.linear(hidden.float(), self.weight.float()).sigmoid()  # [num_tokens, num_experts]
        choice = scores + self.e_score_correction_bias.float()
        grouped = choice.view(num_tokens, config.num_groups, -1)  # [num_tokens, groups, experts per group]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [num_tokens, groups]
        best_groups = group_scores.topk(config.groups_per_token, dim=-1).indices
        eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        eligible_choice = grouped.masked_fill(~eligible[:, :, None], float("-inf")).view(num_tokens, -1)
        experts = eligible_choice.topk(config.experts_per_token, dim=-1).indices
        weights = scores.gather(1, experts)
        if config.normalize_weights:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(experts=experts, weights=weights * config.routed_scaling_factor)


class MixtureOfExperts(nn.Module):
    """Module names are the checkpoint's: mlp.gate, mlp.experts.{e}.{gate,up,down}_proj, mlp.shared_experts.*.

    Tensor parallel: the router is replicated, so every rank chooses the same experts; each expert's and the shared
    experts' units are split across ranks like a GatedMLP's, and the ranks' partial sums of the whole layer meet in
    one all-reduce."""

    def __init__(self, config: MoEConfig, group: ParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__()
        self.group = group
        self.gate = GroupedTopKRouter(config)

        def expert(units: int) -> GatedMLP:
            return GatedMLP(config.hidden_size, units, group=group, reduce=False, what="moe_intermediate_size")

        self.experts = nn.ModuleList(expert(config.expert_intermediate_size) for _ in range(config.num_experts))
        self.shared_experts = expert(config.expert_intermediate_size * config.num_shared_experts)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> [num_tokens, hidden]
        routing = self.gate(hidden)
        routed = torch.zeros_like(hidden)
        # Each chosen expert runs once over the tokens that chose it; (token, slot) locate its weight.
        for expert in routing.experts.unique().tolist():
            tokens, slots = (routing.experts == expert).nonzero(as_tuple=True)
            expert_output = self.experts[expert](hidden[tokens]) * routing.weights[tokens, slots, None]
            routed.index_add_(0, tokens, expert_output.to(hidden.dtype))
        return all_reduce(routed + self.shared_experts(hidden), self.group)

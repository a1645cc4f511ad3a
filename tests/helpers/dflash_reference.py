"""A plain-torch reference of DFlash and DSpark drafting and of their decoding loop, written from the papers (DFlash:
arXiv 2602.06036; DSpark: DeepSpec's) and the behaviour of their public code (z-lab's `dflash_generate`, DeepSpec's
`build_dspark_proposal`), independent of Tandem's model code: no KV cache, every round recomputes the draft over the
whole context, and the target is transformers' own model.

    features   = concat of transformers' hidden_states[id + 1] over target_layer_ids (the outputs of those layers)
    context    = hidden_norm(fc(features of positions 0 .. start - 1))
    block      = target embedding of [anchor, MASK x (B - 1)] at positions start .. start + B - 1
    per layer: h = input_layernorm(block); q from h; k, v from [context ; h]; q/k norms, rotary at the positions;
               attention of the block over everything, non-causal (a sliding layer: keys > position - window);
               block += o_proj(attention); block += mlp(post_attention_layernorm(block))
    drafts     = argmax target lm_head(norm(block))[1:]
The block's embedding is the target's table as stored times the config's `input_embedding_scale` (1 when absent; a
Gemma target's drafter names sqrt(hidden)), and the logits are multiplied by `output_multiplier` and softcapped by
`final_logit_softcapping` where set, as z-lab's newer code does.
DSpark (a DFlash backbone; its fields at the top level of its config, its own copy of the target's embedding and LM
head where it ships them) drafts from every row: row j's logits are lm_head(h_j) + W2 W1[prev_j] (the gated head:
W2 (sigmoid(gate_proj([h_j ; W1[prev_j]])) * W1[prev_j])), prev_0 the anchor and prev_j the draft of row j - 1, left
to right; its confidence in row j is sigmoid(proj([h_j ; W1[prev_j]])) (or of h_j alone).
DFlash2 (z-lab's DFlash2DraftModel; its paper and vLLM's qwen3_dflash2.py) wraps each sublayer of each layer in a
dynamic convolution over the block's rows: from the sublayer's normed input x, d = kernel_projection(x) gives each
row a pre and a post coefficient per tap and channel group; conv(y, side)[i] = sum over taps t <= i of
(base_kernel[side][t] + d[i][side][t]) * y[i - t]; the sublayer's output is conv(sublayer(conv(x, pre)), post). Its
drafts are chosen left to right among the selector_top_k largest logits (u) of each row: the candidate c maximising
u[c] + sum_r predecessor_codebook[prev][r] * hidden_projection(h_j)[r] * successor_codebook[c][r], prev the anchor
for row 1, then the draft before.
A round verifies the drafts with the target (greedy), accepts the matching prefix, appends the target's token, and
adds the features of the anchor and the accepted drafts to the context.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:  # [n, heads, dim], rotate-half
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    rotated_half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], dim=-1)
    return x * cos + rotated_half * sin


class ReferenceDFlash:
    def __init__(self, draft_dir: Path, target: PreTrainedModel) -> None:
        self.config = json.loads((draft_dir / "config.json").read_text())
        self.weights = load_file(str(draft_dir / "model.safetensors"))
        self.target = target
        self.dspark = self.config["architectures"] == ["Qwen3DSparkModel"]
        self.dflash2 = self.config["architectures"] == ["DFlash2DraftModel"]
        dflash = self.config if self.dspark else self.config["dflash_config"]
        self.block_size = int(dflash.get("block_size", self.config.get("block_size")))
        self.mask_token_id = int(dflash["mask_token_id"])
        self.layer_ids = list(dflash["target_layer_ids"])
        self.eps = float(self.config["rms_norm_eps"])
        self.theta = float(self.config.get("rope_parameters", {}).get("rope_theta", self.config.get("rope_theta")))
        window = self.config["sliding_window"] if self.config.get("use_sliding_window") else None
        types = self.config.get("layer_types") or ["full_attention"] * self.config["num_hidden_layers"]
        self.windows = [window if kind == "sliding_attention" else None for kind in types]
        # z-lab's newer fields, read from dflash_config first, then the top level (DSpark: the top level).
        self.embedding_scale = float(dflash.get("input_embedding_scale", self.config.get("input_embedding_scale", 1)))
        self.output_multiplier = float(dflash.get("output_multiplier", self.config.get("output_multiplier", 1)))
        self.softcap = dflash.get("final_logit_softcapping", self.config.get("final_logit_softcapping"))

    def features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:  # -> [positions, n * hidden]
        return torch.cat([hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)  # id -1: the embedding

    def w(self, name: str) -> torch.Tensor:
        return self.weights[name]

    def block_hidden(self, features: torch.Tensor, anchor: int) -> torch.Tensor:  # -> [B, hidden]
        """The draft's final-norm outputs for the block after the context `features` (positions 0 .. start - 1)."""
        start, size = features.shape[0], self.block_size
        context = rms_norm(features @ self.w("fc.weight").T, self.w("hidden_norm.weight"), self.eps)
        ids = torch.tensor([anchor] + [self.mask_token_id] * (size - 1))
        block = self.embedding(ids)
        positions = torch.arange(start + size)
        for index, window in enumerate(self.windows):
            block = self.layer(index, block, context, positions, window)
        return rms_norm(block, self.w("norm.weight"), self.eps)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The table's rows as stored (not through a Gemma target's scaling module) times input_embedding_scale."""
        table = self.weights.get("embed_tokens.weight", self.target.get_input_embeddings().weight)
        assert isinstance(table, torch.Tensor)
        return F.embedding(ids, table) * self.embedding_scale

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        if "lm_head.weight" in self.weights:
            logits = hidden @ self.weights["lm_head.weight"].T
        else:
            logits = self.target.get_output_embeddings()(hidden)
        logits = logits * self.output_multiplier
        return logits if not self.softcap else torch.tanh(logits / self.softcap) * self.softcap

    def block_logits(self, features: torch.Tensor, anchor: int) -> torch.Tensor:  # -> [B - 1, vocab]
        """DFlash's draft logits: the LM head over block rows 1 .. B - 1."""
        return self.head(self.block_hidden(features, anchor))[1:]

    def drafts(self, features: torch.Tensor, anchor: int, k: int) -> tuple[list[int], list[float]]:
        """The first k drafts of the block, and (DSpark with a confidence head) each one's confidence."""
        hidden = self.block_hidden(features, anchor)
        if self.dflash2:
            return self.selected(hidden, anchor, k), []
        if not self.dspark:
            return self.head(hidden)[1:].argmax(-1)[:k].tolist(), []
        drafts: list[int] = []
        confidences: list[float] = []
        previous = anchor
        for j in range(k):
            logits = self.head(hidden[j])
            embedded = self.weights["markov_head.markov_w1.weight"][previous] if self.markov else None
            if embedded is not None:
                if "markov_head.gate_proj.weight" in self.weights:
                    gate = torch.cat([hidden[j], embedded]) @ self.w("markov_head.gate_proj.weight").T
                    embedded = (gate + self.w("markov_head.gate_proj.bias")).sigmoid() * embedded
                logits = logits + embedded @ self.w("markov_head.markov_w2.weight").T
            if "confidence_head.proj.weight" in self.weights:
                own = (
                    self.weights["markov_head.markov_w1.weight"][previous]
                    if self.config.get("confidence_head_with_markov")
                    else None
                )
                row = hidden[j] if own is None else torch.cat([hidden[j], own])
                score = row @ self.w("confidence_head.proj.weight")[0] + self.w("confidence_head.proj.bias")[0]
                confidences.append(float(score.sigmoid()))
            previous = int(logits.argmax())
            drafts.append(previous)
        return drafts, confidences

    def selected(self, hidden: torch.Tensor, anchor: int, k: int) -> list[int]:
        """DFlash2's drafts of block rows 1 .. k: the selector's greedy walk over each row's top candidates."""
        top_k = int(self.config["dflash_config"]["selector_top_k"])
        predecessor = self.w("candidate_selector.predecessor_codebook")
        successor = self.w("candidate_selector.successor_codebook")
        drafts, previous = [], anchor
        for row in range(1, k + 1):
            values, candidates = self.head(hidden[row]).topk(top_k)
            projected = self.w("candidate_selector.hidden_projection.weight") @ hidden[row]
            scores = [
                float(values[i]) + float((predecessor[previous] * projected * successor[c]).sum())
                for i, c in enumerate(candidates.tolist())
            ]
            previous = candidates.tolist()[max(range(top_k), key=lambda i: (scores[i], -i))]
            drafts.append(previous)
        return drafts

    def around(self, prefix: str, x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The sublayer of input x; for DFlash2, inside its dynamic convolution (weights under `prefix`)."""
        if not self.dflash2:
            return sublayer(x)
        base = self.w(prefix + "base_kernel")  # [2, taps, hidden]
        taps, group = base.shape[1], int(self.config["dflash_config"]["conv_group_size"])
        dynamic = (x @ self.w(prefix + "kernel_projection.weight").T).view(len(x), 2, taps, -1)

        def convolve(y: torch.Tensor, side: int) -> torch.Tensor:
            out = torch.zeros_like(y)
            for i in range(len(y)):
                for t in range(min(taps, i + 1)):
                    coefficient = base[side, t] + dynamic[i, side, t].repeat_interleave(group)
                    out[i] += coefficient * y[i - t]
            return out

        return convolve(sublayer(convolve(x, 0)), 1)

    @property
    def markov(self) -> bool:
        return "markov_head.markov_w1.weight" in self.weights

    def layer(
        self, index: int, block: torch.Tensor, context: torch.Tensor, positions: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        p = f"layers.{index}."
        h = rms_norm(block, self.w(p + "input_layernorm.weight"), self.eps)
        block = block + self.around(
            p + "attention_conv.", h, lambda x: self.attention(p, x, context, positions, window)
        )
        x = rms_norm(block, self.w(p + "post_attention_layernorm.weight"), self.eps)
        return block + self.around(p + "mlp_conv.", x, lambda x: self.mlp(p, x))

    def attention(
        self, p: str, h: torch.Tensor, context: torch.Tensor, positions: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        heads, kv_heads = self.config["num_attention_heads"], self.config["num_key_value_heads"]
        dim = self.config["head_dim"]
        both = torch.cat([context, h])
        q = (h @ self.w(p + "self_attn.q_proj.weight").T).view(len(h), heads, dim)
        k = (both @ self.w(p + "self_attn.k_proj.weight").T).view(len(both), kv_heads, dim)
        v = (both @ self.w(p + "self_attn.v_proj.weight").T).view(len(both), kv_heads, dim)
        q = rotate(rms_norm(q, self.w(p + "self_attn.q_norm.weight"), self.eps), positions[-len(h) :], self.theta)
        k = rotate(rms_norm(k, self.w(p + "self_attn.k_norm.weight"), self.eps), positions, self.theta)
        visible = torch.ones(len(h), len(both), dtype=torch.bool)
        if window is not None:
            visible = positions[None, :] > positions[-len(h) :, None] - window
        groups = heads // kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * dim**-0.5
        attention = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
        return attention.reshape(len(h), heads * dim) @ self.w(p + "self_attn.o_proj.weight").T

    def mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        gate, up = x @ self.w(p + "mlp.gate_proj.weight").T, x @ self.w(p + "mlp.up_proj.weight").T
        return (F.silu(gate) * up) @ self.w(p + "mlp.down_proj.weight").T


@dataclass
class ReferenceRun:
    tokens: list[int]  # the new tokens
    drafts: list[list[int]] = field(default_factory=list)  # per round
    accepted: list[int] = field(default_factory=list)  # per round: drafts accepted


@torch.no_grad()
def reference_generate(target_dir: Path, draft_dir: Path, prompt: list[int], max_new_tokens: int) -> ReferenceRun:
    """Greedy block-draft decoding of `prompt`; a round drafts min(a block's drafts, tokens left - 1), as Tandem's
    rounds do."""
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    draft = ReferenceDFlash(draft_dir, target)
    output = target(torch.tensor([prompt]), output_hidden_states=True)
    features = draft.features(output.hidden_states)
    tokens = [*prompt, int(output.logits[0, -1].argmax())]
    run = ReferenceRun(tokens=[])
    while len(tokens) - len(prompt) < max_new_tokens:
        per_block = draft.block_size - (0 if draft.dspark else 1)
        k = min(per_block, max_new_tokens - (len(tokens) - len(prompt)) - 1)
        drafts, _ = draft.drafts(features, tokens[-1], k)
        start = len(tokens) - 1  # the anchor's position
        output = target(torch.tensor([tokens + drafts]), output_hidden_states=True)
        choices = output.logits[0, start:].argmax(-1).tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == choices[accepted]:
            accepted += 1
        tokens += [*drafts[:accepted], choices[accepted]]
        features = torch.cat([features, draft.features(output.hidden_states)[start : start + accepted + 1]])
        run.drafts.append(drafts)
        run.accepted.append(accepted)
    run.tokens = tokens[len(prompt) : len(prompt) + max_new_tokens]
    return run

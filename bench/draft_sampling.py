"""How a block drafter should propose at temperature > 0: greedily (its argmax, a one-hot q, what the replicas do),
or sampled from its own distribution q with q shipped to the verifier (z-lab's reference loop). Both are exact; what
differs is how many drafts the target accepts.

    python -m bench.draft_sampling [--draft tandem/demo/dflash] [--prompts 16] [--temperatures 0.7 1.0]

The demo target (transformers' Llama on the shipped weights) decodes the held-out prompts by speculative sampling,
round by round, with the block drafter's rows from the serving runner (draft_server.block_runner) and its logits
(DFlashDraft.logits), verified by the target's own rule (tandem.sampling.verify.verify_sampled: draft d_j accepted
with probability min(1, p_j(d_j) / q_j(d_j)), a rejection sampling the residual). Each rule runs every prompt with
the same seeds; the report is the mean acceptance length (accepted drafts + 1 per round) and the acceptance by
position, per rule and temperature.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from bench.prompts import held_out_prompts
from draft_server.block_runner import BlockRunner
from draft_server.runner import ProposeInput, TargetRows
from tandem.models.dflash import load_dflash
from tandem.sampling.params import SamplingParams
from tandem.sampling.verify import target_probs, verify_sampled
from tandem.settings import DEMO_DRAFTS, DEMO_TARGET, KVCacheSettings

RULES = ("greedy", "sampled")


@dataclass
class Tally:
    rounds: int = 0
    accepted: int = 0
    by_position: list[int] = field(default_factory=list)  # rounds whose draft j was accepted (and every earlier one)
    drafted: list[int] = field(default_factory=list)  # rounds that drafted position j

    def add(self, depth: int, accepted: int) -> None:
        self._grow(depth)
        for j in range(depth):
            self.drafted[j] += 1
            self.by_position[j] += j < accepted
        self.rounds += 1
        self.accepted += accepted

    def merge(self, other: Tally) -> None:
        self._grow(len(other.drafted))
        for j, (accepted, drafted) in enumerate(zip(other.by_position, other.drafted, strict=True)):
            self.by_position[j] += accepted
            self.drafted[j] += drafted
        self.rounds += other.rounds
        self.accepted += other.accepted

    def _grow(self, depth: int) -> None:
        while len(self.drafted) < depth:
            self.drafted.append(0)
            self.by_position.append(0)

    def summary(self) -> dict[str, object]:
        rates = [a / d for a, d in zip(self.by_position, self.drafted, strict=True)]
        return {
            "rounds": self.rounds,
            "acceptance_length": round(1 + self.accepted / max(1, self.rounds), 3),
            "by_position": [round(rate, 3) for rate in rates],
        }


class Drafter:
    """The serving runner of a block drafter, with each round's draft distributions q (at a temperature)."""

    def __init__(self, draft_dir: Path, target: PreTrainedModel) -> None:
        model, missing = load_dflash(draft_dir)
        tables = {"embed_tokens": target.get_input_embeddings(), "lm_head": target.get_output_embeddings()}
        for name in missing:
            model.fill_table(name, tables[name].weight.detach())
        if model.markov_head is not None:
            raise ValueError(f"{draft_dir}: a Markov head's q depends on the sampled drafts; DFlash drafters only")
        self.runner = BlockRunner(model, KVCacheSettings(block_size=16, num_blocks=256))
        self.layer_ids = model.config.target_layer_ids
        self.rows: list[torch.Tensor] = []
        model.register_forward_hook(lambda module, args, hidden: self.rows.append(hidden))

    def features(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """transformers' hidden_states[id + 1] of every feature id (its layers' outputs), concatenated."""
        return torch.cat([hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)

    def distributions(self, request_id: str, rows: TargetRows, params: SamplingParams) -> torch.Tensor:  # [k, vocab]
        self.rows.clear()
        k = self.runner.model.config.drafts_per_block
        self.runner.propose([ProposeInput(request_id, rows, k)])
        return target_probs(self.runner.model.logits(self.rows[0]), params)


@torch.no_grad()
def decode(
    target: PreTrainedModel, drafter: Drafter, prompt: list[int], rule: str, temperature: float, seed: int, tokens: int
) -> Tally:
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=temperature)
    tally, request_id = Tally(), f"{rule}-{seed}"
    output = target(torch.tensor([prompt]), output_hidden_states=True)
    first = target_probs(output.logits[0, -1:], params)[0]
    sequence = [*prompt, int(torch.multinomial(first, 1, generator=generator))]
    rows = TargetRows(0, sequence[1:], drafter.features(output.hidden_states))
    while len(sequence) - len(prompt) < tokens:
        q = drafter.distributions(request_id, rows, params)
        if rule == "greedy":
            drafts, proposal = q.argmax(-1).tolist(), None  # one-hot q
        else:
            drafts, proposal = torch.multinomial(q, 1, generator=generator).squeeze(-1).tolist(), q
        anchor = len(sequence) - 1
        output = target(torch.tensor([sequence + drafts]), output_hidden_states=True)
        outcome = verify_sampled(output.logits[0, anchor:], drafts, params, generator, proposal)
        tally.add(len(drafts), outcome.accepted)
        sequence += outcome.tokens
        features = drafter.features(output.hidden_states)[anchor : anchor + outcome.accepted + 1]
        rows = TargetRows(anchor, sequence[anchor + 1 :], features)
    drafter.runner.release([request_id])
    return tally


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", type=Path, default=DEMO_DRAFTS["dflash"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    target = AutoModelForCausalLM.from_pretrained(str(DEMO_TARGET), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    drafter = Drafter(args.draft, target)
    prompts = [tokenizer(text).input_ids for text in held_out_prompts(args.prompts)]
    report: dict[str, dict[str, object]] = {}
    for temperature in args.temperatures:
        for rule in RULES:
            total, lengths = Tally(), []
            for seed, prompt in enumerate(prompts):
                tally = decode(target, drafter, prompt, rule, temperature, seed, args.max_new_tokens)
                lengths.append(1 + tally.accepted / tally.rounds)
                total.merge(tally)
            summary = total.summary() | {"per_prompt_median": round(statistics.median(lengths), 3)}
            report[f"T={temperature} {rule}"] = summary
            print(f"T={temperature} {rule:8} {json.dumps(summary)}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark results: a summary JSON of a few KB, a Markdown table, a PNG of acceptance per draft position (with the
`bench` extra; without it the table says so), and on request every request's record in a separate JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.cpu import OWN_PROCESS, SPLIT_ROLES
from bench.harness import RunResult, outside_compute
from bench.huggingface import Method
from bench.machine import machine, runtime
from bench.plot import Series, save_acceptance_plot
from tandem.extras import BENCH

TANDEM_SETUPS = ("split", "colocated")
PLOT_NAME = "acceptance_per_position.png"


def runs_of(
    runs: Sequence[RunResult], label: str, speculative: bool, concurrency: int, kind: str = "", constraint: str = ""
) -> list[RunResult]:
    """Every run of one configuration, in the order they ran (`kind`: a speculative run's draft kind; `constraint`:
    what constrained its requests, bench.structured)."""
    key = (label, speculative, concurrency, kind, constraint)
    return [run for run in runs if (run.label, run.speculative, run.concurrency, run.kind, run.constraint) == key]


def find(
    runs: Sequence[RunResult], label: str, speculative: bool, concurrency: int, kind: str = "", constraint: str = ""
) -> RunResult | None:
    """The median run of a configuration by tokens/s (the lower median of an even count: always a real run)."""
    matching = runs_of(runs, label, speculative, concurrency, kind, constraint)
    matching.sort(key=lambda run: run.tokens_per_second)
    return matching[(len(matching) - 1) // 2] if matching else None


def rates(
    runs: Sequence[RunResult], label: str, speculative: bool, concurrency: int, kind: str = "", constraint: str = ""
) -> list[float]:
    """Tokens/s of every run of a configuration, in the order they ran."""
    return [round(run.tokens_per_second, 2) for run in runs_of(runs, label, speculative, concurrency, kind, constraint)]


def setup_name(label: str, kind: str, constraint: str = "") -> str:
    """A row's setup as the table and the plot name it: "split", "split tree" beside other draft kinds, "split
    json schema" for constrained requests."""
    return " ".join(part for part in (label, kind, constraint) if part)


def _ratio(mine: RunResult | None, theirs: RunResult | None) -> float | None:
    if mine is None or theirs is None:
        return None
    return round(mine.tokens_per_second / theirs.tokens_per_second, 3)


def _transformers(runs: Sequence[RunResult], method: Method) -> RunResult | None:
    return find(runs, method.label, method.speculative, 1)


def _tandem_target_only(runs: Sequence[RunResult]) -> RunResult | None:
    """The reference outputs: the split stack's target-only run at its lowest concurrency (the median one)."""
    concurrencies = sorted({run.concurrency for run in runs if run.label == "split"})
    return find(runs, "split", False, concurrencies[0]) if concurrencies else None


def summary(runs: Sequence[RunResult]) -> list[dict[str, Any]]:
    """One row per (Tandem setup, draft kind, concurrency): speculative vs target-only on the same servers (for every
    kind, the setup's one target-only run), split vs colocated, and both against transformers (batch 1: the ratios
    at a higher concurrency compare batched with sequential)."""
    greedy = _transformers(runs, Method.GREEDY)
    prompt_lookup = _transformers(runs, Method.PROMPT_LOOKUP)
    speculative_runs = [run for run in runs if run.speculative and run.label in TANDEM_SETUPS]
    variants = list(dict.fromkeys((run.kind, run.constraint) for run in speculative_runs))
    rows = []
    for label in TANDEM_SETUPS:
        for (kind, constraint), concurrency in [
            (variant, concurrency)
            for variant in variants
            for concurrency in sorted({run.concurrency for run in runs if run.label == label})
        ]:
            speculative = find(runs, label, True, concurrency, kind, constraint)
            target_only = find(runs, label, False, concurrency, "", constraint)
            if speculative is None:
                continue
            per_round = {k: round(v, 3) for k, v in speculative.per_round_milliseconds().items()}
            rows.append(
                {
                    "setup": label,
                    "draft": kind,
                    "constraint": constraint,
                    "concurrency": concurrency,
                    "tokens_per_second": round(speculative.tokens_per_second, 2),
                    "tokens_per_second_runs": rates(runs, label, True, concurrency, kind, constraint),
                    "target_only_tokens_per_second_runs": rates(runs, label, False, concurrency, "", constraint),
                    "target_only_tokens_per_second": round(target_only.tokens_per_second, 2) if target_only else None,
                    "speedup": _ratio(speculative, target_only),
                    "split_over_colocated": _ratio(
                        speculative, find(runs, "colocated", True, concurrency, kind, constraint)
                    )
                    if label == "split"
                    else None,
                    "vs_transformers_greedy": _ratio(speculative, greedy),
                    "vs_transformers_prompt_lookup": _ratio(speculative, prompt_lookup),
                    "target_only_vs_transformers_greedy": _ratio(target_only, greedy),
                    # Greedy speculative output must be the target's own: prompts whose completions are identical.
                    "identical_outputs": _identical(speculative, target_only) if target_only else None,
                    "mean_acceptance_length": round(speculative.mean_acceptance_length, 3),
                    "acceptance_per_position": [round(a, 3) for a in speculative.acceptance_per_position()],
                    "per_round_ms": per_round,
                    "outside_compute_ms_per_round": _rounded(outside_compute(per_round)),
                    # The same per decoded token, of both runs: the engine's cost that a GPU would not shrink.
                    "outside_compute_ms_per_token": {
                        mode: _rounded(run.outside_compute_ms_per_token())
                        for mode, run in (("speculative", speculative), ("target_only", target_only))
                        if run is not None
                    },
                    "cpu": _cpu(speculative, target_only),
                }
            )
    return rows


def _cpu(speculative: RunResult, target_only: RunResult | None) -> dict[str, Any] | None:
    """CPU milliseconds per token by process role and the cores kept busy, of the row's two runs (None: not
    measured, as for a stack the benchmark did not start)."""
    measured = [(mode, run) for mode, run in (("speculative", speculative), ("target_only", target_only)) if run]
    if not all(run.cpu_seconds for _, run in measured):
        return None
    return {
        mode: {
            "ms_per_token": {role: round(ms, 3) for role, ms in run.cpu_milliseconds_per_token().items()},
            "cores_busy": round(run.cores_busy, 2),
        }
        for mode, run in measured
    }


def transformers_summary(runs: Sequence[RunResult]) -> list[dict[str, Any]]:
    """One row per transformers method measured (batch 1, one prompt after another)."""
    greedy = _transformers(runs, Method.GREEDY)
    prompt_lookup = _transformers(runs, Method.PROMPT_LOOKUP)
    reference = _tandem_target_only(runs)
    rows = []
    for method in Method:
        run = _transformers(runs, method)
        if run is None:
            continue
        rows.append(
            {
                "setup": method.label,
                "concurrency": 1,
                "batch": "1, sequential",
                "tokens_per_second": round(run.tokens_per_second, 2),
                "tokens_per_second_runs": rates(runs, method.label, method.speculative, 1),
                "vs_transformers_greedy": _ratio(run, greedy),
                "vs_transformers_prompt_lookup": _ratio(run, prompt_lookup),
                # Prompts whose completion equals Tandem's target-only completion (split stack), token for token.
                "identical_to_tandem_target_only": _identical(run, reference) if reference else None,
            }
        )
    return rows


def _identical(mine: RunResult, reference: RunResult) -> str:
    ours, theirs = mine.outputs(), reference.outputs()
    same = sum(1 for index, tokens in ours.items() if theirs.get(index) == tokens)
    return f"{same}/{len(ours)}"


TABLE_HEADER = (
    "| setup | concurrency | tok/s | tok/s (target-only) | speedup | vs HF greedy | vs HF prompt-lookup "
    "| target-only vs HF greedy | split / colocated | identical to target-only | mean acceptance length "
    "| acceptance per position | per round ms: draft / verify / wire / scheduling (+ drafted ahead) "
    "| outside compute ms/round (per token: speculative / target-only) "
    "| CPU ms per token by process (cores busy): speculative / target-only |"
)


def _rounded(milliseconds: float | None) -> float | None:
    return None if milliseconds is None else round(milliseconds, 3)


def _per_round(timing: dict[str, float]) -> str:
    """Where a round's time went; draft compute done ahead (off the round's path) follows in brackets."""
    if "verify" not in timing:
        return "not measured"
    phases = " / ".join(f"{timing[phase]:.2f}" for phase in ("draft", "verify", "wire", "scheduling"))
    ahead = timing.get("drafted_ahead", 0.0)
    return f"{phases} (+ {ahead:.2f})" if ahead else phases


def _milliseconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _outside_cell(per_round: float | None, per_token: dict[str, float | None]) -> str:
    """`2.44 (0.60 / 0.35)`: a speculative round's time outside compute, then a token's in each mode."""
    tokens = " / ".join(_milliseconds(per_token.get(mode)) for mode in ("speculative", "target_only"))
    return f"{_milliseconds(per_round)} ({tokens})" if per_token else _milliseconds(per_round)


def _drafts(settings: dict[str, Any]) -> str:
    """Who drafts: the draft kinds measured side by side, n-gram lookup in the orchestrator (`--draft ngram`), or the
    draft model's replicas."""
    kinds = settings.get("draft_kinds")
    if kinds:
        return "draft kinds: " + "; ".join(f"{name}: {what}" for name, what in kinds.items())
    ngram = settings.get("ngram")
    if ngram:
        return f"n-gram drafts (suffixes of {ngram['max_n']} down to {ngram['min_n']} tokens)"
    hybrid = settings.get("hybrid")
    merged = ""
    if hybrid:
        lengths = hybrid["ngram"]
        merged = f" with n-gram drafts merged in (suffixes of {lengths['max_n']} down to {lengths['min_n']} tokens)"
    return f"{settings['draft_replicas']} draft replica(s){merged}"


def _steps(settings: dict[str, Any]) -> str:
    if settings.get("adaptive_k", False):
        return f"k chosen per batch (adaptive, at most {settings['num_steps']})"
    return f"k = {settings['num_steps']} draft steps"


def markdown(rows: Sequence[dict[str, Any]], transformers: Sequence[dict[str, Any]], settings: dict[str, Any]) -> str:
    lines = [
        f"Greedy, {settings['num_prompts']} held-out prompts, {settings['max_new_tokens']} new tokens each, "
        f"{_steps(settings)}, {_drafts(settings)}, "
        f"{settings.get('dtype', 'float32')}, {_repeats(settings.get('repeats', 1))}; {settings['machine']}.",
        "",
        "tok/s: speculative for Tandem rows. HF: Hugging Face transformers `generate` on the same target checkpoint "
        "(AutoModelForCausalLM, SDPA, DynamicCache, same dtype and length), batch 1, one prompt after another; "
        f"prompt-lookup with `prompt_lookup_num_tokens={settings.get('prompt_lookup_num_tokens')}`. Its rows count "
        "the prompts identical to Tandem's split target-only completions. Drafted ahead: draft compute a replica did "
        "as soon as the target's rows arrived, before it was asked, while the target's answer and the next Propose "
        "travelled; the draft column is what the round still waited for. Outside compute: a round's wall time (first "
        "token to last, over the rounds) less its verify, draft and drafted-ahead compute; in brackets the same over "
        "the tokens decoded after the first, of the speculative and the target-only run. CPU ms per token: the "
        "user + system CPU time of each process of the setup during the run over its completion tokens (split: "
        "target, draft, orchestrator; colocated: the benchmark's own process, which also runs the client), with the "
        "cores the run kept busy (all of it over the wall time) in brackets.",
        *_structured_note(settings),
        "",
        TABLE_HEADER,
        "|" + "---|" * (TABLE_HEADER.count("|") - 1),
    ]
    for row in rows:
        timing = row["per_round_ms"]
        cells = [
            setup_name(row["setup"], row["draft"], row.get("constraint", "")),
            row["concurrency"],
            row["tokens_per_second"],
            row["target_only_tokens_per_second"],
            _x(row["speedup"]),
            _x(row["vs_transformers_greedy"]),
            _x(row["vs_transformers_prompt_lookup"]),
            _x(row["target_only_vs_transformers_greedy"]),
            _x(row["split_over_colocated"]),
            row["identical_outputs"] or "–",
            row["mean_acceptance_length"],
            " ".join(f"{a:.2f}" for a in row["acceptance_per_position"]),
            _per_round(timing),
            _outside_cell(row["outside_compute_ms_per_round"], row.get("outside_compute_ms_per_token", {})),
            _cpu_cell(row.get("cpu")),
        ]
        lines.append(_table_row(cells))
    for row in transformers:
        cells = [
            row["setup"],
            "1 (batch 1, sequential)",
            row["tokens_per_second"],
            "–",
            "–",
            _x(row["vs_transformers_greedy"]),
            _x(row["vs_transformers_prompt_lookup"]),
            "–",
            "–",
            row["identical_to_tandem_target_only"] or "–",
            *["–"] * 5,
        ]
        lines.append(_table_row(cells))
    return "\n".join(lines) + "\n"


def _structured_note(settings: dict[str, Any]) -> list[str]:
    if not settings.get("structured"):
        return []
    return [
        "",
        "--structured: each prompt asks for JSON; rows named json schema ran the same prompts with the prompt's JSON "
        "schema on every request (bench/structured.py), ending with the document; the others are free text. "
        "Tokens the grammar forces are verified without a draft and count as accepted drafts.",
    ]


def _cpu_cell(cpu: dict[str, Any] | None) -> str:
    """`target 1.10 + draft 0.62 + orchestrator 0.08 (1.6) / target 1.71 + ... (1.8)`; a colocated row's one
    process `process 1.52 (1.0) / ...`."""
    if not cpu:
        return "–"
    parts = []
    for mode in ("speculative", "target_only"):
        if mode in cpu:
            spent = cpu[mode]["ms_per_token"]
            roles = [role for role in (*SPLIT_ROLES, OWN_PROCESS) if role in spent]
            roles += sorted(role for role in spent if role not in roles and spent[role] >= 0.005)
            text = " + ".join(f"{role} {spent[role]:.2f}" for role in roles)
            parts.append(f"{text} ({cpu[mode]['cores_busy']:.1f})")
    return " / ".join(parts)


def _table_row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def _repeats(count: int) -> str:
    return "one run each" if count == 1 else f"median of {count} runs each"


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def write(out_dir: Path, runs: Sequence[RunResult], settings: dict[str, Any]) -> Path:
    """latest.json (settings, machine, per-row aggregates: no per-request records), latest.md and the PNG."""
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = {**settings, "machine": machine(), "runtime": runtime()}
    rows = summary(runs)
    transformers = transformers_summary(runs)
    document = {"settings": settings, "summary": rows, "transformers": transformers}
    (out_dir / "latest.json").write_text(json.dumps(document, indent=1) + "\n")
    table = markdown(rows, transformers, settings) + _plot(out_dir / PLOT_NAME, rows, settings)
    (out_dir / "latest.md").write_text(table)
    return out_dir / "latest.md"


def _plot(path: Path, rows: Sequence[dict[str, Any]], settings: dict[str, Any]) -> str:
    """Draws the acceptance of every Tandem row by draft position; returns the table's line about the plot."""
    missing = BENCH.missing()
    if missing is not None:
        return f"\nNo acceptance plot: {missing}.\n"
    series = [
        Series(
            f"{setup_name(row['setup'], row['draft'], row.get('constraint', ''))}, concurrency {row['concurrency']}",
            tuple(row["acceptance_per_position"]),
        )
        for row in rows
        if row["acceptance_per_position"]
    ]
    if not series:
        return "\nNo acceptance plot: no round drafted a token.\n"
    subtitle = f"{_draft_name(settings)}, {_steps(settings)}, greedy, {settings['num_prompts']} prompts"
    save_acceptance_plot(path, series, subtitle)
    return f"\nAcceptance per draft position: {path.name}.\n"


def _draft_name(settings: dict[str, Any]) -> str:
    if settings.get("draft_kinds"):
        return "draft kinds " + ", ".join(settings["draft_kinds"])
    if settings.get("ngram"):
        return "n-gram drafts"
    return f"draft {Path(settings['draft_dir']).name}"


def write_requests(path: Path, runs: Sequence[RunResult], settings: dict[str, Any]) -> None:
    """Every run with every request's completion and statistics (`tandem bench --save-requests PATH`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"settings": {**settings, "machine": machine()}, "runs": [_run_json(run) for run in runs]}
    path.write_text(json.dumps(document) + "\n")


def _run_json(run: RunResult) -> dict[str, Any]:
    return {
        "label": run.label,
        "kind": run.kind,
        "constraint": run.constraint,
        "speculative": run.speculative,
        "concurrency": run.concurrency,
        "wall_seconds": run.wall_seconds,
        "tokens_per_second": run.tokens_per_second,
        "mean_acceptance_length": run.mean_acceptance_length,
        "requests": [asdict(request) for request in run.requests],
    }

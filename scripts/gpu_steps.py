"""The GPU check's steps (scripts/gpu_check.py run): each one a time-boxed subprocess whose result is written to
OUT/summary.md the moment it ends, so that a run cut short still says how far it got. The boxes add up to 405 s
(465 s with FlashInfer), inside gpu-check.sh's 470 s and the 8 minutes a run may take on an H100.

    1. tests/cuda (CUDA vs CPU parity, batched verifier, CUDA graphs and FlashInfer where FlashInfer was brought)
    2. stack: `tandem serve --device cuda` with a Llama-3.1-8B-shaped random target (fewer layers: --layers) and a
       random EAGLE3 head, both written on the machine; greedy speculative tokens must equal target-only tokens
    3. bench.gpu at batch 1, 8 and 32, eager and (with FlashInfer) from CUDA graphs: target rounds per draft count
    4. tandem bench on the stack's checkpoint at 1, 8 and 32 requests: split beside colocated, judged against the goals
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def parse(text):"
# The speed goals that two CPU cores could not judge (issue 33).
SPLIT_OVER_COLOCATED = 0.95  # split tok/s at least this share of colocated, at every batch
OUTSIDE_COMPUTE_MS = 0.5  # at most this much of a round outside compute at batch 1
NEVER_BELOW = 0.95  # speculation over target-only at 8 and 32 (adaptive k, a head that predicts nothing), noise allowed


@dataclass
class Result:
    step: str
    passed: bool
    seconds: float
    detail: str


@dataclass
class Record:
    """OUT/summary.md and OUT/steps.jsonl, appended to as each step ends; OUT/log.txt holds the steps' output."""

    out: Path
    results: list[Result] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for name in ("summary.md", "steps.jsonl", "log.txt"):
            (self.out / name).write_text("")

    def add(self, result: Result) -> Result:
        self.results.append(result)
        verdict = "passed" if result.passed else "FAILED"
        with (self.out / "summary.md").open("a") as summary:
            summary.write(f"- {result.step}: {verdict} ({result.seconds:.0f} s) {result.detail}\n")
        with (self.out / "steps.jsonl").open("a") as steps:
            steps.write(json.dumps(asdict(result)) + "\n")
        return result

    def step(self, name: str, timeout_s: float, command: list[str]) -> Result:
        started = time.perf_counter()
        with (self.out / "log.txt").open("a") as log:
            log.write(f"\n=== {name}: {' '.join(command)}\n")
            log.flush()
            try:
                done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
                passed, detail = done.returncode == 0, f"exit {done.returncode}"
            except subprocess.TimeoutExpired:
                passed, detail = False, f"timed out after {timeout_s:.0f} s"
        tail = (self.out / "log.txt").read_text().strip().splitlines()[-1:] or [""]
        return self.add(Result(name, passed, time.perf_counter() - started, f"{detail}; last line: {tail[0][:200]}"))


def stack_command(work: Path, device: str, tiny: bool = False, layers: int = 4, dtype: str = "float32") -> list[str]:
    command = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "stack", str(work), "--device", device]
    return [*command, "--layers", str(layers), "--dtype", dtype, *(["--tiny"] if tiny else [])]


def write_checkpoints(work: Path, tiny: bool, layers: int) -> tuple[Path, Path]:
    """A random target (Llama-3.1-8B's widths, `layers` layers; or the tests' tiny one) and a random EAGLE3 head,
    written with the tests' writers (transformers' own classes)."""
    from tests.helpers.checkpoints import TinyEagle3Spec, TinyTargetSpec, write_tiny_eagle3, write_tiny_target

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    shape = dict(hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, vocab_size=128256)
    rope = dict(rope_theta=500000.0, rope_scaling={**llama3, "original_max_position_embeddings": 8192})
    spec = TinyTargetSpec(num_layers=layers) if tiny else TinyTargetSpec(num_layers=layers, **shape, **rope)  # type: ignore[arg-type]
    target = write_tiny_target(work / "target", spec)
    head = TinyEagle3Spec(
        intermediate_size=spec.intermediate_size,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        draft_vocab_size=min(32000, spec.vocab_size // 2),
        layer_ids=(1, layers // 2, layers - 1),
    )
    return target, write_tiny_eagle3(work / "eagle3", target, head)


def stack_main(args: argparse.Namespace) -> int:
    """Greedy tokens of the split stack with the EAGLE3 head equal its target-only tokens (the same request with
    disable_speculation), on args.device; the head must have drafted."""
    from tests.integration.stack import generate, serve

    started = time.perf_counter()
    target, draft = write_checkpoints(args.work, args.tiny, args.layers)
    print(f"checkpoints written in {time.perf_counter() - started:.0f} s", flush=True)
    flags = ("--device", args.device, "--dtype", args.dtype, "--speculative-num-steps", "3")
    request = dict(prompt=PROMPT, max_new_tokens=32, ignore_eos=True)
    with serve(target, draft, *flags) as stack:
        speculative = generate(stack.address, **request)
        target_only = generate(stack.address, **request, disable_speculation=True)
    for name, completion in (("speculative", speculative), ("target-only", target_only)):
        print(f"{name}: {completion.token_ids}", flush=True)
    same = speculative.token_ids == target_only.token_ids and len(speculative.token_ids) == 32
    drafted = speculative.stats.draft_tokens > 0
    print(f"greedy tokens identical: {'yes' if same else 'NO'} ({len(speculative.token_ids)} tokens)", flush=True)
    print(f"drafts verified: {speculative.stats.draft_tokens}", flush=True)
    return 0 if same and drafted else 1


def bench_gpu_command(out: Path, graphs: bool) -> list[str]:
    command = [sys.executable, "-m", "bench.gpu", "--batch", "1", "8", "32", "--rounds", "10", "--out", str(out)]
    return [*command, "--cuda-graphs", "--attention-backend", "flashinfer"] if graphs else command


def break_even(summary: dict[str, Any]) -> str:
    """Per batch, the smallest acceptance length at which some k's round beats target-only (bench.gpu's rows)."""
    cells = []
    for row in summary["rows"]:
        lengths = [
            int(length)
            for result in row["speculative"].values()
            for length, rate in result["tok_s_by_acceptance_length"].items()
            if rate >= row["target_only_tok_s"]
        ]
        cells.append(f"batch {row['batch']}: L >= {min(lengths) if lengths else 'none'}")
    return "speculation pays from " + ", ".join(cells)


def judge_split(summary: dict[str, Any]) -> tuple[bool, str]:
    """The goals on tandem bench's rows (its latest.json "summary") of the split setup."""
    rows = {row["concurrency"]: row for row in summary["summary"] if row["setup"] == "split"}
    ratios = {batch: row["split_over_colocated"] for batch, row in rows.items()}
    outside = rows[1]["outside_compute_ms_per_round"] if 1 in rows else None
    speedups = {batch: rows[batch]["speedup"] for batch in (8, 32) if batch in rows}
    checks = [
        all(ratio is not None and ratio >= SPLIT_OVER_COLOCATED for ratio in ratios.values()),
        outside is not None and outside <= OUTSIDE_COMPUTE_MS,
        len(speedups) == 2 and all(value is not None and value >= NEVER_BELOW for value in speedups.values()),
    ]
    detail = f"split/colocated {ratios} (goal >= {SPLIT_OVER_COLOCATED}); outside compute at 1: {outside} ms (goal "
    detail += f"<= {OUTSIDE_COMPUTE_MS}); speculation/target-only {speedups} (goal >= {NEVER_BELOW})"
    return all(checks), detail


def read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def bench_steps(record: Record, work: Path, flashinfer: bool) -> None:
    for graphs in (False, True) if flashinfer else (False,):
        name = "bench.gpu " + ("CUDA graphs, flashinfer" if graphs else "eager")
        result = record.step(name, 60, bench_gpu_command(work / "bench-gpu", graphs))
        summary = read_json(work / "bench-gpu" / "latest.json")
        if result.passed and summary is not None:
            shutil.copy(
                work / "bench-gpu" / "latest.json", record.out / f"bench-gpu-{'graphs' if graphs else 'eager'}.json"
            )
            record.add(Result(f"{name}: break-even", True, 0.0, break_even(summary)))
    target, draft = work / "stack" / "target", work / "stack" / "eagle3"
    command = [sys.executable, "-m", "launch.cli", "bench", "--target", str(target), "--draft", str(draft)]
    command += ["--concurrency", "1", "8", "32", "--num-prompts", "16", "--max-new-tokens", "32", "--dtype", "bfloat16"]
    record.step(
        "tandem bench split beside colocated", 120, [*command, "--no-transformers", "--out", str(work / "split")]
    )
    summary = read_json(work / "split" / "latest.json")
    if summary is not None:
        shutil.copy(work / "split" / "latest.json", record.out / "split-bench.json")
        passed, detail = judge_split(summary)
        record.add(Result("goals", passed, 0.0, detail))


def flashinfer_brought() -> bool:
    import importlib.util

    return importlib.util.find_spec("flashinfer") is not None


def run_all(args: argparse.Namespace) -> int:
    record, work = Record(args.out), args.work
    import torch

    machine = f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA'}, torch {torch.__version__}"
    record.add(Result("machine", torch.cuda.is_available(), 0.0, f"{machine}, flashinfer: {flashinfer_brought()}"))
    # In one process, without pyproject's addopts: the image has no pytest-xdist for its `-n`.
    pytest = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/cuda", "-p", "no:cacheprovider"]
    pytest += ["-o", "addopts=-ra", "-p", "no:xdist"]
    record.step("tests/cuda", 75, pytest)
    note = f"Llama-3.1-8B widths, {args.layers} of 32 layers, float32"
    result = record.step(
        "stack: tandem serve --device cuda", 150, stack_command(work / "stack", "cuda", layers=args.layers)
    )
    record.add(Result("stack shape", result.passed, 0.0, note))
    bench_steps(record, work, flashinfer_brought())
    passed = sum(result.passed for result in record.results)
    record.add(Result("total", passed == len(record.results), 0.0, f"{passed} of {len(record.results)} lines passed"))
    print((record.out / "summary.md").read_text(), end="")
    return 0 if all(result.passed for result in record.results) else 1


def add_run_parsers(commands: Any) -> None:
    run = commands.add_parser("run", help="the steps on the GPU machine")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--work", type=Path, default=Path("/tmp/tandem-gpu-check"))
    run.add_argument("--layers", type=int, default=4, help="layers of the stack's 8B-shaped target (32: the real 8B)")
    stack = commands.add_parser("stack", help="one step: the split stack's greedy tokens against target-only")
    stack.add_argument("work", type=Path)
    stack.add_argument("--device", default="cuda")
    stack.add_argument("--dtype", default="float32")
    stack.add_argument("--layers", type=int, default=4)
    stack.add_argument("--tiny", action="store_true", help="the tests' tiny shape (the dry run on a CPU)")


def run_command(args: argparse.Namespace) -> int:
    return run_all(args) if args.command == "run" else stack_main(args)

"""Settings shared by several processes (torch-free, so the CLI can build its parser cheaply)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.flags import checked, flag, positive

# What a service process needs in its environment before torch loads (docs/architecture.md, "Threads"). Services
# on one machine compute in turn, each with its own OpenMP pool; libgomp's default spin before an idle worker sleeps
# (300000 rounds) kept the workers of the process that had just finished spinning on the cores the next one was
# computing on, which made the demo's draft and verify passes about twice as slow as in one process. 10000 rounds
# still bridge the gaps between the kernels of one forward pass.
# TANDEM_LOG_LEVEL: the services' log level (DEBUG shows, among others, each request's k and the estimates behind it).
LOG_LEVEL_VARIABLE = "TANDEM_LOG_LEVEL"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
SERVICE_ENVIRONMENT = {"GOMP_SPINCOUNT": "10000", LOG_LEVEL_VARIABLE: "INFO"}


def log_level() -> str:
    """The services' log level from the environment; raises ValueError naming a value that is none."""
    level = os.environ.get(LOG_LEVEL_VARIABLE, "INFO")
    if level.upper() not in LOG_LEVELS:
        raise ValueError(f"{LOG_LEVEL_VARIABLE}={level!r} is not one of {', '.join(LOG_LEVELS)}")
    return level.upper()


def service_environment() -> dict[str, str]:
    """SERVICE_ENVIRONMENT, with the user's own value wherever the environment already sets a variable."""
    return {name: os.environ.get(name, value) for name, value in SERVICE_ENVIRONMENT.items()}


def apply_service_environment() -> None:
    """Sets each SERVICE_ENVIRONMENT variable the user has not set. It acts only before torch is imported, and is
    inherited by the processes this one starts (services, tensor-parallel ranks, a local Ray cluster)."""
    os.environ.update(service_environment())


# The bundled demo pair (issue 5), installed with the package.
DEMO_DIR = Path(__file__).resolve().parent / "demo"
DEMO_TARGET = DEMO_DIR / "target"
DEMO_DRAFT = DEMO_DIR / "eagle3"
# The demo heads for the demo target, selectable as `--draft demo:<name>`.
DEMO_DRAFTS = {name: DEMO_DIR / name for name in ("eagle3", "eagle3-mla", "mtp", "dflash", "dspark")}
# The demo target is a code model without a chat template; `tandem serve` gives it this one for /v1/chat/completions.
DEMO_CHAT_TEMPLATE = DEMO_DIR / "chat_template.jinja"


def metrics_port_field() -> Any:
    """The `--metrics-port` field of a target's or a draft's settings (tandem/service_metrics.py serves it)."""
    return field(
        default=None,
        metadata=flag(
            "--metrics-port",
            "serve Prometheus /metrics on this port, on --host (0: a free one; unset: none)",
            parse=int,
        ),
    )


def parse_size(text: str) -> int:
    """Bytes in a size such as "512MiB", "2GiB", "1.5G" or "1048576" (K/M/G are powers of 1024, as Ki/Mi/Gi)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    cleaned = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = cleaned[-1:] if cleaned[-1:] in units else ""
    number = cleaned.removesuffix(unit) if unit else cleaned
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise ValueError(f"{text!r} is not a size (e.g. 512MiB, 2GiB, 1048576)") from None
    if value <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return int(value)


@dataclass(frozen=True)
class KVCacheSettings:
    num_blocks: int = field(
        default=1024,
        metadata=flag("--kv-blocks", "KV blocks preallocated in the pool", parse=positive, exclusive="pool"),
    )
    block_size: int = field(default=16, metadata=flag("--block-size", "tokens per KV block", parse=positive))
    # > 0: the pool holds as many blocks as fit in this many bytes (num_blocks is ignored).
    memory_bytes: int = field(
        default=0,
        metadata=flag(
            "--kv-cache-memory",
            "size the KV pool by memory instead of blocks, e.g. 512MiB or 4GiB (per process: target rank, draft)",
            parse=checked(parse_size),
            exclusive="pool",
        ),
    )
    # Full blocks of final KV stay in the pool once freed and are shared by requests with the same prefix
    # (tandem.layers.block_pool); off: every request computes its whole prompt.
    prefix_caching: bool = field(
        default=True,
        metadata=flag(
            "--enable-prefix-caching",
            "keep the KV of computed prefixes and reuse it for requests that start with the same tokens",
        ),
    )
    # A service frees the requests of an orchestrator that holds no stream to it and made no call for this long
    # (tandem.leases): an orchestrator that died, or restarted under a new session id.
    orphan_timeout_s: float = field(
        default=30.0,
        metadata=flag(
            "--orphan-timeout", "seconds after which the requests of an orchestrator that went away are freed"
        ),
    )
    # The pool's attention backend by name ("torch", "flashinfer"; tandem.layers.attention_backend); None: the
    # default for the cache's device and dtype. No option: the CLI resolves --attention-backend (tandem.devices).
    attention_backend: str | None = None
    # Decode-shaped steps replayed from CUDA graphs (tandem.layers.cuda_graphs): CUDA and the flashinfer backend
    # only (the CLI refuses it elsewhere); the pool then holds one scratch block more.
    cuda_graphs: bool = False

    def blocks_for(self, bytes_per_block: int) -> int:
        """The pool's size in blocks, for a cache where one block takes `bytes_per_block` bytes."""
        if self.memory_bytes <= 0:
            return self.num_blocks
        blocks = self.memory_bytes // bytes_per_block
        if blocks < 1:
            raise ValueError(
                f"--kv-cache-memory: {self.memory_bytes} bytes do not hold one KV block ({bytes_per_block} bytes)"
            )
        return blocks


@dataclass(frozen=True)
class TreeShape:
    """Tree drafting (docs/drafting.md, "Tree drafting"), SGLang's flags: --speculative-eagle-topk K and
    --speculative-num-draft-tokens N. K 1 is the chain of --speculative-num-steps tokens (N = steps + 1)."""

    topk: int = field(
        default=1,
        metadata=flag(
            "--speculative-eagle-topk", "tree drafting: branches per node of an EAGLE3 head's draft tree; 1: a chain"
        ),
    )
    # Counting the last committed token; 0: steps + 1.
    num_draft_tokens: int = field(
        default=0,
        metadata=flag(
            "--speculative-num-draft-tokens",
            "tree drafting: nodes of the tree plus one (the last committed token); 0: --speculative-num-steps + 1, "
            "which topk 1 requires",
        ),
    )

    def resolved(self, num_steps: int) -> TreeShape:
        """The shape with N filled in, checked against --speculative-num-steps; ValueError names the flags."""
        if self.topk < 1:
            raise ValueError(f"--speculative-eagle-topk: {self.topk}, at least 1")
        tokens = self.num_draft_tokens or num_steps + 1
        if self.topk == 1 and tokens != num_steps + 1:
            raise ValueError(
                f"--speculative-num-draft-tokens {tokens} with --speculative-eagle-topk 1: a chain of "
                f"--speculative-num-steps {num_steps} drafts has num_draft_tokens {num_steps + 1}"
            )
        if not 2 <= tokens <= self.topk * num_steps + 1:
            raise ValueError(
                f"--speculative-num-draft-tokens {tokens}: between 2 and --speculative-eagle-topk * "
                f"--speculative-num-steps + 1 = {self.topk * num_steps + 1} (the nodes the expansion creates, plus one)"
            )
        return TreeShape(self.topk, tokens)

    @property
    def max_drafts(self) -> int:
        """Draft tokens a round may carry (once resolved): num_draft_tokens - 1."""
        return self.num_draft_tokens - 1


def image_limit(text: str) -> int:
    """--limit-mm-per-prompt's JSON, e.g. '{"image": 2}' -> 2: the images one prompt may hold (0: none, and no image
    tower loaded). Other modalities are refused by name: only images are served. The count alone ("2") is taken too:
    it is how a target's settings are passed on to its other ranks."""
    if text.isdigit():
        return int(text)
    try:
        limits = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"{text!r}: not JSON; e.g. '{{\"image\": 2}}'") from None
    if not isinstance(limits, dict) or set(limits) - {"image"}:
        raise ValueError(f'{text!r}: an object of per-modality counts; only "image" is served')
    count = limits.get("image", 0)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f'{text!r}: "image" takes a count, 0 or more')
    return count

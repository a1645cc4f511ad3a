"""Settings of `tandem bench-load`; its options are their fields' (tandem.flags, bench.cli; no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tandem.flags import flag
from tandem.settings import KVCacheSettings


@dataclass(frozen=True)
class LoadSettings:
    """A load test: `streams` greedy Generate streams sent at once to a fresh `tandem serve` on loopback.

    Each stream gets a prompt of held-out code and a token budget drawn from the two ranges (inclusive); with
    `ignore_eos` every stream generates its whole budget, so the KV demand is known in advance. The pool
    (`kv_blocks`, on the target and on the draft replica) is meant to be several times smaller than that demand.
    """

    target_dir: Path
    draft_dir: Path
    streams: int = field(default=256, metadata=flag("--streams", "streams opened at once"))
    prompt_tokens: tuple[int, int] = field(
        default=(8, 400),
        metadata=flag("--prompt-tokens", "each stream's prompt length", count=2, metavar=("MIN", "MAX")),
    )
    new_tokens: tuple[int, int] = field(
        default=(16, 128),
        metadata=flag("--max-new-tokens", "each stream's token budget", count=2, metavar=("MIN", "MAX")),
    )
    # The default demand (256 streams, means of 204 prompt and 72 new tokens) is about 4,600 blocks of 16 tokens:
    # nine times this pool, which still holds the longest request (400 + 128 tokens, 33 blocks) alone.
    kv_blocks: int = field(default=512, metadata=flag("--kv-blocks", "KV pool of target and draft"))
    block_size: int = KVCacheSettings.block_size
    num_steps: int = 5  # draft tokens proposed per round
    # For every stream to finish, once the stack is ready.
    timeout_s: float = field(
        default=1200.0, metadata=flag("--timeout", "seconds for all streams to finish (then fail)")
    )
    sample_interval_s: float = 0.2  # between samples of each process's resident memory
    seed: int = 0  # of the prompt and budget draws
    # latest.json (a summary of a few KB) and latest.md.
    out_dir: Path = field(
        default=Path("bench/results/load"), metadata=flag("--output-dir", "for latest.json and latest.md")
    )

    def check(self) -> None:
        """Raises ValueError naming the flag whose value cannot make a load test."""
        if self.streams < 1:
            raise ValueError(f"--streams must be at least 1, got {self.streams}")
        for name, (low, high) in (("--prompt-tokens", self.prompt_tokens), ("--max-new-tokens", self.new_tokens)):
            if not 1 <= low <= high:
                raise ValueError(f"{name} takes MIN MAX with 1 <= MIN <= MAX, got {low} {high}")
        if self.kv_blocks < 1 or self.block_size < 1:
            raise ValueError(f"--kv-blocks and --block-size must be at least 1, got {self.kv_blocks} {self.block_size}")
        longest = self.prompt_tokens[1] + self.new_tokens[1]
        needed = self.blocks(longest)
        if needed > self.kv_blocks:
            raise ValueError(
                f"--kv-blocks {self.kv_blocks}: the longest stream ({self.prompt_tokens[1]} prompt + "
                f"{self.new_tokens[1]} new tokens) needs {needed} blocks of {self.block_size} tokens alone"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be above 0 seconds, got {self.timeout_s}")

    def blocks(self, tokens: int) -> int:
        """KV blocks that hold `tokens` positions."""
        return -(-tokens // self.block_size)

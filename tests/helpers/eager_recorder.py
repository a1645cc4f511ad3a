"""A recorder for tandem.layers.cuda_graphs that replays by running the recorded forward again, so that everything
of GraphedForward but the CUDA graph itself (choosing the shape, padding into the scratch block, the static buffers,
planning the attention again for every step) runs where there is no GPU."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.layers.attention_backend import AttentionBackend, AttentionStep
from tandem.layers.cuda_graphs import GraphedForward
from tandem.layers.kv_cache import PagedKVCache
from tandem.layers.page_table import PageTable


class Replanned:
    """An attention step that the recorder plans again for each replay (what a CUDA-graph step's `replan` does)."""

    def __init__(self, backend: AttentionBackend, table: PageTable) -> None:
        self.backend = backend
        self.step = backend.plan(table)

    def attend(self, *args: object) -> torch.Tensor:
        return self.step.attend(*args)  # type: ignore[arg-type]

    def attend_latent(self, *args: object) -> torch.Tensor:
        return self.step.attend_latent(*args)  # type: ignore[arg-type]


class EagerRecorder:
    """Counts what GraphedForward asked of it; `fail` makes every recording fail (a forward that cannot be recorded)."""

    def __init__(self, cache: PagedKVCache, fail: bool = False) -> None:
        self.backend = cache.backend
        self.fail = fail
        self.recorded: list[int] = []  # the batch size of each shape recorded (or tried)
        self.replays = 0

    def attention(self, table: PageTable, batch: int) -> AttentionStep:
        self.recorded.append(batch)
        return Replanned(self.backend, table)

    def replan(self, attention: AttentionStep, table: PageTable) -> None:
        assert isinstance(attention, Replanned)
        attention.step = self.backend.plan(table)

    def record(self, forward: Callable[[], dict[str, torch.Tensor]]) -> Callable[[], dict[str, torch.Tensor]]:
        if self.fail:
            raise RuntimeError("this forward cannot be recorded")

        def replay() -> dict[str, torch.Tensor]:
            self.replays += 1
            return forward()

        return replay


class EagerGraphs:
    """A GraphsFactory for the runners that keeps the recorder it built, for the test to look at."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.recorder: EagerRecorder | None = None

    def __call__(self, cache: PagedKVCache) -> GraphedForward:
        self.recorder = EagerRecorder(cache, self.fail)
        return GraphedForward(cache, self.recorder, max_batch=8)

"""The target's tensor-parallel ranks: rank 0 (the gRPC service) drives, ranks 1..tp-1 follow.

Only rank 0 keeps requests, block tables and sampling state. For every forward pass it broadcasts a command over the
group's command channel (gloo, CPU tensors): a header [command, payload length], then the payload. Commands:
    FORWARD        payload: the step (target_server.step: input ids, positions, write slots, spans with their context
                   slots, capture indices, logit rows); every rank then runs the model on its own KV-cache shard,
                   and the LM head's all-gather brings the logits to rank 0, which decides acceptance alone.
    EMBEDDINGS     payload: the rows of the next FORWARD embedded as given (an image's tokens), then a second
                   broadcast of their float32 values [rows, hidden]: rank 0 alone encodes images.
    WEIGHT_SHARDS  payload: [index of the table in SHARED_TABLES]; every rank sends its padded shard to rank 0.
    STOP           no payload; the other ranks leave the group and exit.
A rank that follows waits for the next command for as long as the target sits idle (ParallelGroup's timeout), and
ends when rank 0's connection closes, so ranks never outlive rank 0; the ranks that rank 0 starts also get SIGTERM
from the kernel when it dies (tandem.lifetime).
"""

from __future__ import annotations

import enum
import logging
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from tandem.devices import DeviceRequest
from tandem.errors import StartupError
from tandem.flags import arguments_of
from tandem.layers.kv_cache import PagedKVCache
from tandem.layers.matmul import Linear
from tandem.lifetime import start_child
from tandem.models.registry import TargetModel
from tandem.models.stack import TargetOutput
from tandem.parallel.group import (
    SINGLE_PROCESS,
    ParallelGroup,
    barrier,
    broadcast_from_first,
    free_rendezvous,
    gather_to_first,
    join_group,
    leave_group,
    share_cpu_threads,
)
from tandem.parallel.layers import ParallelLMHead, VocabParallelEmbedding
from tandem.parallel.vocab import shard_table
from tandem.settings import KVCacheSettings
from target_server.settings import TargetSettings
from target_server.step import ForwardStep, decode_step, encode_step, run_step

LOG = logging.getLogger(__name__)

SHARED_TABLES = ("embed_tokens", "lm_head")  # what drafts may share with the target
STOP_TIMEOUT_S = 15.0


class Command(enum.IntEnum):
    FORWARD = 1
    WEIGHT_SHARDS = 2
    STOP = 3
    EMBEDDINGS = 4  # the next FORWARD's embedded rows (payload), then their float32 values [rows, hidden]


class RankFailed(RuntimeError):
    """A rank other than 0 has exited; the target cannot compute without it."""


def build_cache(model: TargetModel, settings: KVCacheSettings) -> PagedKVCache:
    """This rank's KV cache: the same blocks on every rank, each holding the rank's share of the KV heads."""
    parameter = next(model.parameters())
    layout = model.cache_layout
    return PagedKVCache.for_layout(model.config.num_layers, layout, settings, parameter.dtype, parameter.device)


def shared_table(model: TargetModel, name: str) -> nn.Module:
    """The module holding a table that drafts may share: the embedding or the LM head."""
    if name not in SHARED_TABLES:
        raise ValueError(f"{name!r} is not one of {', '.join(SHARED_TABLES)}")
    return model.model.embed_tokens if name == "embed_tokens" else model.lm_head


class RankDriver:
    """Rank 0's side: runs each step here after telling the other ranks to run it. With tp 1 it only runs it.

    Safe to call from any thread: a lock keeps each command and the collectives that follow it together, so that
    the ranks see commands in the order rank 0 runs them.
    """

    def __init__(self, group: ParallelGroup, processes: Sequence[subprocess.Popen[bytes]] = ()) -> None:
        self.group = group
        self.processes = list(processes)  # ranks 1..tp-1 when rank 0 started them; empty when started elsewhere
        self.stopping = False
        self._lock = threading.Lock()

    def forward(
        self, model: TargetModel, cache: PagedKVCache, step: ForwardStep
    ) -> tuple[TargetOutput, torch.Tensor]:  # -> output, logits [num_rows, vocab] float32
        with self._lock:
            if self.group.world_size > 1:  # encoding the step is per-forward work a single rank does not need
                if step.embeddings is not None:  # an image's features, computed on this rank only
                    rows, values = step.embeddings
                    self._send(Command.EMBEDDINGS, rows.cpu())
                    broadcast_from_first(values.float().cpu().contiguous(), self.group)
                self._send(Command.FORWARD, encode_step(step))
            return run_step(model, cache, step)

    def weight_shards(self, model: TargetModel, name: str) -> list[torch.Tensor]:  # -> tp tensors [s, hidden]
        """The vocab-parallel shards of a shared table, as each rank holds it (tandem.parallel.vocab).

        A vocab-parallel table is gathered from the ranks; a replicated one (Gemma3) is cut here by the same rule. A
        head kept as stored (a quantized checkpoint's, tandem.layers.stored) goes out expanded: drafts take floats.
        """
        module = shared_table(model, name)
        if isinstance(module, (VocabParallelEmbedding, ParallelLMHead)):
            with self._lock:
                self._send(Command.WEIGHT_SHARDS, torch.tensor([SHARED_TABLES.index(name)]))
                return gather_to_first(module.padded_weight(), self.group)
        # Replicated: every rank holds the whole table.
        weight = module.float_weight() if isinstance(module, Linear) else module.weight
        assert isinstance(weight, torch.Tensor)
        return [shard_table(weight.detach(), self.group.world_size, rank) for rank in range(self.group.world_size)]

    def wait_until_loaded(self) -> None:
        """Returns once every rank holds its weights; raises StartupError if a rank failed on the way."""
        try:
            barrier(self.group)
        except RuntimeError as error:  # the group broke: a rank went away
            reason = str(error).splitlines()[0]
            raise StartupError(f"a target rank failed while loading (its log is above): {reason}") from None

    def check_running(self) -> None:
        """Raises RankFailed if a rank process that rank 0 started has exited."""
        check_running(self.processes)

    def stop(self) -> None:
        """Tells the other ranks to exit and waits for the processes that rank 0 started; idempotent."""
        if self.stopping:
            return
        self.stopping = True
        if self.group.world_size > 1:
            with self._lock:
                try:
                    self._send(Command.STOP, torch.empty(0, dtype=torch.long))
                except RuntimeError as error:  # a rank already gone
                    LOG.warning("could not tell every rank to stop: %s", error)
            for rank, process in enumerate(self.processes, start=1):
                try:
                    process.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    LOG.warning("target rank %d did not stop within %.0f s, killing it", rank, STOP_TIMEOUT_S)
                    process.kill()
                    process.wait()
        leave_group(self.group)

    def abort(self) -> None:
        """Start-up failed on rank 0: ends the other ranks without a word (they may be anywhere in loading)."""
        self.stopping = True
        for process in self.processes:
            process.kill()
            process.wait()
        leave_group(self.group)

    def _send(self, command: Command, payload: torch.Tensor) -> None:  # payload: [n] int64
        if self.group.world_size > 1:
            broadcast_from_first(torch.tensor([command, payload.numel()]), self.group)
            if payload.numel():
                broadcast_from_first(payload, self.group)


def follow(model: TargetModel, cache: PagedKVCache, group: ParallelGroup) -> None:
    """A rank other than 0: runs rank 0's commands until STOP (see the module docstring)."""
    embeddings = None  # EMBEDDINGS' rows and values, for the FORWARD that follows
    while True:
        command, length = broadcast_from_first(torch.zeros(2, dtype=torch.long), group).tolist()
        payload = broadcast_from_first(torch.zeros(length, dtype=torch.long), group) if length else None
        if command == Command.STOP:
            return
        assert payload is not None
        if command == Command.EMBEDDINGS:
            values = broadcast_from_first(torch.zeros((length, model.config.hidden_size)), group)
            embeddings = (payload.to(cache.device), values.to(cache.device))
        elif command == Command.FORWARD:
            run_step(model, cache, replace(decode_step(payload, cache), embeddings=embeddings))
            embeddings = None
        elif command == Command.WEIGHT_SHARDS:
            module = shared_table(model, SHARED_TABLES[int(payload[0])])
            assert isinstance(module, (VocabParallelEmbedding, ParallelLMHead))
            gather_to_first(module.padded_weight(), group)
        else:
            raise RuntimeError(f"unknown command {command} from rank 0")


def start_ranks(settings: TargetSettings, device: torch.device) -> RankDriver:
    """Rank 0: starts ranks 1..tp-1 (unless someone else did) and joins them; tp 1 needs nothing started.

    Without `settings.rendezvous` the ranks are child processes of this one (`python -m target_server.rank`) that
    meet on a free loopback port; with it they were started elsewhere (the Ray launcher) and meet there.
    """
    if settings.tp == 1:
        return RankDriver(SINGLE_PROCESS)
    rendezvous = settings.rendezvous
    processes = []
    if rendezvous is None:
        rendezvous = free_rendezvous()
        processes = [spawn_rank(settings, rank, rendezvous) for rank in range(1, settings.tp)]

    def give_up_if_a_rank_died() -> None:
        try:
            check_running(processes)
        except RankFailed as error:
            raise StartupError(str(error)) from None

    try:
        group = join_group(0, settings.tp, rendezvous, device, while_waiting=give_up_if_a_rank_died)
    except BaseException:
        for process in processes:
            process.kill()
        raise
    if device.type == "cpu":
        share_cpu_threads(group, settings.threads)
    return RankDriver(group, processes)


def check_running(processes: Sequence[subprocess.Popen[bytes]]) -> None:  # ranks 1, 2, ... in order
    for rank, process in enumerate(processes, start=1):
        if process.poll() is not None:
            raise RankFailed(f"target rank {rank} exited with code {process.returncode} (its log is above)")


def rank_command(settings: TargetSettings, rank: int, rendezvous: str) -> list[str]:
    """`python -m target_server.rank` as rank `rank` of these settings (tandem.flags) that meets at `rendezvous`."""
    device = DeviceRequest.of(settings.device, settings.dtype, settings.cache)
    arguments = [*arguments_of(settings), *arguments_of(device), "--rank", str(rank), "--rendezvous", rendezvous]
    return [sys.executable, "-m", "target_server.rank", *arguments]


def spawn_rank(settings: TargetSettings, rank: int, rendezvous: str) -> subprocess.Popen[bytes]:
    process = start_child(rank_command(settings, rank, rendezvous))  # SIGTERM when this one is killed (tandem.lifetime)
    LOG.info("started target rank %d/%d (pid %d)", rank, settings.tp, process.pid)
    return process

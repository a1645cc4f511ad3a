"""`python -m target_server.rank`: one target rank other than 0, as rank 0 starts it (target_server.ranks).

It joins the group, loads its shard of the weights, and runs rank 0's commands until rank 0 says stop or goes away.
A rank started as a child process also exits as soon as its parent (rank 0) is gone, however that happened.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from tandem.devices import rank_device
from tandem.errors import StartupError
from tandem.layers.matmul import prepack
from tandem.models.registry import load_target
from tandem.parallel.group import barrier, join_group, leave_group, share_cpu_threads
from tandem.serving import configure_logging
from tandem.settings import KVCacheSettings
from target_server.ranks import build_cache, follow
from target_server.settings import TargetSettings

LOG = logging.getLogger(__name__)
PARENT_POLL_S = 0.5


def run_rank(settings: TargetSettings, rank: int) -> None:
    """Serves as rank `rank` of settings.tp until rank 0 stops it; raises RuntimeError when rank 0 is lost."""
    assert settings.rendezvous is not None, "ranks other than 0 join rank 0's rendezvous"
    started = time.perf_counter()
    device = rank_device(settings.device, rank)
    group = join_group(rank, settings.tp, settings.rendezvous, torch.device(device))
    if device == "cpu":
        share_cpu_threads(group, settings.threads)
    try:
        LOG.info(
            "rank %d/%d: loading its shard of %s (%s on %s)",
            rank,
            settings.tp,
            settings.model_dir,
            settings.dtype,
            device,
        )
        model = load_target(settings.model_dir, dtype=getattr(torch, settings.dtype), device=device, group=group)
        prepack(model)
        cache = build_cache(model, settings.cache)
        LOG.info("rank %d/%d: loaded in %.1f s", rank, settings.tp, time.perf_counter() - started)
        barrier(group)
        follow(model, cache, group)
        LOG.info("rank %d/%d: stopped by rank 0", rank, settings.tp)
    finally:
        leave_group(group)


def exit_with_parent() -> None:
    """Exits this process once its parent is gone (killed rank 0 included): ranks must never be orphans."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        LOG.error("rank 0 (pid %d) is gone, exiting", parent)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m target_server.rank", description=__doc__)
    # No defaults: rank 0 passes every value from its own TargetSettings.
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--device", required=True, help="rank 0's device; this rank's is tandem.devices.rank_device")
    parser.add_argument("--attention-backend", help="the KV cache's attention backend; none: its device's default")
    parser.add_argument("--kv-blocks", type=int, required=True)
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--kv-cache-memory", type=int, required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--rendezvous", required=True, help="host:port where rank 0 serves the group's store")
    args = parser.parse_args(argv)
    configure_logging(f"target-rank{args.rank}")
    exit_with_parent()
    settings = TargetSettings(
        model_dir=args.model,
        dtype=args.dtype,
        device=args.device,
        cache=KVCacheSettings(
            num_blocks=args.kv_blocks,
            block_size=args.block_size,
            memory_bytes=args.kv_cache_memory,
            attention_backend=args.attention_backend,
        ),
        tp=args.tp,
        threads=args.threads,
        rendezvous=args.rendezvous,
    )
    try:
        run_rank(settings, args.rank)
    except StartupError as error:
        LOG.error("target rank %d cannot start: %s", args.rank, error)
        return 2
    except RuntimeError as error:  # the group broke: rank 0 went away without saying stop
        LOG.error("target rank %d lost the group, exiting: %s", args.rank, str(error).splitlines()[0])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

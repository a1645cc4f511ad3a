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
from dataclasses import replace

import torch

from tandem.devices import DeviceRequest, rank_device, resolve_attention_backend
from tandem.errors import StartupError
from tandem.flags import add_options, settings_of
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
        model = load_target(settings.model_dir, getattr(torch, settings.dtype), device, group, settings.dequantize)
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


def parse_arguments(argv: Sequence[str] | None = None) -> tuple[TargetSettings, int]:
    """The settings and the rank that rank 0 gave (target_server.ranks.rank_command)."""
    parser = argparse.ArgumentParser(prog="python -m target_server.rank", description=__doc__)
    # `tandem target`'s options (rank 0 passes its own TargetSettings and resolved devices), and the two that only
    # ranks other than 0 have.
    add_options(parser, TargetSettings)
    add_options(parser, DeviceRequest)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--rendezvous", required=True, help="host:port where rank 0 serves the group's store")
    args = parser.parse_args(argv)
    request = settings_of(DeviceRequest, args)  # resolved by rank 0; its backend "auto" when its cache named none
    backend = resolve_attention_backend(request.attention_backend, request.device, request.dtype)
    cache = replace(settings_of(KVCacheSettings, args), attention_backend=backend, cuda_graphs=request.cuda_graphs)
    settings = settings_of(
        TargetSettings, args, dtype=request.dtype, device=request.device, cache=cache, rendezvous=args.rendezvous
    )
    return settings, args.rank


def main(argv: Sequence[str] | None = None) -> int:
    settings, rank = parse_arguments(argv)
    configure_logging(f"target-rank{rank}")
    exit_with_parent()
    try:
        run_rank(settings, rank)
    except StartupError as error:
        LOG.error("target rank %d cannot start: %s", rank, error)
        return 2
    except RuntimeError as error:  # the group broke: rank 0 went away without saying stop
        LOG.error("target rank %d lost the group, exiting: %s", rank, str(error).splitlines()[0])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

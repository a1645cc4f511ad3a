"""What applying a block drafter's `fc` + `hidden_norm` at the target would trade: the rows a round sends shrink from
n x H to H values each (less to serialize, send and parse), and the target computes the projection instead.

    python -m bench.wire_features [--draft tandem/demo/dflash] [--rows 1 5 8]

For each row count it times, on this machine, a round's features through the wire codec (tandem.wire.codec: to a
Tensor message, its bytes, and back) at their full width and at the projected width, and the drafter's own
`hidden_norm(fc(features))` (prepacked, as served) on those rows: the medians of 5 batches of repeated calls.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch

from tandem.layers.matmul import prepack
from tandem.models.dflash import load_dflash
from tandem.settings import DEMO_DRAFTS
from tandem.wire import common_pb2
from tandem.wire.codec import tensor_from_proto, tensor_to_proto


def microseconds(call: Callable[[], object], repeats: int) -> float:
    for _ in range(repeats // 10):
        call()
    batches = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeats):
            call()
        batches.append((time.perf_counter() - started) / repeats)
    return 1e6 * statistics.median(batches)


def through_the_wire(rows: torch.Tensor) -> torch.Tensor:
    return tensor_from_proto(common_pb2.Tensor.FromString(tensor_to_proto(rows).SerializeToString()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", type=Path, default=DEMO_DRAFTS["dflash"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 8])
    args = parser.parse_args(argv)
    model, _ = load_dflash(args.draft)
    prepack(model)
    width, hidden = len(model.config.target_layer_ids) * model.config.hidden_size, model.config.hidden_size
    print(f"{args.draft}: features {width} wide, projected {hidden}")
    with torch.inference_mode():
        for count in args.rows:
            full, projected = torch.randn(count, width), torch.randn(count, hidden)
            wire_full = microseconds(partial(through_the_wire, full), 2000)
            wire_projected = microseconds(partial(through_the_wire, projected), 2000)
            project = microseconds(partial(lambda rows: model.hidden_norm(model.fc(rows)), full), 500)
            print(
                f"{count} rows: wire {wire_full:.1f} us at full width, {wire_projected:.1f} us projected; "
                f"fc + hidden_norm {project:.1f} us"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Regenerates the gRPC stubs in tandem/wire/ from proto/tandem/v1/*.proto.

Usage: python scripts/gen_protos.py [--out DIR]

protoc writes `from tandem.v1 import x_pb2`; the stubs live in the package tandem.wire, so those
imports are rewritten to `from tandem.wire import x_pb2`. tests/unit/test_protos.py regenerates into
a temporary folder and checks that the committed stubs are byte-identical.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_DIR = PROTO_ROOT / "tandem" / "v1"
DEFAULT_OUT = ROOT / "tandem" / "wire"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Generates stubs for every proto file into out_dir (flat) and returns the written paths."""
    protos = sorted(PROTO_DIR.glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(p) for p in protos],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        written = []
        out_dir.mkdir(parents=True, exist_ok=True)
        for src in sorted((Path(tmp) / "tandem" / "v1").iterdir()):
            if not src.name.endswith(GENERATED_SUFFIXES):
                continue
            text = re.sub(r"^from tandem\.v1 import", "from tandem.wire import", src.read_text(), flags=re.M)
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

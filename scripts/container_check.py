"""The container check (scripts/container-check.sh runs it; docs/deploy.md, "Containers"): the CPU image built from
deploy/docker/Dockerfile.cpu, the three services run from it with the commands the Helm chart renders, and the
chart's cpu-demo manifests played by `podman kube play` (scripts/container_kube.py). Each check prints `[held]` or
`[FAILED]` as it is decided; the summary at the end lists them all, and the exit status is 1 if any failed.

    python scripts/container_check.py --helm HELM [--base-image IMAGE] [--torch-wheels DIR]
"""

from __future__ import annotations

import argparse
import functools
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: the sibling modules come from the source tree

from scripts.container_kube import play_chart  # noqa: E402
from scripts.container_tools import (  # noqa: E402
    API,
    COMPONENTS,
    CPU_DEMO_VALUES,
    PROMPT,
    SHORT_TOKENS,
    ULIMITS,
    Manifest,
    Report,
    container_environment,
    eventually,
    exit_code,
    expand_variables,
    hosts_file,
    log,
    podman,
    render_chart,
    wait_until,
    workload_containers,
)

IMAGE = "localhost/tandem-cpu:0.1.0"  # the name the cpu-demo values give (image.repository, the chart's appVersion)
PORTS = (8000, 50051, 50052, 50061, 50062)  # the cpu-demo values' HTTP, Generate, admin, target and draft ports
LONG_TOKENS = 160  # long enough on the demo pair that a stream is still running when SIGTERM arrives
# A host CA bundle mounted over the image's during the build only: where the network re-signs TLS with a CA of its
# own, Debian's pip (which reads this file) reaches PyPI through it. Nothing of it stays in the image.
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def build_image(report: Report, base_image: str, torch_wheels: Path | None) -> bool:
    # Docker's image format: the OCI one has no HEALTHCHECK, and podman would drop the image's.
    command = ["build", "--format", "docker", "--runtime", "runc", "--network", "host", *ULIMITS]
    command += ["-f", "deploy/docker/Dockerfile.cpu", "--build-arg", f"BASE_IMAGE={base_image}", "-t", IMAGE]
    if torch_wheels is not None:
        command += ["-v", f"{torch_wheels}:/wheels:ro", "--build-arg", "TORCH_WHEELS=/wheels"]
    if HOST_CA_BUNDLE.is_file():
        command += ["-v", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"]
    log(f"podman {' '.join(command)} .")
    started = time.monotonic()
    result = subprocess.run(["nice", "-n", "19", "ionice", "-c3", "podman", *command, "."], cwd=ROOT, timeout=3600)
    seconds = time.monotonic() - started
    if not report.check(result.returncode == 0, f"the CPU image builds from {base_image} ({seconds:.0f} s)"):
        return False
    size = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout.strip())
    version = podman("--version").stdout.strip()
    report.note(f"image {IMAGE}: {size / 1e6:.0f} MB, built in {seconds:.0f} s ({version}; unchanged layers cached)")
    return True


def run_container(
    name: str, arguments: list[str], environment: dict[str, str], health_port: int, hosts: Path | None = None
) -> None:
    """One detached container as the chart's pods run: host network, the chart's user, a read-only root with /tmp,
    the image's health check pointed at the service's port, and the Services' names from `hosts`."""
    options = ["--network", "host", *ULIMITS, "--user", "10001:10001", "--read-only", "--tmpfs", "/tmp"]
    options += ["--shm-size", "256m", "--env", f"TANDEM_HEALTH_ADDRESS=127.0.0.1:{health_port}"]
    options += [f"--env={key}={value}" for key, value in environment.items()]
    if hosts is not None:
        options += ["-v", f"{hosts}:/etc/hosts:ro"]
    podman("rm", "-f", "--ignore", name)
    podman("run", "-d", "--name", name, *options, IMAGE, *arguments)


def healthy(container: str) -> bool:
    """The image's HEALTHCHECK (deploy/docker/healthcheck.py) run once inside the container."""
    return podman("healthcheck", "run", container, check=False, timeout=30).returncode == 0


def serve_reference(report: Report) -> tuple[str, str]:
    """The image run with no arguments (`tandem serve` of the demo): the greedy outputs the stack must equal."""
    name = "tandem-check-serve"
    run_container(name, [], {"HOME": "/tmp"}, health_port=50051)
    try:
        wait_until(API.ready, "tandem serve in the image answers on :8000", timeout_s=300)
        report.check(healthy(name), "the image's health check answers for `tandem serve`")
        outputs = (API.completion(PROMPT, SHORT_TOKENS), API.completion(PROMPT, LONG_TOKENS))
        report.check(all(outputs), "`tandem serve` in the image answers greedy completions (the reference)")
    finally:
        podman("stop", "--time", "60", name, timeout=90)
    report.check(exit_code(name) == 0, "`tandem serve` in a container exits 0 on SIGTERM")
    podman("rm", "-f", name)
    return outputs


def drain_on_sigterm(report: Report, orchestrator: str, expected: str) -> None:
    """A stream in flight when the orchestrator gets SIGTERM finishes whole, and the container exits 0."""
    received: list[str] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            for text in API.stream(PROMPT, LONG_TOKENS):
                received.append(text)
        except Exception as error:  # reported as the check's outcome, not raised in the reader's thread
            errors.append(error)

    reader = threading.Thread(target=read)
    reader.start()
    wait_until(lambda: bool(received) or bool(errors), "the stream's first chunk", timeout_s=60, interval_s=0.05)
    podman("kill", "--signal", "TERM", orchestrator)
    before = len(received)  # counted after the signal was sent: the chunks after it are at least the rest
    reader.join(timeout=120)
    whole = "".join(received) == expected and not errors and before < len(received)
    detail = (
        f"{len(received) - before} of {len(received)} chunks after the signal{f', {errors[0]!r}' if errors else ''}"
    )
    report.check(whole, f"a stream in flight at SIGTERM finishes with the greedy output ({detail})")
    podman("wait", orchestrator, timeout=90)
    report.check(exit_code(orchestrator) == 0, "the orchestrator container exits 0 after draining")


def services_from_chart(report: Report, manifests: list[Manifest], reference: tuple[str, str], hosts: Path) -> None:
    containers = workload_containers(manifests)
    names = {component: f"tandem-check-{component}" for component in COMPONENTS}
    try:
        for component in COMPONENTS:
            container = containers[component]
            environment = container_environment(container, pod_name=names[component])
            arguments = [expand_variables(argument, environment) for argument in container["args"]]
            log(f"{names[component]}: tandem {' '.join(arguments)}")
            run_container(names[component], arguments, environment, container["ports"][0]["containerPort"], hosts)
        for name in names.values():
            answered = eventually(functools.partial(healthy, name), timeout_s=300)
            report.check(answered, f"{name} (the chart's command) answers the image's health check")
        wait_until(API.ready, "the orchestrator's HTTP API", timeout_s=120)
        joined = eventually(lambda: API.metric("tandem:draft_replicas", state="serving") == 1, timeout_s=120)
        report.check(joined, "the orchestrator found the draft by the chart's --draft-dns name")
        short = API.completion(PROMPT, SHORT_TOKENS)
        report.check(short == reference[0], "a greedy completion over HTTP equals `tandem serve`'s")
        drain_on_sigterm(report, names["orchestrator"], reference[1])
        for component in ("draft", "target"):
            podman("stop", "--time", "60", names[component], timeout=90)
            report.check(exit_code(names[component]) == 0, f"the {component} container exits 0 on SIGTERM")
    finally:
        for name in names.values():
            podman("rm", "-f", "--ignore", name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--helm", required=True, help="a helm binary (scripts/get-helm.sh)")
    parser.add_argument("--base-image", help="the image to build on (default: scripts/make-base-image.sh's)")
    parser.add_argument("--torch-wheels", type=Path, help="a directory holding torch's CPU wheel")
    parser.add_argument("--work", type=Path, default=ROOT / ".cache" / "container-check")
    args = parser.parse_args()
    report = Report()
    # Every container shares the host's network: a port already taken would make a service fail to start.
    taken = [port for port in PORTS if not port_free(port)]
    if not report.check(not taken, f"the chart's ports are free on this host ({', '.join(map(str, PORTS))})"):
        report.note(f"taken: {taken}")
        return report.summary()
    args.work.mkdir(parents=True, exist_ok=True)
    manifests = [doc for doc in yaml.safe_load_all(render_chart(args.helm, CPU_DEMO_VALUES)) if doc]
    hosts = hosts_file(manifests, args.work)
    if not build_image(report, args.base_image or make_base_image(), args.torch_wheels):
        return report.summary()
    # Each stage ends at its first error (a wait that timed out, a command that failed): reported, then the next.
    try:
        reference = serve_reference(report)
    except (RuntimeError, TimeoutError, OSError) as error:
        report.check(False, f"`tandem serve` in the image: {error}")
        return report.summary()
    stages = (
        (
            "the three services from the chart's commands",
            lambda: services_from_chart(report, manifests, reference, hosts),
        ),
        ("the chart played by podman kube play", lambda: play_chart(report, manifests, reference[0], hosts, args.work)),
    )
    for stage, run in stages:
        try:
            run()
        except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as error:
            report.check(False, f"{stage}: {error}")
    return report.summary()


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def make_base_image() -> str:
    if shutil.which("debootstrap") is None:
        raise SystemExit("debootstrap not found (apt-get install debootstrap), or give --base-image")
    script = ROOT / "scripts" / "make-base-image.sh"
    # debootstrap's progress goes to stderr, shown; the image's name comes on stdout.
    return subprocess.run(["bash", str(script)], stdout=subprocess.PIPE, text=True, check=True).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())

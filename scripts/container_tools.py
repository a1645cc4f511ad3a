"""What the container check (scripts/container_check.py) is made of: podman calls with this machine's settings, the
chart's rendered manifests and the commands in them, an HTTP client for the OpenAI API, and the report of what held.

Kept apart from the steps so that the unit tests (tests/unit/test_container_check.py) import the chart-reading part
without podman.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "tandem"
CPU_DEMO_VALUES = CHART / "ci" / "cpu-demo-values.yaml"
RELEASE = "rel"
NAMESPACE = "default"
COMPONENTS = ("target", "draft", "orchestrator")  # the order they start in; they stop in the reverse one

# The runtime and limits podman needs on these machines (docs/deploy.md, "Containers"): crun fails on the kernel's
# hybrid cgroups, and the default ulimits are refused.
RUNTIME = ("--runtime", "runc")
ULIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
# The request every stage serves: greedy, a fixed length, compared whole with `tandem serve`'s.
PROMPT = "def parse(text):"
SHORT_TOKENS = 24

Manifest = dict[str, Any]


def render_chart(helm: str, values: Path) -> str:
    """`helm template` of the chart with one values file, as the chart's tests render it."""
    command = [helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(values)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout


def workload_containers(manifests: Sequence[Manifest]) -> dict[str, Manifest]:
    """Each component's container spec (target, draft, orchestrator), from the rendered workloads' pod templates."""
    found: dict[str, Manifest] = {}
    for manifest in manifests:
        if manifest.get("kind") in ("Deployment", "StatefulSet"):
            component = manifest["metadata"]["labels"]["app.kubernetes.io/component"]
            [container] = manifest["spec"]["template"]["spec"]["containers"]
            found[component] = container
    return found


def expand_variables(argument: str, environment: dict[str, str]) -> str:
    """Kubernetes' `$(NAME)` expansion of a container argument: a defined variable is replaced, others stay."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: environment.get(m.group(1), m.group(0)), argument)


def container_environment(container: Manifest, pod_name: str) -> dict[str, str]:
    """The container's plain env values, and POD_NAME (a fieldRef to metadata.name) as the pod's name."""
    environment = {}
    for variable in container.get("env", []):
        if "value" in variable:
            environment[variable["name"]] = str(variable["value"])
        elif variable.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            environment[variable["name"]] = pod_name
    return environment


def service_hosts(manifests: Sequence[Manifest]) -> list[str]:
    """The host names the rendered commands reach peers by: each Service's short name and its cluster name."""
    names = []
    for manifest in manifests:
        if manifest.get("kind") == "Service":
            name = manifest["metadata"]["name"]
            names += [name, f"{name}.{NAMESPACE}.svc.cluster.local"]
    return names


def hosts_file(manifests: Sequence[Manifest], directory: Path) -> Path:
    """The Services' names on the loopback, as an /etc/hosts: with host networking every service listens there."""
    path = directory / "hosts"
    path.write_text("127.0.0.1 localhost\n" + "".join(f"127.0.0.1 {name}\n" for name in service_hosts(manifests)))
    path.chmod(0o644)
    return path


@dataclass
class Report:
    """Each check's outcome, printed as it is decided and again in the summary."""

    lines: list[tuple[bool, str]] = field(default_factory=list)

    def check(self, held: bool, what: str) -> bool:
        self.lines.append((held, what))
        print(f"[{'held' if held else 'FAILED'}] {what}", flush=True)
        return held

    def note(self, what: str) -> None:
        print(f"[note] {what}", flush=True)

    def summary(self) -> int:
        failed = [what for held, what in self.lines if not held]
        print(f"\n===== container check: {len(self.lines) - len(failed)} held, {len(failed)} failed =====")
        for held, what in self.lines:
            print(f"  {'held  ' if held else 'FAILED'} {what}")
        return 1 if failed else 0


def podman(*arguments: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    """One podman command with the machine's runtime; its output is returned, not printed."""
    command = ["podman", *RUNTIME, *arguments]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}: {result.stderr.strip()[-2000:]}")
    return result


def exit_code(container: str) -> int:
    return int(podman("inspect", "--format", "{{.State.ExitCode}}", container).stdout.strip())


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float, interval_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(interval_s)


def eventually(condition: Callable[[], bool], timeout_s: float, interval_s: float = 2.0) -> bool:
    """Whether `condition` holds within `timeout_s` (tried every `interval_s`)."""
    try:
        wait_until(condition, "condition", timeout_s, interval_s)
    except TimeoutError:
        return False
    return True


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@dataclass(frozen=True)
class Api:
    """The OpenAI-compatible API of an orchestrator, reached from outside the containers (host network)."""

    base: str  # http://127.0.0.1:8000

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        """A greedy completion of exactly `max_tokens` tokens (EOS ignored), so that outputs compare whole."""
        return {"model": self.model(), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

    def completion(self, prompt: str, max_tokens: int) -> str:
        answer = http_json(f"{self.base}/v1/completions", self.body(prompt, max_tokens))
        return str(answer["choices"][0]["text"])

    def model(self) -> str:
        return str(http_json(f"{self.base}/v1/models")["data"][0]["id"])

    def stream(self, prompt: str, max_tokens: int) -> Iterator[str]:
        """A greedy streamed completion: each chunk's text as it arrives (SSE)."""
        body = {**self.body(prompt, max_tokens), "stream": True}
        request = urllib.request.Request(
            f"{self.base}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as answer:
            for line in answer:
                text = line.decode().strip()
                if text.startswith("data: ") and text != "data: [DONE]":
                    yield from (choice["text"] for choice in json.loads(text[6:])["choices"])

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the orchestrator's Prometheus metrics (the sum where several match the labels)."""
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        total = 0.0
        for line in text.splitlines():
            named = line.startswith(name + "{") or line.startswith(name + " ")
            if named and all(f'{key}="{value}"' in line for key, value in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def ready(self) -> bool:
        return answers(f"{self.base}/health")


API = Api("http://127.0.0.1:8000")  # every orchestrator of the check serves HTTP on the chart's port


def log(what: str) -> None:
    print(f"--- {what}", file=sys.stderr, flush=True)

"""The chart's cpu-demo manifests played by `podman kube play` (scripts/container_check.py runs this part).

podman 4.3 plays Pods and Deployments. What it is given is the rendered chart, changed only where podman cannot
follow it (`for_podman` says each change, and the check prints them): every pod on the host network with the
Services' names in a hosts file (podman has no Services and no cluster DNS, and ignores hostAliases there) and no
declared container ports (podman refuses port mappings on the host network), the target's StatefulSet played as a
Deployment of the same pod template (podman plays no StatefulSet), and one orchestrator replica (two would share the
host's ports). The other kinds go to podman as rendered; the pods it makes show what it played.
"""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path

import yaml

from scripts.container_tools import (
    API,
    PROMPT,
    RELEASE,
    SHORT_TOKENS,
    Manifest,
    Report,
    eventually,
    log,
    podman,
    wait_until,
)

WORKLOADS = ("target", "draft", "orchestrator")
# What podman reads for `kube play`, where no flag sets them: the runtime and ulimits these machines need.
CONTAINERS_CONF = (
    '[containers]\ndefault_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]\n[engine]\nruntime = "runc"\n'
)


def for_podman(manifests: list[Manifest], hosts: Path) -> tuple[list[Manifest], list[str]]:
    """The rendered manifests as podman can play them, and one line per change made."""
    played, changes = [], []
    for manifest in manifests:
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        if kind not in ("Deployment", "StatefulSet"):
            played.append(manifest)
            continue
        workload = copy.deepcopy(manifest)
        if kind == "StatefulSet":
            workload["kind"] = "Deployment"
            workload["spec"] = {key: workload["spec"][key] for key in ("replicas", "selector", "template")}
            changes.append(f"StatefulSet {name}: played as a Deployment of the same pod template")
        if workload["spec"].get("replicas", 1) > 1:
            changes.append(f"{kind} {name}: 1 replica, not {workload['spec']['replicas']} (one host network)")
            workload["spec"]["replicas"] = 1
        pod = workload["spec"]["template"]["spec"]
        pod["hostNetwork"] = True
        pod["volumes"] = [*pod.get("volumes", []), {"name": "hosts", "hostPath": {"path": str(hosts), "type": "File"}}]
        for container in pod["containers"]:
            mount = {"name": "hosts", "mountPath": "/etc/hosts", "readOnly": True}
            container["volumeMounts"] = [*container.get("volumeMounts", []), mount]
            container.pop("ports", None)  # podman maps declared ports, which a host-network pod refuses
        changes.append(f"{kind} {name}: hostNetwork, the Services' names in /etc/hosts, no declared ports")
        played.append(workload)
    return played, changes


def kube(*arguments: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", "kube", *arguments], capture_output=True, text=True, timeout=timeout)


def pods() -> dict[str, str]:
    """The release's pods by component: podman names a Deployment's pods `<deployment>-pod-<index>`."""
    names = podman("pod", "ps", "--format", "{{.Name}}").stdout.split()
    found = {}
    for component in WORKLOADS:
        mine = [name for name in names if name.startswith(f"{RELEASE}-tandem-{component}-pod")]
        if mine:
            found[component] = mine[0]
    return found


def probe(pod: str, component: str, port: int) -> bool:
    """What the chart's gRPC probes ask (podman ignores them): grpc.health.v1 on the service's port, in the pod."""
    container = f"{pod}-{component}"
    command = ["exec", "--env", f"TANDEM_HEALTH_ADDRESS=127.0.0.1:{port}", container]
    return podman(*command, "python", "/opt/tandem/healthcheck.py", check=False, timeout=30).returncode == 0


def serving_drafts() -> float:
    return API.metric("tandem:draft_replicas", state="serving")


def play_chart(report: Report, manifests: list[Manifest], reference: str, hosts: Path, work: Path) -> None:
    conf = work / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    os.environ["CONTAINERS_CONF"] = str(conf)
    played, changes = for_podman(manifests, hosts)
    for change in changes:
        report.note(change)
    chart = work / "cpu-demo-podman.yaml"
    chart.write_text(yaml.safe_dump_all(played, sort_keys=False))
    draft = work / "draft-podman.yaml"
    draft.write_text(yaml.safe_dump_all([m for m in played if m["metadata"]["name"] == f"{RELEASE}-tandem-draft"]))
    volumes_before = set(podman("volume", "ls", "--format", "{{.Name}}").stdout.split())
    log(f"podman kube play {chart}")
    result = kube("play", str(chart))
    if not report.check(result.returncode == 0, "podman kube play accepts the rendered cpu-demo manifests"):
        print(result.stdout + result.stderr, flush=True)
        return
    try:
        played_pods(report, manifests)
        serve_through_pods(report, reference, draft)
    finally:
        kube("down", str(chart))
        remove_pods()
        # The emptyDir volumes podman made for the pods (named after them: tmp, shm), none that was there before.
        made = set(podman("volume", "ls", "--format", "{{.Name}}").stdout.split()) - volumes_before
        if made:
            podman("volume", "rm", "--force", *sorted(made), check=False)


def played_pods(report: Report, manifests: list[Manifest]) -> None:
    made = pods()
    rendered = sorted({manifest["kind"] for manifest in manifests})
    report.check(sorted(made) == sorted(WORKLOADS), f"one pod per workload: {', '.join(sorted(made.values()))}")
    report.note(f"rendered kinds {', '.join(rendered)}; pods made only for the workloads, the other kinds ignored")


def serve_through_pods(report: Report, reference: str, draft: Path) -> None:
    ports = {"target": 50061, "draft": 50062, "orchestrator": 50051}
    wait_until(API.ready, "the orchestrator pod's HTTP API", timeout_s=300, interval_s=2)
    wait_until(lambda: serving_drafts() == 1, "the draft pod joins", timeout_s=180, interval_s=2)
    made = pods()
    for component in WORKLOADS:
        report.check(probe(made[component], component, ports[component]), f"the {component} pod's gRPC health answers")
    report.check(API.completion(PROMPT, SHORT_TOKENS) == reference, "through the pods: equal to `tandem serve`'s")
    remove_and_add_draft(report, reference, made["draft"], draft)
    restart_orchestrator(report, reference, made["orchestrator"])


def remove_and_add_draft(report: Report, reference: str, pod: str, draft: Path) -> None:
    """The draft pod removed: requests go on target-only; played again: the new pod drafts."""
    failures = API.metric("tandem:replica_failures_total")
    podman("pod", "rm", "--force", "--time", "60", pod, timeout=120)
    # The orchestrator learns of the loss on the replica's next use (DNS still names the loopback address).
    report.check(API.completion(PROMPT, SHORT_TOKENS) == reference, "draft pod removed: a request served, equal")
    out_of_service = eventually(lambda: serving_drafts() == 0, timeout_s=60)
    lost = API.metric("tandem:replica_failures_total") - failures
    report.check(out_of_service and lost >= 1, f"the orchestrator took the lost replica out ({lost:.0f} failures)")
    result = kube("play", str(draft))
    report.check(result.returncode == 0, "the draft Deployment played again")
    rejoined = eventually(lambda: serving_drafts() == 1, timeout_s=180)
    report.check(rejoined, "the new draft pod serves the orchestrator again")
    report.check(API.completion(PROMPT, SHORT_TOKENS) == reference, "draft pod added back: a request served, equal")


def restart_orchestrator(report: Report, reference: str, pod: str) -> None:
    """The orchestrator pod stopped with SIGTERM and started again: it exits 0, comes back, finds target and draft,
    and serves. podman gives a container 10 s whatever terminationGracePeriodSeconds says: the 60 s are explicit."""
    podman("pod", "stop", "--time", "60", pod, timeout=120)
    stopped = podman("inspect", "--format", "{{.State.ExitCode}}", f"{pod}-orchestrator").stdout.strip()
    report.check(stopped == "0", "the orchestrator pod stopped with SIGTERM: its container exits 0")
    podman("pod", "start", pod)
    wait_until(API.ready, "the restarted orchestrator pod's HTTP API", timeout_s=300, interval_s=2)
    report.check(eventually(lambda: serving_drafts() == 1, timeout_s=180), "the draft joins the restarted orchestrator")
    report.check(API.completion(PROMPT, SHORT_TOKENS) == reference, "orchestrator pod restarted: served, equal")


def remove_pods() -> None:
    """Every pod of the release, whatever `kube down` left (it stops at a pod already gone)."""
    for name in podman("pod", "ps", "--format", "{{.Name}}").stdout.split():
        if name.startswith(f"{RELEASE}-tandem-"):
            podman("pod", "rm", "--force", "--time", "10", name, timeout=60, check=False)

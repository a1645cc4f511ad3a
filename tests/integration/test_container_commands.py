"""The cheap half of scripts/container-check.sh, run by CI (the check itself builds an image and takes minutes):
the commands it takes from the rendered chart parse with Tandem's own CLI, the Service names they reach peers by are
the ones the check puts in /etc/hosts, and the manifests it hands `podman kube play` differ from the rendered ones
only where podman cannot follow them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from launch.cli import build_parser
from scripts.container_kube import for_podman
from scripts.container_tools import (
    COMPONENTS,
    CPU_DEMO_VALUES,
    Manifest,
    container_environment,
    expand_variables,
    hosts_file,
    render_chart,
    workload_containers,
)
from tests.helpers.helm import find_helm


@pytest.fixture(scope="module")
def manifests() -> list[Manifest]:
    helm = find_helm()
    if helm is None:
        pytest.skip("helm not found: run scripts/get-helm.sh (it puts helm at .cache/helm/helm; .ci/run does)")
    return [document for document in yaml.safe_load_all(render_chart(helm, CPU_DEMO_VALUES)) if document]


def commands(manifests: list[Manifest]) -> dict[str, list[str]]:
    """Each component's arguments as the check runs them (POD_NAME expanded as Kubernetes would)."""
    found = {}
    for component, container in workload_containers(manifests).items():
        environment = container_environment(container, pod_name=f"check-{component}")
        found[component] = [expand_variables(argument, environment) for argument in container["args"]]
    return found


def test_the_rendered_commands_parse_with_the_cli(manifests: list[Manifest]) -> None:
    parsed = {component: build_parser().parse_args(args) for component, args in commands(manifests).items()}
    assert sorted(parsed) == sorted(COMPONENTS)
    assert all(arguments.command == component for component, arguments in parsed.items())
    assert parsed["draft"].replica_id == "check-draft"  # $(POD_NAME), which podman run does not expand itself
    # The demo pair the image bundles, on the chart's ports: what the check's health checks and requests reach.
    assert (parsed["target"].model, parsed["draft"].model) == (
        Path("/opt/tandem/demo/target"),
        Path("/opt/tandem/demo/eagle3"),
    )
    assert (parsed["target"].port, parsed["draft"].port, parsed["orchestrator"].http_port) == (50061, 50062, 8000)


def test_every_peer_name_in_the_commands_is_in_the_hosts_file(manifests: list[Manifest], tmp_path: Path) -> None:
    hosts = hosts_file(manifests, tmp_path).read_text().split()
    reached = [
        argument.split("=", 1)[1].rsplit(":", 1)[0]
        for args in commands(manifests).values()
        for argument in args
        if argument.startswith(("--target-address=", "--draft-dns="))
    ]
    assert reached and all(name in hosts for name in reached)


def test_expansion_follows_kubernetes() -> None:
    environment = {"POD_NAME": "draft-0"}
    assert expand_variables("--replica-id=$(POD_NAME)", environment) == "--replica-id=draft-0"
    assert expand_variables("$(UNSET) $POD_NAME", environment) == "$(UNSET) $POD_NAME"  # left as Kubernetes leaves them


def test_podman_gets_the_rendered_manifests_changed_only_where_it_cannot_follow(
    manifests: list[Manifest], tmp_path: Path
) -> None:
    hosts = tmp_path / "hosts"
    played, changes = for_podman(manifests, hosts)
    rendered_kinds = sorted(manifest["kind"] for manifest in manifests)
    assert sorted(manifest["kind"] for manifest in played) == sorted(
        "Deployment" if kind == "StatefulSet" else kind for kind in rendered_kinds
    )
    assert {manifest["kind"] for manifest in manifests if manifest["kind"] not in ("Deployment", "StatefulSet")} == {
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Service",
        "ServiceAccount",
    }
    rendered = workload_containers(manifests)
    for workload in (manifest for manifest in played if manifest["kind"] == "Deployment"):
        assert workload["spec"]["replicas"] == 1
        pod = workload["spec"]["template"]["spec"]
        assert pod["hostNetwork"] is True
        assert {"name": "hosts", "hostPath": {"path": str(hosts), "type": "File"}} in pod["volumes"]
        [container] = pod["containers"]
        assert {"name": "hosts", "mountPath": "/etc/hosts", "readOnly": True} in container["volumeMounts"]
        assert "ports" not in container  # podman refuses port mappings on the host network
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        assert container["args"] == rendered[component]["args"]  # the commands themselves are never changed
    assert any("StatefulSet" in change for change in changes)
    assert all(manifest["kind"] != "StatefulSet" for manifest in played)

"""The Helm chart deploy/helm/tandem, checked without a cluster: helm lint and helm template with several value sets,
the rendered manifests validated against Kubernetes' schemas (kubernetes-validate, strict), and their structure."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPOSITORY = Path(__file__).resolve().parents[2]
CHART = REPOSITORY / "deploy" / "helm" / "tandem"
KUBERNETES_VERSION = "1.34.0"
NAMESPACE = "ml"
RELEASE = "rel"
PREFIX = f"{RELEASE}-tandem"

Manifest = dict[str, Any]

VALUE_SETS: dict[str, list[str]] = {
    "defaults": [],
    "hpa": ["--set", "draft.autoscaling.enabled=true"],
    "ingress": ["--set", "orchestrator.ingress.enabled=true"],
    "tls": ["--set", "tls.enabled=true", "--set", "tls.existingSecret=tandem-tls"],
    "gpu-off": ["--set", "target.gpu.enabled=false"],
    **{path.stem: ["-f", str(path)] for path in sorted((CHART / "ci").glob("*-values.yaml"))},
}


def find_helm() -> str | None:
    for candidate in (os.environ.get("TANDEM_HELM"), str(REPOSITORY / ".cache" / "helm" / "helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("helm")


@pytest.fixture(scope="module")
def helm() -> str:
    found = find_helm()
    if found is None:
        pytest.skip("helm not found: run scripts/get-helm.sh (it puts helm at .cache/helm/helm; .ci/run does)")
    return found


def run_helm(helm: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *arguments], capture_output=True, text=True, timeout=120)


def render(helm: str, values: list[str]) -> list[Manifest]:
    result = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values)
    assert result.returncode == 0, result.stderr
    return [document for document in yaml.safe_load_all(result.stdout) if document]


def find(manifests: list[Manifest], kind: str, name: str) -> Manifest:
    found = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def container(workload: Manifest) -> Manifest:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    result: Manifest = containers[0]
    return result


def workloads(manifests: list[Manifest]) -> list[Manifest]:
    return [m for m in manifests if m["kind"] in ("Deployment", "StatefulSet")]


def argument(args: list[str], flag: str) -> str:
    values = [arg.removeprefix(f"{flag}=") for arg in args if arg.startswith(f"{flag}=")]
    assert len(values) == 1, f"expected one {flag} in {args}"
    return values[0]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_lint_strict(helm: str, value_set: str) -> None:
    result = run_helm(helm, "lint", "--strict", str(CHART), *VALUE_SETS[value_set])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_rendered_manifests_are_valid_kubernetes(helm: str, value_set: str) -> None:
    manifests = render(helm, VALUE_SETS[value_set])
    assert {"StatefulSet", "Deployment", "Service"} <= {m["kind"] for m in manifests}
    for manifest in manifests:
        if manifest["kind"] == "ServiceMonitor":
            # A Prometheus Operator CRD: not in Kubernetes' own schemas.
            assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def test_the_orchestrator_follows_the_draft_headless_service(helm: str) -> None:
    manifests = render(helm, [])
    args = container(find(manifests, "Deployment", f"{PREFIX}-orchestrator"))["args"]
    assert "--draft-address" not in " ".join(args)
    host, _, port = argument(args, "--draft-dns").rpartition(":")
    service_name, namespace, *_ = host.split(".")
    assert (namespace, host) == (NAMESPACE, f"{service_name}.{NAMESPACE}.svc.cluster.local")
    headless = find(manifests, "Service", service_name)
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"].get("publishNotReadyAddresses", False) is False
    draft = find(manifests, "Deployment", f"{PREFIX}-draft")
    pod_labels = draft["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= pod_labels.items()
    for other in workloads(manifests):
        if other is not draft:
            assert not headless["spec"]["selector"].items() <= other["spec"]["template"]["metadata"]["labels"].items()
    [service_port] = headless["spec"]["ports"]
    [container_port] = container(draft)["ports"]
    assert int(port) == service_port["port"] == container_port["containerPort"]
    # Each draft pod names itself after its pod, and every service reaches the target through its Service.
    draft_args = container(draft)["args"]
    assert argument(draft_args, "--replica-id") == "$(POD_NAME)"
    target_service = find(manifests, "Service", f"{PREFIX}-target")
    target_address = f"{PREFIX}-target:{target_service['spec']['ports'][0]['port']}"
    assert argument(draft_args, "--target-address") == argument(args, "--target-address") == target_address


@pytest.mark.parametrize("value_set", ["defaults", "tls"])
def test_probes_check_each_service_port(helm: str, value_set: str) -> None:
    tls = value_set == "tls"
    manifests = render(helm, VALUE_SETS[value_set])
    assert len(workloads(manifests)) == 3
    for workload in workloads(manifests):
        spec = container(workload)
        [grpc_port] = [p["containerPort"] for p in spec["ports"] if p["name"] == "grpc"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            # kubelet's gRPC probe speaks plaintext only: with TLS on, the port is checked for connections.
            handler = "tcpSocket" if tls else "grpc"
            assert spec[probe][handler] == {"port": grpc_port}, (workload["metadata"]["name"], probe)
            assert "grpc" not in spec[probe] or not tls
        assert ("--tls-ca=/etc/tandem/tls/ca.crt" in spec["args"]) == tls


def test_the_target_startup_probe_allows_minutes_of_loading(helm: str) -> None:
    probe = container(find(render(helm, []), "StatefulSet", f"{PREFIX}-target"))["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 20 * 60


@pytest.mark.parametrize(("value_set", "gpus"), [("defaults", 1), ("gpu-tp2-values", 2), ("gpu-off", None)])
def test_only_the_target_requests_gpus(helm: str, value_set: str, gpus: int | None) -> None:
    manifests = render(helm, VALUE_SETS[value_set])
    for workload in workloads(manifests):
        limits = container(workload)["resources"].get("limits", {})
        expected = gpus if workload["kind"] == "StatefulSet" else None
        assert limits.get("nvidia.com/gpu") == expected, workload["metadata"]["name"]


def test_the_hpa_scales_the_draft_deployment(helm: str) -> None:
    manifests = render(helm, VALUE_SETS["hpa"])
    [hpa] = [m for m in manifests if m["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{PREFIX}-draft"}
    # The HPA owns the replica count.
    assert "replicas" not in find(manifests, "Deployment", f"{PREFIX}-draft")["spec"]
    assert not [m for m in render(helm, []) if m["kind"] == "HorizontalPodAutoscaler"]


def test_secrets_are_referenced_never_rendered(helm: str) -> None:
    manifests = render(helm, VALUE_SETS["tls-values"])
    assert not [m for m in manifests if m["kind"] == "Secret"]
    orchestrator = container(find(manifests, "Deployment", f"{PREFIX}-orchestrator"))
    [api_key] = [e for e in orchestrator["env"] if e["name"] == "TANDEM_API_KEY"]
    assert api_key == {
        "name": "TANDEM_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "tandem-api-key", "key": "api-key"}},
    }
    assert not any(arg.startswith("--api-key") for arg in orchestrator["args"])
    for workload in workloads(manifests):
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "tandem-tls"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["--set", "apiKey.enabled=true"], "apiKey.existingSecret: the Secret holding the API key is required"),
        (["--set", "tls.enabled=true"], "tls.existingSecret: the Secret with tls.crt, tls.key and ca.crt is required"),
        (["--set", "target.tp=two"], "target.tp: Invalid type. Expected: integer, given: string"),
        (["--set", "target.prot=50061"], "Additional property prot is not allowed"),
        (["--set", "models.source=s3"], "models.source"),
        (
            ["--set", "orchestrator.serviceMonitor.enabled=true"],
            "orchestrator.serviceMonitor.enabled needs orchestrator.http.enabled",
        ),
    ],
)
def test_wrong_values_are_refused_naming_the_value(helm: str, values: list[str], message: str) -> None:
    result = run_helm(helm, "template", RELEASE, str(CHART), *values)
    assert result.returncode != 0
    assert message in result.stderr


def test_pods_run_unprivileged_on_a_read_only_root(helm: str) -> None:
    for workload in workloads(render(helm, [])):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        security = container(workload)["securityContext"]
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}


def test_network_policies_admit_only_the_orchestrator_and_the_drafts(helm: str) -> None:
    manifests = render(helm, [])
    policies = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "NetworkPolicy"}
    assert set(policies) == {f"{PREFIX}-target", f"{PREFIX}-draft"}

    def admitted(policy: Manifest) -> list[str]:
        [rule] = policy["spec"]["ingress"]
        return [peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in rule["from"]]

    assert admitted(policies[f"{PREFIX}-target"]) == ["orchestrator", "draft"]
    assert admitted(policies[f"{PREFIX}-draft"]) == ["orchestrator"]

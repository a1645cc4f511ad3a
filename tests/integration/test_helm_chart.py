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
    "metrics": [
        *("--set", "orchestrator.http.enabled=true", "--set", "orchestrator.serviceMonitor.enabled=true"),
        *("--set", "target.metrics.enabled=true", "--set", "target.serviceMonitor.enabled=true"),
        *("--set", "draft.metrics.enabled=true", "--set", "draft.serviceMonitor.enabled=true"),
    ],
    "ray-cpu": ["--set", "mode=ray", "--set", "target.gpu.enabled=false", "--set", "target.tp=2"],
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


def ray_pod_templates(cluster: Manifest) -> list[Manifest]:
    """The head's pod template, then each worker group's."""
    spec = cluster["spec"]
    return [spec["headGroupSpec"]["template"], *(group["template"] for group in spec["workerGroupSpecs"])]


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
    kinds = {m["kind"] for m in manifests}
    if value_set.startswith("ray"):
        assert "RayCluster" in kinds and not kinds & {"StatefulSet", "Deployment", "NetworkPolicy"}
    else:
        assert {"StatefulSet", "Deployment", "Service"} <= kinds and "RayCluster" not in kinds
    for manifest in manifests:
        if manifest["kind"] == "ServiceMonitor":
            # A Prometheus Operator CRD: not in Kubernetes' own schemas.
            assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        if manifest["kind"] == "RayCluster":
            # A KubeRay CRD: kubernetes-validate knows Kubernetes' own kinds only, so its structure is checked by
            # test_ray_mode_renders_one_raycluster; its pod templates are validated here as Kubernetes pod specs.
            assert manifest["apiVersion"] == "ray.io/v1"
            for pod in ray_pod_templates(manifest):
                kubernetes_validate.validate(
                    {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "ray"}, "template": pod},
                    KUBERNETES_VERSION,
                    strict=True,
                )
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
        (["--set", "mode=cloud"], 'mode must be one of the following: "services", "ray"'),
        (
            ["--set", "mode=ray", "--set", "tls.enabled=true", "--set", "tls.existingSecret=tandem-tls"],
            "mode ray: tls.enabled is not available with `tandem serve --launcher ray` yet",
        ),
        (
            ["--set", "mode=ray", "--set", "ray.draftReplicas=5"],
            "ray.draftReplicas 5 needs 3 Ray CPUs (half each), but the draft group offers",
        ),
        (["--set", "target.serviceMonitor.enabled=true"], "target.serviceMonitor.enabled needs target.metrics.enabled"),
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


def head_command(cluster: Manifest) -> list[str]:
    """The words of the head's shell command (`ray start ... && exec tandem serve ...`)."""
    [head] = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert head["command"] == ["/bin/sh", "-c"]
    [script] = head["args"]
    words: list[str] = script.split()
    return words


def test_ray_mode_renders_one_raycluster(helm: str) -> None:
    manifests = render(helm, VALUE_SETS["ray-values"])
    [cluster] = [m for m in manifests if m["kind"] == "RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1"
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    words = head_command(cluster)
    ray_start, serve = " ".join(words).split(" && exec ")
    assert ray_start.split()[:3] == ["ray", "start", "--head"]
    assert argument(ray_start.split(), "--num-cpus") == "0"  # only the orchestrator (no Ray CPU) runs on the head
    serve_args = serve.split()
    assert serve_args[:3] == ["tandem", "serve", "--launcher=ray"]
    assert argument(serve_args, "--ray-address") == f"127.0.0.1:{argument(ray_start.split(), '--port')}"
    assert argument(serve_args, "--tp") == "2"
    assert argument(serve_args, "--draft-replicas") == "4"
    assert argument(serve_args, "--device") == "cpu"  # what --launcher ray places today
    assert argument(serve_args, "--http-port") == "8000"
    groups = {group["groupName"]: group for group in cluster["spec"]["workerGroupSpecs"]}
    assert list(groups) == ["target", "draft"]
    head_service = f"{PREFIX}-head-svc.{NAMESPACE}.svc.cluster.local:6379"
    gpus: dict[str, object] = {}
    worker_cpus: dict[str, str] = {}
    for name, group in groups.items():
        [worker] = group["template"]["spec"]["containers"]
        [script] = worker["args"]
        worker_args = script.split()
        assert worker_args[:3] == ["exec", "ray", "start"] and "--block" in worker_args
        assert argument(worker_args, "--address") == head_service
        worker_cpus[name] = argument(worker_args, "--num-cpus")
        gpus[name] = worker["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert argument(worker_args, "--num-gpus") == str(gpus[name] or 0)
    # The target's two ranks take a GPU each on the target group; the drafts' CPUs are on the draft group only.
    assert gpus == {"target": 2, "draft": None}
    assert worker_cpus == {"target": "0", "draft": "1"}
    assert groups["draft"]["replicas"] == 2
    # One image everywhere, the models mounted at the same path in every pod (an actor may land on any pod).
    pods = ray_pod_templates(cluster)
    images = {container["image"] for pod in pods for container in pod["spec"]["containers"]}
    assert images == {"tandem:0.1.0"}
    for pod in pods:
        [spec] = pod["spec"]["containers"]
        mounts = {mount["name"]: mount["mountPath"] for mount in spec["volumeMounts"]}
        assert mounts["models"] == "/models" and mounts["shm"] == "/dev/shm"
        assert spec["securityContext"]["readOnlyRootFilesystem"] is True
    [head] = pods[0]["spec"]["containers"]
    assert head["readinessProbe"]["grpc"] == {"port": 50051}
    assert "limits" not in head["resources"] or "nvidia.com/gpu" not in head["resources"]["limits"]


def test_ray_mode_on_cpus_gives_the_target_group_a_cpu_per_rank(helm: str) -> None:
    [cluster] = [m for m in render(helm, VALUE_SETS["ray-cpu"]) if m["kind"] == "RayCluster"]
    [target_group, _] = cluster["spec"]["workerGroupSpecs"]
    [worker] = target_group["template"]["spec"]["containers"]
    worker_args = worker["args"][0].split()
    assert (argument(worker_args, "--num-cpus"), argument(worker_args, "--num-gpus")) == ("2", "0")
    assert "nvidia.com/gpu" not in worker["resources"].get("limits", {})


def test_service_monitors_scrape_each_metrics_port(helm: str) -> None:
    assert not [m for m in render(helm, []) if m["kind"] == "ServiceMonitor"]
    manifests = render(helm, VALUE_SETS["metrics"])
    monitors = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "ServiceMonitor"}
    services = {
        "target": find(manifests, "Service", f"{PREFIX}-target"),
        "draft": find(manifests, "Service", f"{PREFIX}-draft-headless"),
        "orchestrator": find(manifests, "Service", f"{PREFIX}-orchestrator"),
    }
    assert set(monitors) == {f"{PREFIX}-{component}" for component in services}
    for component, service in services.items():
        monitor = monitors[f"{PREFIX}-{component}"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        [endpoint] = monitor["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics" and endpoint["scheme"] == "http"
        [port] = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        workload = next(w for w in workloads(manifests) if w["metadata"]["name"] == f"{PREFIX}-{component}")
        spec = container(workload)
        [container_port] = [p["containerPort"] for p in spec["ports"] if p["name"] == port["targetPort"]]
        flag = "--http-port" if component == "orchestrator" else "--metrics-port"
        assert int(argument(spec["args"], flag)) == container_port == port["port"]
    # The NetworkPolicies let the scraper reach the metrics ports, and only those besides the services' own.
    target_policy = find(manifests, "NetworkPolicy", f"{PREFIX}-target")
    assert [rule["ports"][0]["port"] for rule in target_policy["spec"]["ingress"]] == [50061, 9400]
    assert "from" not in target_policy["spec"]["ingress"][1]


@pytest.mark.parametrize("value_set", ["defaults", "tls"])
def test_with_tls_draft_certificates_are_checked_for_the_headless_service_name(helm: str, value_set: str) -> None:
    args = container(find(render(helm, VALUE_SETS[value_set]), "Deployment", f"{PREFIX}-orchestrator"))["args"]
    if value_set == "defaults":
        assert not any(arg.startswith("--tls-server-name") for arg in args)
        return
    # Discovery dials the addresses the headless Service resolves to (pod IPs); their certificate names the Service.
    headless_host = argument(args, "--draft-dns").split(".")[0]
    assert argument(args, "--tls-server-name") == headless_host == f"{PREFIX}-draft-headless"

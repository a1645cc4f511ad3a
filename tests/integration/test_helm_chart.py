"""The Helm chart deploy/helm/tandem, checked without a cluster: helm lint and helm template with several value sets,
the rendered manifests validated against Kubernetes' schemas (kubernetes-validate, strict), and their structure."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.helpers.helm import find_helm

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
        assert {"RayCluster", "NetworkPolicy"} <= kinds and not kinds & {"StatefulSet", "Deployment"}
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
            # Liveness asks for tandem.v1.Liveness: SERVING while the server answers, whatever its peers do.
            handler = "tcpSocket" if tls else "grpc"
            service = {"service": "tandem.v1.Liveness"} if probe == "livenessProbe" and not tls else {}
            assert spec[probe][handler] == {"port": grpc_port, **service}, (workload["metadata"]["name"], probe)
            assert "grpc" not in spec[probe] or not tls
        assert ("--tls-ca=/etc/tandem/tls/ca.crt" in spec["args"]) == tls


def test_the_target_pod_holds_every_tp_rank_with_the_model_volume(helm: str) -> None:
    manifests = render(helm, VALUE_SETS["gpu-tp2-values"])
    target = find(manifests, "StatefulSet", f"{PREFIX}-target")
    assert target["spec"]["replicas"] == 1  # one pod: rank 0 starts the other ranks beside it
    spec = container(target)
    assert argument(spec["args"], "--tp") == "2"
    assert spec["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert argument(spec["args"], "--model") == "/models/Llama-3.1-8B-Instruct"
    mounts = {mount["name"]: mount for mount in spec["volumeMounts"]}
    assert mounts["models"] == {"name": "models", "mountPath": "/models", "readOnly": True}
    assert mounts["shm"]["mountPath"] == "/dev/shm"  # the ranks' shared memory
    volumes = {volume["name"]: volume for volume in target["spec"]["template"]["spec"]["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "llama-models", "readOnly": True}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"


def test_each_block_configures_its_own_pods(helm: str, tmp_path: Path) -> None:
    blocks = {"target": "StatefulSet", "draft": "Deployment", "orchestrator": "Deployment"}
    values = {
        component: {
            "nodeSelector": {"pool": component},
            "tolerations": [{"key": component, "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "zone", "operator": "In", "values": [component]}]}
                        ]
                    }
                }
            },
            "extraEnv": [{"name": "EXTRA", "value": component}],
            "extraArgs": [f"--orphan-timeout={len(component)}"] if component != "orchestrator" else ["--max-waiting=7"],
            "resources": {"requests": {"cpu": "3", "memory": f"{len(component)}Gi"}},
        }
        for component in blocks
    }
    path = tmp_path / "blocks.yaml"
    path.write_text(yaml.safe_dump(values))
    manifests = render(helm, ["-f", str(path)])
    for component, kind in blocks.items():
        workload = find(manifests, kind, f"{PREFIX}-{component}")
        pod = workload["spec"]["template"]["spec"]
        spec = container(workload)
        assert pod["nodeSelector"] == values[component]["nodeSelector"]
        assert pod["tolerations"] == values[component]["tolerations"]
        assert pod["affinity"] == values[component]["affinity"]
        assert {"name": "EXTRA", "value": component} in spec["env"]
        assert spec["args"][-1] == values[component]["extraArgs"][0]
        assert spec["resources"]["requests"] == values[component]["resources"]["requests"]


def test_the_disruption_budget_covers_the_drafts_and_the_ingress_the_orchestrator(helm: str) -> None:
    manifests = render(helm, VALUE_SETS["ingress"])
    [budget] = [m for m in manifests if m["kind"] == "PodDisruptionBudget"]
    draft_labels = find(manifests, "Deployment", f"{PREFIX}-draft")["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= draft_labels.items()
    assert budget["spec"]["maxUnavailable"] == 1
    for workload in workloads(manifests):
        if workload["metadata"]["name"] != f"{PREFIX}-draft":
            labels = workload["spec"]["template"]["metadata"]["labels"]
            assert not budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    [ingress] = [m for m in manifests if m["kind"] == "Ingress"]
    backends = [path["backend"]["service"] for rule in ingress["spec"]["rules"] for path in rule["http"]["paths"]]
    assert backends == [{"name": f"{PREFIX}-orchestrator", "port": {"name": "grpc"}}]
    # Only the orchestrator's Service is meant to be reached from outside: the others are headless.
    services = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "Service"}
    assert {name for name, service in services.items() if service["spec"].get("clusterIP") != "None"} == {
        f"{PREFIX}-orchestrator"
    }


def test_the_orchestrator_waits_out_a_target_restart_and_every_service_gets_the_keepalive(helm: str) -> None:
    manifests = render(helm, [])
    target = container(find(manifests, "StatefulSet", f"{PREFIX}-target"))
    orchestrator = container(find(manifests, "Deployment", f"{PREFIX}-orchestrator"))
    draft = container(find(manifests, "Deployment", f"{PREFIX}-draft"))
    # A hung target is restarted once its liveness fails; requests wait for the new one past that, and longer.
    liveness = target["livenessProbe"]
    assert (
        float(argument(orchestrator["args"], "--target-wait"))
        >= 2 * liveness["periodSeconds"] * liveness["failureThreshold"]
    )
    for spec in (target, orchestrator, draft):
        assert argument(spec["args"], "--keepalive-timeout") == "10"
    ray = [*VALUE_SETS["ray-values"], "--set", "keepaliveTimeout=4", "--set", "orchestrator.targetWait=90"]
    [cluster] = [m for m in render(helm, ray) if m["kind"] == "RayCluster"]
    assert {"--target-wait=90", "--keepalive-timeout=4"} <= set(head_command(cluster))


def test_the_orchestrator_pod_lives_until_its_streams_drained(helm: str) -> None:
    values = render(
        helm, ["--set", "orchestrator.shutdownTimeout=45", "--set", "orchestrator.terminationGracePeriodSeconds=70"]
    )
    deployment = find(values, "Deployment", f"{PREFIX}-orchestrator")
    # Two behind one Service: a rolling update (at most 25 % unavailable: none of 2) keeps one serving.
    assert deployment["spec"]["replicas"] == 2 and "strategy" not in deployment["spec"]
    service = find(values, "Service", f"{PREFIX}-orchestrator")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    orchestrator = container(deployment)
    assert argument(orchestrator["args"], "--shutdown-timeout") == "45"
    pre_stop = orchestrator["lifecycle"]["preStop"]["exec"]["command"]
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert pre_stop[0] == "sleep" and int(pre_stop[1]) + 45 < grace == 70
    ray = [*VALUE_SETS["ray-values"], "--set", "orchestrator.shutdownTimeout=20"]
    [cluster] = [m for m in render(helm, ray) if m["kind"] == "RayCluster"]
    assert "--shutdown-timeout=20" in head_command(cluster)
    assert cluster["spec"]["headGroupSpec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 60


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
            ["--set", "mode=ray", "--set", "tls.enabled=true"],
            "tls.existingSecret: the Secret with tls.crt, tls.key and ca.crt is required",
        ),
        (
            ["--set", "mode=ray", "--set", "ray.draftReplicas=5"],
            "ray.draftReplicas 5 needs 3 Ray CPUs (half each), but the draft group offers",
        ),
        (["--set", "target.serviceMonitor.enabled=true"], "target.serviceMonitor.enabled needs target.metrics.enabled"),
        (
            ["--set", "orchestrator.shutdownTimeout=60"],
            "orchestrator.terminationGracePeriodSeconds: 60 is less than preStopSleepSeconds + shutdownTimeout + 10",
        ),
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


def test_ray_mode_with_tls_hands_the_head_the_certificates_and_names_its_service(helm: str) -> None:
    manifests = render(helm, VALUE_SETS["ray-tls-values"])
    assert not [m for m in manifests if m["kind"] == "Secret"]
    [cluster] = [m for m in manifests if m["kind"] == "RayCluster"]
    serve = " ".join(head_command(cluster)).split(" && exec ")[1].split()
    assert argument(serve, "--tls-cert") == "/etc/tandem/tls/tls.crt"
    assert argument(serve, "--tls-key") == "/etc/tandem/tls/tls.key"
    assert argument(serve, "--tls-ca") == "/etc/tandem/tls/ca.crt"
    # The actors bind pod addresses: certificates are checked for KubeRay's head Service, which clients dial too.
    head_service = f"{PREFIX}-head-svc"
    assert argument(serve, "--tls-server-name") == head_service
    workers = [group["template"]["spec"]["containers"][0] for group in cluster["spec"]["workerGroupSpecs"]]
    assert head_service in {argument(worker["args"][0].split(), "--address").split(".")[0] for worker in workers}
    [head_pod, *worker_pods] = ray_pod_templates(cluster)
    [head] = head_pod["spec"]["containers"]
    volumes = {volume["name"]: volume for volume in head_pod["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "tandem-tls"
    assert {"name": "tls", "mountPath": "/etc/tandem/tls", "readOnly": True} in head["volumeMounts"]
    # Only the head reads the files: the actors on the workers get the certificates from it, as bytes.
    for pod in worker_pods:
        assert "tls" not in {volume["name"] for volume in pod["spec"]["volumes"]}
    # kubelet's gRPC probe cannot speak TLS.
    for probe in ("startupProbe", "readinessProbe"):
        assert head[probe]["tcpSocket"] == {"port": 50051} and "grpc" not in head[probe]
    [api_key] = [variable for variable in head["env"] if variable["name"] == "TANDEM_API_KEY"]
    assert api_key["valueFrom"] == {"secretKeyRef": {"name": "tandem-api-key", "key": "api-key"}}


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


def test_with_tls_the_http_port_is_scraped_over_https(helm: str) -> None:
    # With --tls-cert the orchestrator's HTTP port (the HTTP API and /metrics) serves HTTPS with the public port's
    # certificate and asks for no client certificate; the target's and drafts' --metrics-port stay plain HTTP.
    manifests = render(helm, [*VALUE_SETS["metrics"], *VALUE_SETS["tls"]])
    monitors = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "ServiceMonitor"}
    orchestrator_service = find(manifests, "Service", f"{PREFIX}-orchestrator")
    [endpoint] = monitors.pop(f"{PREFIX}-orchestrator")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {
        "ca": {"secret": {"name": "tandem-tls", "key": "ca.crt"}},
        "serverName": orchestrator_service["metadata"]["name"],
    }
    [http_port] = [p for p in orchestrator_service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert http_port["appProtocol"] == "https"
    args = container(find(manifests, "Deployment", f"{PREFIX}-orchestrator"))["args"]
    assert argument(args, "--tls-cert") == "/etc/tandem/tls/tls.crt" and "--public-plaintext" not in args
    assert argument(args, "--http-port") == str(http_port["port"])
    assert set(monitors) == {f"{PREFIX}-target", f"{PREFIX}-draft"}
    for monitor in monitors.values():
        [endpoint] = monitor["spec"]["endpoints"]
        assert endpoint["scheme"] == "http" and "tlsConfig" not in endpoint
    # Without TLS, plain HTTP everywhere.
    plain = [m for m in render(helm, VALUE_SETS["metrics"]) if m["kind"] == "ServiceMonitor"]
    assert {e["scheme"] for m in plain for e in m["spec"]["endpoints"]} == {"http"}
    assert not any("tlsConfig" in e for m in plain for e in m["spec"]["endpoints"])


@pytest.mark.parametrize("value_set", ["defaults", "tls"])
def test_with_tls_draft_certificates_are_checked_for_the_headless_service_name(helm: str, value_set: str) -> None:
    args = container(find(render(helm, VALUE_SETS[value_set]), "Deployment", f"{PREFIX}-orchestrator"))["args"]
    if value_set == "defaults":
        assert not any(arg.startswith("--tls-server-name") for arg in args)
        return
    # Discovery dials the addresses the headless Service resolves to (pod IPs); their certificate names the Service.
    headless_host = argument(args, "--draft-dns").split(".")[0]
    assert argument(args, "--tls-server-name") == headless_host == f"{PREFIX}-draft-headless"


def selects(selector: Manifest, labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions) selects a pod with `labels`."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        matches = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not matches:
            return False
    return True


def ingress_rules(policies: list[Manifest], labels: dict[str, str]) -> list[Manifest]:
    """The ingress rules that admit traffic to a pod with `labels` (empty: the pod is not isolated)."""
    return [
        rule
        for policy in policies
        if "Ingress" in policy["spec"]["policyTypes"] and selects(policy["spec"]["podSelector"], labels)
        for rule in policy["spec"].get("ingress", [])
    ]


@pytest.mark.parametrize(("value_set", "open_ports"), [("ray-values", {50051, 8000}), ("ray-tls-values", {50051})])
def test_ray_mode_network_policies_admit_only_the_clusters_pods_to_ray(
    helm: str, value_set: str, open_ports: set[int]
) -> None:
    manifests = render(helm, VALUE_SETS[value_set])
    [cluster] = [m for m in manifests if m["kind"] == "RayCluster"]
    policies = [m for m in manifests if m["kind"] == "NetworkPolicy"]
    head_pod, *worker_pods = ray_pod_templates(cluster)
    ray_labels = [pod["metadata"]["labels"] for pod in (head_pod, *worker_pods)]
    head_labels = head_pod["metadata"]["labels"]
    strangers = [
        {**head_labels, "app.kubernetes.io/component": "orchestrator"},  # a pod of the release that is no Ray pod
        {**head_labels, "app.kubernetes.io/instance": "another-release"},
        {"app": "anything"},
    ]
    reachable_by_anyone: dict[str, set[int]] = {}
    for pod in (head_pod, *worker_pods):
        labels = pod["metadata"]["labels"]
        rules = ingress_rules(policies, labels)
        assert rules, f"{labels['app.kubernetes.io/component']} is not isolated"
        for rule in rules:
            if "from" not in rule:
                ports = {port["port"] for port in rule["ports"]}  # a rule for anyone names its ports
                reachable_by_anyone.setdefault(labels["app.kubernetes.io/component"], set()).update(ports)
                continue
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, peer  # pods of this namespace: no ipBlock, no namespaceSelector
                assert all(selects(peer["podSelector"], other) for other in ray_labels)
                assert not any(selects(peer["podSelector"], stranger) for stranger in strangers)
    # Only the orchestrator's public ports answer anyone, on the head; Ray's ports (GCS, dashboard) are not among them.
    assert reachable_by_anyone == {"ray-head": open_ports}
    [head] = head_pod["spec"]["containers"]
    named = {port["name"]: port["containerPort"] for port in head["ports"]}
    assert not {named["gcs"], named["dashboard"]} & open_ports
    assert open_ports == {named[name] for name in ("grpc", "http") if name in named}
    # Turned off, none is rendered.
    off = render(helm, [*VALUE_SETS[value_set], "--set", "networkPolicy.enabled=false"])
    assert not [m for m in off if m["kind"] == "NetworkPolicy"]

"""Kubernetes manifests: every overlay builds with kustomize, validates against the Kubernetes
schemas offline (kubernetes-validate, strict), and says what operations needs.

The ServiceMonitor is a Prometheus Operator CRD that kubernetes-validate carries no schema for: it is
skipped by the schema check and checked here instead against the Service it must select; likewise
the tls overlay's cert-manager Certificate, checked against the Secret the pod mounts.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import fields
from functools import cache

import pytest
import yaml
from repo_paths import REPO_ROOT, find_tool

from encoder_service.config import ENV_PREFIX, ServiceConfig
from encoder_service.config_flags import build_config

K8S = REPO_ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu-demo", "gpu", "gpu-node", "tls")
KUBERNETES_VERSION = "1.33.0"
CRD_KINDS = {"ServiceMonitor", "Certificate"}


def kustomize_command() -> list[str] | None:
    """``kustomize build`` if there is one, else ``kubectl kustomize`` (scripts/ci_tools.sh gets it)."""
    if os.environ.get("KUSTOMIZE"):
        return [os.environ["KUSTOMIZE"], "build"]
    if find_tool("kustomize"):
        return [find_tool("kustomize"), "build"]
    if find_tool("kubectl"):
        return [find_tool("kubectl"), "kustomize"]
    return None


@cache
def build(overlay: str) -> tuple[dict, ...]:
    command = kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl on PATH (scripts/ci_tools.sh installs kubectl)")
    result = subprocess.run([*command, str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def one(docs, kind: str, name_prefix: str = "encoder-service") -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name_prefix)]
    assert len(found) == 1, f"{kind} {name_prefix}: {[d['metadata']['name'] for d in found]}"
    return found[0]


def container(docs) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def settings(docs) -> dict[str, str]:
    return one(docs, "ConfigMap", "encoder-service-config")["data"]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_against_the_kubernetes_schemas(overlay):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = build(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "ServiceMonitor", "Namespace"} <= kinds
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{overlay}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_schema_validation_rejects_a_broken_deployment():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deployment = yaml.safe_load(yaml.safe_dump(one(build("gpu"), "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_server_accepts_the_configmap_settings(overlay):
    data = settings(build(overlay))
    known = {ENV_PREFIX + f.name.upper() for f in fields(ServiceConfig)}
    assert set(data) <= known, f"settings the server does not read: {set(data) - known}"
    config = build_config(None, data)
    assert config.metrics_port == 9090 and config.port == 50051 and config.host == "0.0.0.0"
    assert config.metrics_host == "0.0.0.0"  # Prometheus scrapes the pod's IP (loopback is the default)
    ports = {p["name"]: p["containerPort"] for p in container(build(overlay))["ports"]}
    expected = {"grpc": config.port, "metrics": config.metrics_port}
    if config.health_port >= 0:
        expected["health"] = config.health_port
    assert ports == expected


def test_cpu_demo_serves_the_tiny_preset_without_a_gpu():
    docs = build("cpu-demo")
    config = build_config(None, settings(docs))
    assert (config.model, config.device) == ("tiny-qwen2.5-vl", "cpu")
    resources = container(docs)["resources"]
    assert not any("gpu" in k for part in resources.values() for k in part)


def test_gpu_overlay_requests_a_gpu_and_mounts_the_checkpoint_read_only():
    docs = build("gpu")
    config = build_config(None, settings(docs))
    assert config.device == "cuda" and config.dtype == "bfloat16" and config.model.startswith("/models/")
    c = container(docs)
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1 and c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert one(docs, "Deployment")["spec"]["replicas"] == 2


def test_gpu_node_overlay_serves_every_gpu_of_the_pod_from_one_front_end():
    docs = build("gpu-node")
    config = build_config(None, settings(docs))
    assert config.devices == "all" and config.device == "cuda" and config.model.startswith("/models/")
    c = container(docs)
    gpus = c["resources"]["requests"]["nvidia.com/gpu"]
    assert gpus >= 2 and c["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert one(docs, "Deployment")["spec"]["replicas"] == 1
    assert len([d for d in docs if d["kind"] == "ConfigMap"]) == 1  # merged into the base's, not beside it


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_are_native_grpc_and_startup_allows_loading_a_7b_checkpoint(overlay):
    c = container(build(overlay))
    config = build_config(None, settings(build(overlay)))
    # Kubernetes' gRPC probes speak plaintext only: with TLS they must use the health-only port.
    probed = config.health_port if config.health_port >= 0 else config.port
    assert not config.tls or probed != config.port, "a plaintext probe cannot reach the TLS port"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == probed, probe
    assert c["readinessProbe"]["grpc"]["service"] == "encoder.v1.VisionEncoder"
    startup = c["startupProbe"]
    budget_s = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget_s >= (120 if overlay == "cpu-demo" else 600)
    grace_s = float(settings(build(overlay))["ENCODER_SERVICE_GRACE_PERIOD_S"])
    liveness = c["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > grace_s, "liveness would kill a draining pod"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_runs_non_root_on_a_read_only_root_with_writable_scratch(overlay):
    docs = build(overlay)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(docs)
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    empty_dirs = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    mounted = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    for path in ("/tmp", "/cache"):
        assert mounted[path] in empty_dirs, path
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["XDG_CACHE_HOME"] == "/cache" and env["TMPDIR"] == "/tmp"
    for part in ("requests", "limits"):
        assert "memory" in c["resources"][part], part


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_outlasts_the_drain_grace(overlay):
    docs = build(overlay)
    grace_s = float(settings(docs)["ENCODER_SERVICE_GRACE_PERIOD_S"])
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace_s + 10


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_pdb_and_hpa_select_the_deployments_pods(overlay):
    docs = build(overlay)
    deployment = one(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert matches(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert services["encoder-service"]["spec"]["type"] == "ClusterIP"
    assert services["encoder-service-peers"]["spec"]["clusterIP"] == "None"
    for service in services.values():
        assert matches(service["spec"]["selector"], pod_labels), service["metadata"]["name"]
    assert matches(one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], pod_labels)
    target = one(docs, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_scrapes_exactly_the_metrics_port_of_one_service_as_job_encoder_service(overlay):
    docs = build(overlay)
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitor["spec"]
    assert set(spec) <= {"jobLabel", "selector", "endpoints", "namespaceSelector", "targetLabels"}
    selected = [d for d in docs if d["kind"] == "Service"
                and matches(spec["selector"]["matchLabels"], d["metadata"].get("labels", {}))]
    assert [s["metadata"]["name"] for s in selected] == ["encoder-service"], "scraped twice or not at all"
    service = selected[0]
    assert service["metadata"]["labels"][spec["jobLabel"]] == "encoder-service"  # the alerts' job
    (endpoint,) = spec["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert re.fullmatch(r"\d+s", endpoint["interval"]) and re.fullmatch(r"\d+s", endpoint["scrapeTimeout"])
    assert int(endpoint["scrapeTimeout"][:-1]) < int(endpoint["interval"][:-1])


def test_tls_overlay_serves_mutual_tls_from_a_cert_manager_secret_mounted_as_a_directory():
    docs = build("tls")
    config = build_config(None, settings(docs))
    assert config.tls and config.tls_client_ca and config.health_port == 8081
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(docs)
    certificate = one(docs, "Certificate")
    assert certificate["apiVersion"] == "cert-manager.io/v1"
    assert certificate["metadata"]["namespace"] == one(docs, "Deployment")["metadata"]["namespace"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = [m for m in c["volumeMounts"] if volumes[m["name"]].get("secret", {}).get("secretName")
              == certificate["spec"]["secretName"]]
    assert len(mounts) == 1 and mounts[0]["readOnly"] is True
    # A subPath mount is a copy made at pod start: a renewed Secret would never reach the server.
    assert "subPath" not in mounts[0]
    directory = mounts[0]["mountPath"]
    assert (config.tls_cert, config.tls_key, config.tls_client_ca) == tuple(
        f"{directory}/{name}" for name in ("tls.crt", "tls.key", "ca.crt"))
    # Clients dial the Service and (routing by content hash) the headless Service's name.
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert services <= set(certificate["spec"]["dnsNames"])

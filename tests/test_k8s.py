"""The Kubernetes manifests: every overlay renders and validates strictly, and the
deployment's invariants hold (resources, probes, non-root, ports, GPUs, selectors)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from draft_service.config import DraftConfig
from gateway.config import GatewayConfig
from verify_service.config import VerifyConfig

K8S = Path(__file__).resolve().parent.parent / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir())
KUBERNETES_VERSION = "1.34.0"

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) is not installed")


def render(overlay: str) -> list[dict]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)], check=True, capture_output=True, text=True
    )
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def deployment(docs: list[dict], component: str) -> dict:
    return next(d for d in of_kind(docs, "Deployment") if d["metadata"]["name"] == f"specserve-{component}")


def config(docs: list[dict]) -> dict[str, str]:
    return next(d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"] == "specserve-config")["data"]


def test_there_are_the_two_overlays():
    assert OVERLAYS == ["cpu-demo", "gpu"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_strictly(overlay):
    docs = render(overlay)
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_resources_probes_and_runs_locked_down(overlay):
    for d in of_kind(render(overlay), "Deployment"):
        pod = d["spec"]["template"]["spec"]
        for container in pod["containers"]:
            where = f"{d['metadata']['name']}/{container['name']}"
            assert {"requests", "limits"} <= set(container.get("resources", {})), where
            assert "readinessProbe" in container and "livenessProbe" in container, where
            context = container.get("securityContext", {})
            assert pod["securityContext"].get("runAsNonRoot") or context.get("runAsNonRoot"), where
            assert context.get("readOnlyRootFilesystem") is True and context.get("allowPrivilegeEscalation") is False, (
                where
            )
            assert context.get("capabilities", {}).get("drop") == ["ALL"], where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_and_names_agree_with_the_services_config(overlay):
    docs = render(overlay)
    data = config(docs)
    defaults = {"draft": DraftConfig(), "verify": VerifyConfig()}
    for component, cfg in defaults.items():
        prefix = f"SPECSERVE_{component.upper()}_"
        assert int(data[prefix + "PORT"]) == cfg.port and int(data[prefix + "METRICS_PORT"]) == cfg.metrics_port
        container = deployment(docs, component)["spec"]["template"]["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["grpc"] == cfg.port and ports["metrics"] == cfg.metrics_port
        health = int(data[prefix + "HEALTH_PORT"])
        assert ports["health"] == health
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == health, (component, probe)  # native gRPC probes
        service = next(s for s in of_kind(docs, "Service") if s["metadata"]["name"] == f"specserve-{component}")
        assert service["spec"]["clusterIP"] == "None"  # headless: the gateway balances over replicas
        assert data[f"SPECSERVE_GATEWAY_{component.upper()}_ADDRESS"] == f"dns:///specserve-{component}:{cfg.port}"
    gateway = deployment(docs, "gateway")["spec"]["template"]["spec"]["containers"][0]
    assert gateway["ports"][0]["containerPort"] == int(data["SPECSERVE_GATEWAY_PORT"]) == GatewayConfig().port
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"


def test_gpu_overlay_puts_drafts_and_verifiers_on_different_gpu_classes():
    docs = render("gpu")
    products = {}
    for component in ("draft", "verify"):
        pod = deployment(docs, component)["spec"]["template"]["spec"]
        limits = pod["containers"][0]["resources"]["limits"]
        assert limits.get("nvidia.com/gpu") == "1", component
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        expression = next(e for t in terms for e in t["matchExpressions"] if e["key"] == "nvidia.com/gpu.product")
        products[component] = set(expression["values"])
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert products["draft"].isdisjoint(products["verify"])
    assert "nvidia.com/gpu" not in str(deployment(docs, "gateway"))


def test_cpu_demo_asks_for_no_gpu_and_runs_one_replica_each():
    docs = render("cpu-demo")
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(docs)
    for component in ("gateway", "draft", "verify"):
        assert deployment(docs, component)["spec"]["replicas"] == 1
    assert not of_kind(docs, "HorizontalPodAutoscaler")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_selects_a_deployment_and_policies_guard_the_backends(overlay):
    docs = render(overlay)
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in of_kind(docs, "Deployment")]
    for service in of_kind(docs, "Service"):
        selector = service["spec"]["selector"]
        assert any(selector.items() <= labels.items() for labels in pod_labels), service["metadata"]["name"]
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        assert any(pdb["spec"]["selector"]["matchLabels"].items() <= labels.items() for labels in pod_labels)
    policies = {p["metadata"]["name"]: p for p in of_kind(docs, "NetworkPolicy")}
    backends = policies["specserve-backends-from-gateway"]["spec"]["ingress"][0]["from"]
    assert backends == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "specserve",
                                                          "app.kubernetes.io/component": "gateway"}}}]  # fmt: skip
    assert policies["specserve-default-deny"]["spec"]["policyTypes"] == ["Ingress"]
    assert "ingress" not in policies["specserve-default-deny"]["spec"]


def test_gpu_overlay_mounts_models_from_a_volume_and_turns_on_mutual_tls():
    docs = render("gpu")
    data = config(docs)
    assert data["SPECSERVE_VERIFY_MODEL"].startswith("/models/") and data["SPECSERVE_VERIFY_TLS_CLIENT_CA"]
    for component in ("draft", "verify", "gateway"):
        volumes = {v["name"]: v for v in deployment(docs, component)["spec"]["template"]["spec"]["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "specserve-models"
        assert volumes["tls"]["secret"]["secretName"] == "specserve-mtls"

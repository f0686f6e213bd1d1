"""The Helm chart: lint, render with five value sets, validate every object against
Kubernetes 1.29 and 1.31, and check what the chart promises on the rendered objects.
No cluster exists here: nothing is installed (docs/deploy.md says what is untested)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.conftest import (
    CHART,
    RenderError,
    by_kind,
    container,
    flags,
    helm,
    one,
    render,
    values_file,
)

SECRETS = {
    "adminToken": {"name": "kvplane-admin", "key": "token"},
    "agentToken": {"name": "kvplane-agents", "key": "token"},
    "tenants": {"name": "kvplane-tenants", "key": "tenants.toml"},
    "cacheSaltSecret": {"name": "kvplane-salt", "key": "secret"},
}
SERVICE_MONITOR_API = "monitoring.coreos.com/v1/ServiceMonitor"

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "simulator-fleet": {"engines": {"kind": "engine-sim", "replicas": 3, "blockSize": 16}},
    "vllm-bundled-redis": {
        "redis": {"bundled": {"enabled": True}},
        "router": {
            "replicas": 2,
            "blockSize": 32,
            "secrets": SECRETS,
            "tokenizerVolume": {"persistentVolumeClaim": {"claimName": "models"}},
            "tokenizerSubPath": "qwen",
            "adminService": {"enabled": True},
        },
        "engines": {"model": "Qwen/Qwen2.5-0.5B-Instruct", "blockSize": 16, "replicas": 4},
    },
    "external-redis-autoscaling": {
        "redis": {"url": "redis://redis.cache.svc:6379/0"},
        "router": {
            "replicas": 3,
            "podAntiAffinity": "hard",
            "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 8},
            "podDisruptionBudget": {"enabled": True, "minAvailable": 2},
            "secrets": SECRETS,
        },
    },
    "sidecar-only": {"engines": {"enabled": False}, "sidecar": {"render": True}},
}


def rendered(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    api = [SERVICE_MONITOR_API] if name == "external-redis-autoscaling" else []
    return render(tmp_path, VALUE_SETS[name], api_versions=api)


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_the_chart_lints_strictly(tmp_path: Path, name: str) -> None:
    done = helm(
        "lint", "--strict", str(CHART), "--values", str(values_file(tmp_path, VALUE_SETS[name]))
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("kubernetes", ["1.29", "1.31"])
@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_object_is_valid_kubernetes(tmp_path: Path, name: str, kubernetes: str) -> None:
    objects = rendered(tmp_path, name)
    assert objects
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":  # a CRD: no schema in Kubernetes itself
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        kubernetes_validate.validate(obj, kubernetes, strict=True)


def test_the_agent_sidecar_speaks_to_its_engine_and_router(tmp_path: Path) -> None:
    for name in ("defaults", "simulator-fleet", "vllm-bundled-redis"):
        objects = rendered(tmp_path, name)
        (engines,) = by_kind(objects, "StatefulSet")
        engine = flags(container(engines, "engine")["args"])
        agent = flags(container(engines, "kvplane-agent")["args"])
        events = json.loads(engine["kv-events-config"])
        assert events["enable_kv_cache_events"] is True
        assert agent["kv-events-endpoint"].endswith(":" + events["endpoint"].rsplit(":", 1)[1])
        assert agent["kv-events-replay-endpoint"].endswith(
            ":" + events["replay_endpoint"].rsplit(":", 1)[1]
        )
        assert agent["kv-events-topic"] == events["topic"]
        assert agent["engine-url"] == f"http://127.0.0.1:{engine['port']}"
        config = one(objects, "ConfigMap", "rel-kvplane-router")["data"]["kvplane.toml"]
        router_block = int(re.search(r"block_size = (\d+)", config).group(1))  # type: ignore[union-attr]
        assert int(agent["block-size"]) == router_block
        assert router_block % int(engine["block-size"]) == 0
        grpc = re.search(r"grpc_port = (\d+)", config).group(1)  # type: ignore[union-attr]
        assert agent["control-plane-address"] == f"rel-kvplane-router:{grpc}"


def test_secrets_come_from_references_never_values(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "vllm-bundled-redis")
    assert by_kind(objects, "Secret") == []
    router = container(one(objects, "Deployment", "rel-kvplane-router"), "router")
    env = {item["name"]: item for item in router["env"]}
    for variable, secret in (
        ("KVPLANE_HTTP__ADMIN_TOKEN", "adminToken"),
        ("KVPLANE_CONTROL_PLANE__AGENT_TOKEN", "agentToken"),
        ("KVPLANE_TENANTS__CACHE_SALT_SECRET", "cacheSaltSecret"),
    ):
        assert "value" not in env[variable]
        assert env[variable]["valueFrom"]["secretKeyRef"] == SECRETS[secret]
    (engines,) = by_kind(objects, "StatefulSet")
    agent_env = {i["name"]: i for i in container(engines, "kvplane-agent")["env"]}
    assert (
        agent_env["KVPLANE_CONTROL_PLANE__AGENT_TOKEN"]["valueFrom"]["secretKeyRef"]
        == (SECRETS["agentToken"])
    )
    volumes = one(objects, "Deployment", "rel-kvplane-router")["spec"]["template"]["spec"][
        "volumes"
    ]
    (tenants,) = [v for v in volumes if v["name"] == "tenants"]
    assert tenants["secret"]["secretName"] == "kvplane-tenants"
    defaults = (CHART / "values.yaml").read_text()
    references = re.findall(r"\{name: \"([^\"]*)\", key", defaults)
    assert len(references) == len(SECRETS)
    assert set(references) == {""}  # the chart's defaults name no secret, and hold none


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"router": {"replicas": 3}}, "more than one router replica needs a shared index"),
        (
            {"router": {"autoscaling": {"enabled": True, "maxReplicas": 4}}},
            "more than one router replica needs a shared index",
        ),
        (
            {"redis": {"url": "redis://r:6379/0", "bundled": {"enabled": True}}},
            "either redis.url or redis.bundled.enabled",
        ),
        ({"engines": {"blockSize": 32}}, "engines.blockSize must divide router.blockSize"),
        ({"engines": {"kind": "vllm", "model": ""}}, "engines.kind vllm needs engines.model"),
        ({"router": {"replicsa": 2}}, "Additional property replicsa is not allowed"),
        ({"image": {"tag": "latest"}}, "image.tag"),
        ({"engines": {"kind": "tgi"}}, "engines.kind must be one of"),
        ({"redis": {"url": "localhost:6379"}}, "redis.url"),
    ],
)
def test_wrong_values_fail_with_a_clear_message(
    tmp_path: Path, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(RenderError, match=re.escape(message)):
        render(tmp_path, values)


def test_the_default_service_does_not_expose_the_fleet_api(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "defaults")
    service = one(objects, "Service", "rel-kvplane-router")
    assert {p["name"] for p in service["spec"]["ports"]} == {"http", "grpc"}
    config = one(objects, "ConfigMap", "rel-kvplane-router")["data"]["kvplane.toml"]
    assert "admin_port = 8081" in config  # the fleet API and /metrics live there alone
    with_admin = rendered(tmp_path, "vllm-bundled-redis")
    admin = one(with_admin, "Service", "rel-kvplane-router-admin")
    assert [p["port"] for p in admin["spec"]["ports"]] == [8081]


def test_network_policies_admit_only_routers_to_engines_and_agents_to_grpc(
    tmp_path: Path,
) -> None:
    objects = rendered(tmp_path, "vllm-bundled-redis")
    engines = one(objects, "NetworkPolicy", "rel-kvplane-engines")
    (rule,) = engines["spec"]["ingress"]
    assert rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert rule["ports"] == [{"port": 8000, "protocol": "TCP"}]  # not the KV event ports
    router = one(objects, "NetworkPolicy", "rel-kvplane-router")
    grpc_rules = [
        r for r in router["spec"]["ingress"] if {"port": 50051, "protocol": "TCP"} in r["ports"]
    ]
    (grpc_rule,) = grpc_rules
    assert grpc_rule["from"][0]["podSelector"]["matchLabels"] == {"kvplane.io/agent": "true"}
    (engine_set,) = by_kind(objects, "StatefulSet")
    assert engine_set["spec"]["template"]["metadata"]["labels"]["kvplane.io/agent"] == "true"
    redis = one(objects, "NetworkPolicy", "rel-kvplane-redis")
    assert (
        redis["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"][
            "app.kubernetes.io/component"
        ]
        == "router"
    )


def test_autoscaling_budget_and_scraping_are_rendered_when_asked(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "external-redis-autoscaling")
    hpa = one(objects, "HorizontalPodAutoscaler", "rel-kvplane-router")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 8)
    assert "replicas" not in one(objects, "Deployment", "rel-kvplane-router")["spec"]
    assert one(objects, "PodDisruptionBudget", "rel-kvplane-router")["spec"]["minAvailable"] == 2
    monitor = one(objects, "ServiceMonitor", "rel-kvplane-router")
    assert monitor["spec"]["endpoints"][0]["port"] == "admin"
    config = one(objects, "ConfigMap", "rel-kvplane-router")["data"]["kvplane.toml"]
    assert 'backend = "redis"' in config
    assert 'redis_url = "redis://redis.cache.svc:6379/0"' in config
    # Without the Prometheus operator's API there is no ServiceMonitor to render.
    assert by_kind(rendered(tmp_path, "defaults"), "ServiceMonitor") == []


def test_router_pods_are_probed_and_spread(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "external-redis-autoscaling")
    deployment = one(objects, "Deployment", "rel-kvplane-router")
    router = container(deployment, "router")
    assert router["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert router["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert router["securityContext"]["allowPrivilegeEscalation"] is False
    affinity = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" in affinity


def test_sidecar_only_renders_the_agent_for_someone_elses_engines(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "sidecar-only")
    assert by_kind(objects, "StatefulSet") == []
    snippet = one(objects, "ConfigMap", "rel-kvplane-agent-sidecar")["data"]["agent-container.yaml"]
    (agent,) = yaml.safe_load(snippet)
    assert agent["name"] == "kvplane-agent"
    assert flags(agent["args"])["control-plane-address"] == "rel-kvplane-router:50051"

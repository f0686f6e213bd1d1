"""The Helm chart: lint, render with five value sets, validate every object against
Kubernetes 1.29 and 1.31, and check what the chart promises on the rendered objects.
No cluster exists here: nothing is installed (docs/deploy.md says what is untested)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from cryptography import x509

from router.metrics import RouterMetrics
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

pytestmark = pytest.mark.heavy("helm")

SECRETS = {
    "adminToken": {"name": "kvplane-admin", "key": "token"},
    "agentToken": {"name": "kvplane-agents", "key": "token"},
    "tenants": {"name": "kvplane-tenants", "key": "tenants.toml"},
    "cacheSaltSecret": {"name": "kvplane-salt", "key": "secret"},
    "workerCredentialSecret": {"name": "kvplane-workers", "key": "secret"},
}
SERVICE_MONITOR_API = "monitoring.coreos.com/v1/ServiceMonitor"
PROMETHEUS_RULE_API = "monitoring.coreos.com/v1/PrometheusRule"
CERT_MANAGER_API = "cert-manager.io/v1"
CUSTOM_RESOURCES = {  # kinds with no schema in Kubernetes itself
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "PrometheusRule": "monitoring.coreos.com/v1",
    "Certificate": CERT_MANAGER_API,
    "Issuer": CERT_MANAGER_API,
}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "simulator-fleet": {
        "engines": {
            "kind": "engine-sim",
            "replicas": 3,
            "blockSize": 16,
            "kvEventsTransport": "tcp",
        }
    },
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
    api = (
        [SERVICE_MONITOR_API, PROMETHEUS_RULE_API, CERT_MANAGER_API]
        if name == "external-redis-autoscaling"
        else []
    )
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
        if obj["kind"] in CUSTOM_RESOURCES:
            assert obj["apiVersion"] == CUSTOM_RESOURCES[obj["kind"]]
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
        for agent_flag, engine_field in (
            ("kv-events-endpoint", "endpoint"),
            ("kv-events-replay-endpoint", "replay_endpoint"),
        ):
            if name == "simulator-fleet":  # tcp: the engine binds every interface's port
                assert events[engine_field].startswith("tcp://*:")
                port = events[engine_field].rsplit(":", 1)[1]
                assert agent[agent_flag] == f"tcp://127.0.0.1:{port}"
            else:  # ipc, the default: a socket file in a volume both containers mount
                assert events[engine_field].startswith("ipc:///run/kvplane-events/")
                assert agent[agent_flag] == events[engine_field]
                for box in ("engine", "kvplane-agent"):
                    mounts = {
                        m["name"]: m["mountPath"] for m in container(engines, box)["volumeMounts"]
                    }
                    assert mounts["kv-events"] == "/run/kvplane-events"
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
    # The only Secrets rendered are the ones the chart generates itself (not values).
    assert {o["metadata"]["name"] for o in by_kind(objects, "Secret")} == {
        "rel-kvplane-redis",
        "rel-kvplane-router-tls",
    }
    router = container(one(objects, "Deployment", "rel-kvplane-router"), "router")
    env = {item["name"]: item for item in router["env"]}
    for variable, secret in (
        ("KVPLANE_HTTP__ADMIN_TOKEN", "adminToken"),
        ("KVPLANE_CONTROL_PLANE__AGENT_TOKEN", "agentToken"),
        ("KVPLANE_TENANTS__CACHE_SALT_SECRET", "cacheSaltSecret"),
        ("KVPLANE_CONTROL_PLANE__WORKER_CREDENTIAL_SECRET", "workerCredentialSecret"),
    ):
        assert "value" not in env[variable]
        assert env[variable]["valueFrom"]["secretKeyRef"] == SECRETS[secret]
    (engines,) = by_kind(objects, "StatefulSet")
    agent_env = {i["name"]: i for i in container(engines, "kvplane-agent")["env"]}
    # Each agent reads its own worker's token, derived in its pod, not a shared one.
    assert "KVPLANE_CONTROL_PLANE__AGENT_TOKEN" not in agent_env
    assert agent_env["KVPLANE_CONTROL_PLANE__AGENT_TOKEN_FILE"]["value"].startswith("/var/run")
    volumes = one(objects, "Deployment", "rel-kvplane-router")["spec"]["template"]["spec"][
        "volumes"
    ]
    (tenants,) = [v for v in volumes if v["name"] == "tenants"]
    assert tenants["secret"]["secretName"] == "kvplane-tenants"
    defaults = (CHART / "values.yaml").read_text()
    references = re.findall(r"\{name: \"([^\"]*)\", key", defaults)
    assert len(references) == len(SECRETS) + 1  # and redis.bundled.passwordSecret
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
        (
            {"router": {"prometheusRule": {"flowMaxWaitSeconds": 0}}},
            "router.prometheusRule.flowMaxWaitSeconds: Must be greater than 0",
        ),
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


def pod_specs(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (o["metadata"]["name"], o["spec"]["template"]["spec"])
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
    ]


@pytest.mark.parametrize("name", ["defaults", "simulator-fleet", "vllm-bundled-redis"])
def test_every_pod_is_hardened_by_default(tmp_path: Path, name: str) -> None:
    objects = rendered(tmp_path, name)
    assert len(pod_specs(objects)) >= 2
    for owner, spec in pod_specs(objects):
        assert spec["automountServiceAccountToken"] is False, owner
        pod_context = spec.get("securityContext", {})
        for box in [*spec.get("initContainers", []), *spec["containers"]]:
            where = f"{owner}/{box['name']}"
            context = box["securityContext"]
            assert context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is True, where
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["capabilities"] == {"drop": ["ALL"]}, where
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(box["resources"][bound]), f"{where} {bound}"


def test_the_control_plane_is_tls_and_each_agent_holds_its_own_credential(
    tmp_path: Path,
) -> None:
    objects = rendered(tmp_path, "defaults")
    config = one(objects, "ConfigMap", "rel-kvplane-router")["data"]["kvplane.toml"]
    assert 'tls_cert_file = "/etc/kvplane/tls/tls.crt"' in config
    secret = one(objects, "Secret", "rel-kvplane-router-tls")
    certificate = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    authority = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    assert certificate.issuer == authority.subject
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    (engines,) = by_kind(objects, "StatefulSet")
    agent = container(engines, "kvplane-agent")
    address = flags(agent["args"])["control-plane-address"]
    assert address.split(":")[0] in names.value.get_values_for_type(x509.DNSName)
    agent_env = {item["name"]: item for item in agent["env"]}
    assert agent_env["KVPLANE_AGENT__TLS_CA_FILE"]["value"].endswith("/ca.crt")
    volumes = {v["name"]: v for v in engines["spec"]["template"]["spec"]["volumes"]}
    # The engine pods get the CA, never the router's key.
    assert volumes["control-plane-ca"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    # The worker credential secret: generated, given to the router and to each engine
    # pod's init container alone, which writes the pod's own token for its agent.
    generated = one(objects, "Secret", "rel-kvplane-worker-credentials")
    assert len(base64.b64decode(generated["data"]["worker-credential-secret"])) >= 32
    router_env = {
        item["name"]: item
        for item in container(one(objects, "Deployment", "rel-kvplane-router"), "router")["env"]
    }
    reference = {"name": "rel-kvplane-worker-credentials", "key": "worker-credential-secret"}
    assert (
        router_env["KVPLANE_CONTROL_PLANE__WORKER_CREDENTIAL_SECRET"]["valueFrom"]["secretKeyRef"]
        == reference
    )
    (init,) = engines["spec"]["template"]["spec"]["initContainers"]
    assert init["args"][:2] == ["worker-token", "--worker-id"]
    assert {i["name"] for i in init["env"]} >= {"KVPLANE_CONTROL_PLANE__WORKER_CREDENTIAL_SECRET"}
    for box in engines["spec"]["template"]["spec"]["containers"]:
        assert all("SECRET" not in item["name"] for item in box.get("env", [])), box["name"]
    assert volumes["agent-token"]["emptyDir"]["medium"] == "Memory"
    # Where cert-manager's API exists, it issues the certificate instead.
    managed = rendered(tmp_path, "external-redis-autoscaling")
    issued = one(managed, "Certificate", "rel-kvplane-router-tls")
    assert "rel-kvplane-router" in issued["spec"]["dnsNames"]
    assert by_kind(managed, "Secret") == []  # no generated pair (nor, named, credentials)


def test_network_policies_keep_each_port_to_its_own_peers(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "vllm-bundled-redis")
    router = one(objects, "NetworkPolicy", "rel-kvplane-router")
    by_port = {rule["ports"][0]["port"]: rule.get("from") for rule in router["spec"]["ingress"]}
    assert by_port[8080] is None  # clients, from anywhere
    # The admin port: only what networkPolicy.adminFrom names, by default labelled pods.
    assert by_port[8081] == [
        {"podSelector": {"matchLabels": {"kvplane.io/admin-client": "true"}}},
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        },
    ]
    # gRPC: agents of this namespace only (no namespaceSelector).
    assert by_port[50051] == [{"podSelector": {"matchLabels": {"kvplane.io/agent": "true"}}}]
    # The bundled Redis: a password, and only routers reach it.
    redis = container(one(objects, "Deployment", "rel-kvplane-redis"), "redis")
    assert "--requirepass" in redis["args"]
    router_env = {
        item["name"]: item
        for item in container(one(objects, "Deployment", "rel-kvplane-router"), "router")["env"]
    }
    assert router_env["KVPLANE_INDEX__REDIS_URL"]["value"].startswith("redis://:$(REDIS_PASSWORD)@")
    policy = one(objects, "NetworkPolicy", "rel-kvplane-redis")
    (peer,) = policy["spec"]["ingress"][0]["from"]
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"


def test_the_router_pod_outlives_its_drain(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "defaults")
    spec = one(objects, "Deployment", "rel-kvplane-router")["spec"]["template"]["spec"]
    env = {item["name"]: item.get("value") for item in container(
        one(objects, "Deployment", "rel-kvplane-router"), "router")["env"]}  # fmt: skip
    delay, timeout = (
        float(env["KVPLANE_HTTP__DRAIN_DELAY_S"]),
        float(env["KVPLANE_HTTP__DRAIN_TIMEOUT_S"]),
    )
    assert delay > 0
    assert spec["terminationGracePeriodSeconds"] > delay + timeout


def exported_metric_names() -> set[str]:
    """The router's metric families (a counter's family is named without `_total`),
    those with no labelled series yet included."""
    return {family.name for family in RouterMetrics().registry.collect()}


def metric_names(expression: str) -> set[str]:
    """The kvplane metrics a PromQL expression reads, as families."""
    return {
        re.sub(r"_(total|bucket|sum|count|created)$", "", name)
        for name in re.findall(r"\b(kvplane_[a-z_]+)", expression)
    }


def test_the_alerts_read_metrics_the_router_exports(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "external-redis-autoscaling")
    rule = one(objects, "PrometheusRule", "rel-kvplane-router")
    alerts = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    assert {alert["alert"] for alert in alerts} == {
        "KvplanePredictionDrift",
        "KvplaneWorkerEventsStopped",
        "KvplaneModelRoutedBlind",
        "KvplaneIndexUnavailable",
        "KvplaneHotspot",
        "KvplaneIndexNearCapacity",
        "KvplaneRedisMemoryNearLimit",
        "KvplaneWorkerCreditWithdrawn",
        "KvplaneTenantShed",
        "KvplaneFlowQueueTimeouts",
        "KvplaneFlowQueueNotDraining",
    }
    exported = exported_metric_names()
    runbooks = (CHART.parents[2] / "docs" / "alerts.md").read_text()
    for alert in alerts:
        named = metric_names(alert["expr"])
        assert named, alert["alert"]
        assert named <= exported, (alert["alert"], named - exported)
        anchor = alert["annotations"]["runbook_url"].rsplit("#", 1)[1]
        assert f"## {alert['alert']}" in runbooks
        assert anchor == alert["alert"].lower()
    assert by_kind(rendered(tmp_path, "defaults"), "PrometheusRule") == []  # no CRD, no rule


def test_the_flow_alerts_tell_the_right_sheds_apart_and_read_the_routers_max_wait(
    tmp_path: Path,
) -> None:
    def flow_alerts(values: dict[str, Any]) -> dict[str, str]:
        objects = render(tmp_path, values, api_versions=[PROMETHEUS_RULE_API])
        rule = one(objects, "PrometheusRule", "rel-kvplane-router")
        return {
            r["alert"]: r["expr"]
            for group in rule["spec"]["groups"]
            for r in group["rules"]
            if "kvplane_flow_" in r["expr"]
        }

    alerts = flow_alerts({})
    # A tenant shed for what flow control is for, apart from a queue that outlasts its wait.
    assert 'reason!="queue_timeout"' in alerts["KvplaneTenantShed"]
    assert 'reason="queue_timeout"' in alerts["KvplaneFlowQueueTimeouts"]
    # The waits' p90 against 80% of flow_control.max_wait_s, as the chart is told it.
    assert "> 0.8 * 60\n" in alerts["KvplaneFlowQueueNotDraining"]
    tighter = flow_alerts({"router": {"prometheusRule": {"flowMaxWaitSeconds": 20}}})
    assert "> 0.8 * 20\n" in tighter["KvplaneFlowQueueNotDraining"]


def test_the_dashboard_reads_metrics_the_router_exports(tmp_path: Path) -> None:
    config = one(rendered(tmp_path, "defaults"), "ConfigMap", "rel-kvplane-dashboard")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config["data"]["kvplane.json"])
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(dashboard["panels"]) >= 10
    exported = exported_metric_names()
    used = set()
    for expression in expressions:
        named = metric_names(expression)
        assert named, expression
        assert named <= exported, named - exported
        used |= named
    # The funnel, the hit rate's parts and the loss reasons are all on it.
    assert {"kvplane_funnel_tokens", "kvplane_funnel_lost_tokens"} <= used
    assert {"kvplane_funnel_reported_prompt_tokens", "kvplane_funnel_copied_tokens"} <= used
    # And flow control: queues by band, waits, shedding and each tenant's service.
    assert {
        "kvplane_flow_queued_requests",
        "kvplane_flow_wait_seconds",
        "kvplane_flow_shed",
        "kvplane_flow_service_tokens",
    } <= used
    off = render(tmp_path, {"grafana": {"dashboard": {"enabled": False}}})
    assert [
        o for o in by_kind(off, "ConfigMap") if o["metadata"]["name"].endswith("dashboard")
    ] == []


def test_the_bundled_redis_refuses_writes_before_its_container_is_killed(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "vllm-bundled-redis")
    redis = container(one(objects, "Deployment", "rel-kvplane-redis"), "redis")
    arguments = redis["args"]
    maxmemory = arguments[arguments.index("--maxmemory") + 1]
    assert maxmemory == "600mb"
    assert redis["resources"]["limits"]["memory"] == "1Gi"  # 600 MB is 56% of it

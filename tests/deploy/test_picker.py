"""The Helm chart's picker mode (a Gateway API Inference Extension endpoint picker):
render it, validate its InferencePool and HTTPRoute against the published CRDs vendored
in tests/deploy/crds (nothing is downloaded), and check that the objects agree with each
other: the pool's picker reference, the Service, the router's listener and probes, the
pool's pods and ports, TLS, the NetworkPolicies and the refusals."""

from __future__ import annotations

import base64
import re
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from cryptography import x509

from tests.deploy.conftest import (
    CHART,
    RenderError,
    by_kind,
    container,
    helm,
    one,
    render,
    values_file,
)

pytestmark = pytest.mark.heavy("helm")

CRDS = Path(__file__).parent / "crds"
CRD_FILES = {  # kind: the vendored CRD (its header names the source and commit)
    "InferencePool": "inference.networking.k8s.io_inferencepools.yaml",
    "HTTPRoute": "gateway.networking.k8s.io_httproutes.yaml",
}
ROUTER_LABELS = {
    "app.kubernetes.io/name": "kvplane",
    "app.kubernetes.io/instance": "rel",
    "app.kubernetes.io/component": "router",
}
GATEWAY = {"name": "inference-gateway", "namespace": "gateways", "sectionName": "http"}

PICKER_SETS: dict[str, dict[str, Any]] = {
    # One router, the in-memory index; TLS with the control plane's certificate.
    "picker": {"picker": {"enabled": True}},
    # Three routers on one Redis, a TLS Secret of the operator's, FailOpen, the route.
    "picker-ha": {
        "redis": {"url": "redis://redis.cache.svc:6379/0"},
        "router": {"replicas": 3},
        "picker": {
            "enabled": True,
            "failureMode": "FailOpen",
            "tls": {"secretName": "kvplane-picker-tls"},
            "httpRoute": {
                "enabled": True,
                "parentRefs": [GATEWAY],
                "hostnames": ["llm.example.com"],
                "timeouts": {"request": "300s"},
            },
        },
    },
    # Without TLS (a gateway that dials plain HTTP/2), on ports other than the defaults.
    "picker-plaintext": {
        "engines": {"kind": "engine-sim", "httpPort": 8001},
        "picker": {"enabled": True, "port": 9100, "tls": {"enabled": False}},
    },
    # Engines of the operator's own (the sidecar): the pool's pods come from values.
    "picker-own-engines": {
        "engines": {"enabled": False},
        "sidecar": {"render": True},
        "picker": {
            "enabled": True,
            "inferencePool": {"selector": {"app": "my-vllm"}, "targetPorts": [8000, 8001]},
            "gatewayFrom": [],
        },
    },
}


def rendered(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    return render(tmp_path, PICKER_SETS[name])


def router_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return container(one(objects, "Deployment", "rel-kvplane-router"), "router")


def env_of(box: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value") for item in box.get("env", [])}


def strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever it lists an object's fields, as
    the API server does under kubectl's strict field validation (a CRD's schema leaves
    that to pruning, which would drop a misspelt field without a word)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in schema:
        out["properties"] = {name: strict(sub) for name, sub in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = strict(schema[key])
    return out


def crd(kind: str) -> dict[str, Any]:
    definition: dict[str, Any] = yaml.safe_load((CRDS / CRD_FILES[kind]).read_text())
    return definition


def validate_custom(obj: dict[str, Any]) -> None:
    """A custom resource against its vendored CRD's served version's schema."""
    definition = crd(obj["kind"])
    group = definition["spec"]["group"]
    assert definition["spec"]["names"]["kind"] == obj["kind"]
    served = {f"{group}/{v['name']}": v for v in definition["spec"]["versions"] if v["served"]}
    assert obj["apiVersion"] in served, (obj["apiVersion"], list(served))
    schema = strict(served[obj["apiVersion"]]["schema"]["openAPIV3Schema"])
    jsonschema.Draft4Validator.check_schema(schema)
    jsonschema.Draft4Validator(schema).validate(obj)


def cel_rules(schema: Any) -> set[str]:
    """Every x-kubernetes-validations rule in a schema (jsonschema cannot run them)."""
    if isinstance(schema, list):
        return set().union(*(cel_rules(item) for item in schema)) if schema else set()
    if not isinstance(schema, dict):
        return set()
    found = {rule["rule"] for rule in schema.get("x-kubernetes-validations", [])}
    for value in schema.values():
        found |= cel_rules(value)
    return found


@pytest.mark.parametrize("name", list(PICKER_SETS))
def test_picker_mode_lints_strictly(tmp_path: Path, name: str) -> None:
    done = helm(
        "lint", "--strict", str(CHART), "--values", str(values_file(tmp_path, PICKER_SETS[name]))
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("kubernetes", ["1.29", "1.31"])
@pytest.mark.parametrize("name", list(PICKER_SETS))
def test_every_picker_mode_object_is_valid(tmp_path: Path, name: str, kubernetes: str) -> None:
    objects = rendered(tmp_path, name)
    custom = [o for o in objects if o["kind"] in CRD_FILES]
    assert {o["kind"] for o in custom} >= {"InferencePool"}
    for obj in objects:
        if obj["kind"] in CRD_FILES:
            validate_custom(obj)
        else:
            kubernetes_validate.validate(obj, kubernetes, strict=True)


def test_the_crd_schemas_refuse_what_they_should(tmp_path: Path) -> None:
    """The validation above has teeth: a pool the API server would refuse fails it."""
    pool = one(rendered(tmp_path, "picker"), "InferencePool", "rel-kvplane-pool")
    bad_mode = yaml.safe_load(yaml.safe_dump(pool))
    bad_mode["spec"]["endpointPickerRef"]["failureMode"] = "Open"
    misspelt = yaml.safe_load(yaml.safe_dump(pool))
    misspelt["spec"]["endpointPickerRef"]["failuremode"] = "FailOpen"
    no_ports = yaml.safe_load(yaml.safe_dump(pool))
    no_ports["spec"]["targetPorts"] = []
    for wrong in (bad_mode, misspelt, no_ports):
        with pytest.raises(jsonschema.ValidationError):
            validate_custom(wrong)


def test_the_pool_holds_what_its_crd_checks_in_cel(tmp_path: Path) -> None:
    # The InferencePool CRD's CEL rules, which jsonschema does not run, checked by hand;
    # a new rule in a newer vendored CRD fails here until it is checked too.
    schema = crd("InferencePool")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert cel_rules(schema) == {
        "self.kind != 'Service' || has(self.port)",
        "self.all(p1, self.exists_one(p2, p1.number==p2.number))",
    }
    for name in PICKER_SETS:
        (pool,) = by_kind(rendered(tmp_path, name), "InferencePool")
        ref = pool["spec"]["endpointPickerRef"]
        assert ref.get("kind", "Service") != "Service" or "port" in ref, name
        numbers = [port["number"] for port in pool["spec"]["targetPorts"]]
        assert len(numbers) == len(set(numbers)), name


@pytest.mark.parametrize("name", list(PICKER_SETS))
def test_the_pool_points_at_the_picker_service_and_the_router_listens_there(
    tmp_path: Path, name: str
) -> None:
    objects = rendered(tmp_path, name)
    (pool,) = by_kind(objects, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    ref = pool["spec"]["endpointPickerRef"]
    assert (ref.get("group", ""), ref.get("kind", "Service")) == ("", "Service")
    service = one(objects, "Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert (port["name"], port["appProtocol"]) == ("grpc", "http2")
    # The Service reaches the router pods' picker port, where the router listens.
    deployment = one(objects, "Deployment", "rel-kvplane-router")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    router = router_of(objects)
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    env = env_of(router)
    assert ports[port["targetPort"]] == int(env["KVPLANE_PICKER__PORT"])
    assert env["KVPLANE_PICKER__HOST"] == "0.0.0.0"  # the gateway dials the pod's IP
    expected = PICKER_SETS[name]["picker"].get("port", 9002)
    assert ref["port"]["number"] == expected == int(env["KVPLANE_PICKER__PORT"])


def test_the_failure_mode_passes_through(tmp_path: Path) -> None:
    def mode(name: str) -> str:
        (pool,) = by_kind(rendered(tmp_path, name), "InferencePool")
        failure_mode: str = pool["spec"]["endpointPickerRef"]["failureMode"]
        return failure_mode

    assert mode("picker") == "FailClose"  # the default: no picker, no request
    assert mode("picker-ha") == "FailOpen"
    with pytest.raises(RenderError, match="failureMode"):
        render(tmp_path, {"picker": {"enabled": True, "failureMode": "Open"}})


def test_the_pool_selects_the_engines_whose_agents_register(tmp_path: Path) -> None:
    for name in ("picker", "picker-plaintext"):
        objects = rendered(tmp_path, name)
        (pool,) = by_kind(objects, "InferencePool")
        (engines,) = by_kind(objects, "StatefulSet")
        labels = engines["spec"]["template"]["metadata"]["labels"]
        assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        assert pool["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "engine"
        engine_port = {p["name"]: p["containerPort"] for p in container(engines, "engine")["ports"]}
        assert pool["spec"]["targetPorts"] == [{"number": engine_port["http"]}], name
        # The picker answers with the address each agent advertises: it is in the pool.
        advertised = env_of(container(engines, "kvplane-agent"))["KVPLANE_AGENT__ADVERTISE_URL"]
        assert advertised == f"http://$(POD_IP):{engine_port['http']}", name
    (own,) = by_kind(rendered(tmp_path, "picker-own-engines"), "InferencePool")
    assert own["spec"]["selector"] == {"matchLabels": {"app": "my-vllm"}}
    assert own["spec"]["targetPorts"] == [{"number": 8000}, {"number": 8001}]


def test_probes_ask_the_picker_health_services_where_kubelet_can(tmp_path: Path) -> None:
    router = router_of(rendered(tmp_path, "picker-plaintext"))
    assert router["readinessProbe"]["grpc"] == {"port": 9100, "service": "readiness"}
    assert router["livenessProbe"]["grpc"] == {"port": 9100, "service": "liveness"}
    # Kubernetes' gRPC probes cannot speak TLS: a TLS picker keeps the router's probes.
    tls = router_of(rendered(tmp_path, "picker"))
    assert tls["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert tls["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert "grpc" not in {*tls["readinessProbe"], *tls["livenessProbe"]}


def mounted_file(deployment: dict[str, Any], box: dict[str, Any], path: str) -> tuple[str, str]:
    """The (Secret, key) a container's file comes from, through its mounts and volumes."""
    spec = deployment["spec"]["template"]["spec"]
    file = PurePosixPath(path)
    (mount,) = [m for m in box["volumeMounts"] if PurePosixPath(m["mountPath"]) == file.parent]
    assert mount["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    (item,) = [i for i in volume["secret"]["items"] if i["path"] == file.name]
    return volume["secret"]["secretName"], item["key"]


def test_tls_serves_a_mounted_pair(tmp_path: Path) -> None:
    # Default: the router's control-plane certificate, which names the picker's Service.
    objects = render(tmp_path, PICKER_SETS["picker"])
    deployment = one(objects, "Deployment", "rel-kvplane-router")
    router = router_of(objects)
    env = env_of(router)
    for variable, key in (
        ("KVPLANE_PICKER__TLS_CERT_FILE", "tls.crt"),
        ("KVPLANE_PICKER__TLS_KEY_FILE", "tls.key"),
    ):
        assert mounted_file(deployment, router, env[variable]) == ("rel-kvplane-router-tls", key)
    secret = one(objects, "Secret", "rel-kvplane-router-tls")
    certificate = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    dns = names.value.get_values_for_type(x509.DNSName)
    assert dns[0] == "rel-kvplane-router"  # what agents dial stays first
    assert {"rel-kvplane-picker", "rel-kvplane-picker.default.svc"} <= set(dns)
    issued = render(tmp_path, PICKER_SETS["picker"], api_versions=["cert-manager.io/v1"])
    assert (
        "rel-kvplane-picker"
        in one(issued, "Certificate", "rel-kvplane-router-tls")["spec"]["dnsNames"]
    )
    # A Secret of the operator's, mounted on a path of its own.
    objects = rendered(tmp_path, "picker-ha")
    deployment = one(objects, "Deployment", "rel-kvplane-router")
    router = router_of(objects)
    env = env_of(router)
    assert mounted_file(deployment, router, env["KVPLANE_PICKER__TLS_CERT_FILE"]) == (
        "kvplane-picker-tls",
        "tls.crt",
    )
    assert mounted_file(deployment, router, env["KVPLANE_PICKER__TLS_KEY_FILE"]) == (
        "kvplane-picker-tls",
        "tls.key",
    )
    # Plaintext: no pair at all.
    plain = rendered(tmp_path, "picker-plaintext")
    assert not [v for v in env_of(router_of(plain)) if v.startswith("KVPLANE_PICKER__TLS")]
    volumes = one(plain, "Deployment", "rel-kvplane-router")["spec"]["template"]["spec"]["volumes"]
    assert "picker-tls" not in {v["name"] for v in volumes}


def test_istio_dials_the_tls_picker_with_tls_where_its_api_exists(tmp_path: Path) -> None:
    istio = ["networking.istio.io/v1/DestinationRule"]
    objects = render(tmp_path, PICKER_SETS["picker"], api_versions=istio)
    rule = one(objects, "DestinationRule", "rel-kvplane-picker-tls")
    assert rule["apiVersion"] == "networking.istio.io/v1"
    service = one(objects, "Service", "rel-kvplane-picker")
    assert rule["spec"]["host"] == service["metadata"]["name"]  # in the rule's namespace
    assert rule["spec"]["trafficPolicy"]["tls"] == {"mode": "SIMPLE", "insecureSkipVerify": True}
    # Not without Istio's API, nor for a plaintext picker, nor when turned off.
    assert by_kind(rendered(tmp_path, "picker"), "DestinationRule") == []
    plaintext = render(tmp_path, PICKER_SETS["picker-plaintext"], api_versions=istio)
    assert by_kind(plaintext, "DestinationRule") == []
    off = {"picker": {"enabled": True, "tls": {"istioDestinationRule": False}}}
    assert by_kind(render(tmp_path, off, api_versions=istio), "DestinationRule") == []


def test_the_route_sends_the_gateway_traffic_to_the_pool(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "picker-ha")
    (pool,) = by_kind(objects, "InferencePool")
    route = one(objects, "HTTPRoute", "rel-kvplane")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [GATEWAY]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {
            "group": "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": pool["metadata"]["name"],
        }
    ]
    assert rule["timeouts"] == {"request": "300s"}
    validate_custom(route)
    assert by_kind(rendered(tmp_path, "picker"), "HTTPRoute") == []  # an example: asked for


def test_network_policies_let_the_gateway_reach_the_picker_and_the_engines(
    tmp_path: Path,
) -> None:
    objects = rendered(tmp_path, "picker")
    default_peers = [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"kvplane.io/gateway": "true"}}}
    ]

    def peers(policy: str, port: int, objects: list[dict[str, Any]]) -> list[Any]:
        rules = one(objects, "NetworkPolicy", policy)["spec"]["ingress"]
        return [r.get("from") for r in rules if {"port": port, "protocol": "TCP"} in r["ports"]]

    assert peers("rel-kvplane-router", 9002, objects) == [default_peers]
    # The gateway sends requests to the engine pods itself, beside the routers.
    routers = [{"podSelector": {"matchLabels": ROUTER_LABELS}}]
    assert peers("rel-kvplane-engines", 8000, objects) == [routers, default_peers]
    # gatewayFrom: [] opens those ports to any peer (no `from`).
    own = rendered(tmp_path, "picker-own-engines")
    assert peers("rel-kvplane-router", 9002, own) == [None]
    assert peers("rel-kvplane-engines", 8001, own) == [None]
    # Without picker mode the picker port is nowhere.
    plain = render(tmp_path, {})
    assert peers("rel-kvplane-router", 9002, plain) == []
    assert peers("rel-kvplane-engines", 8000, plain) == [routers]


def test_without_picker_mode_nothing_of_it_is_rendered(tmp_path: Path) -> None:
    objects = render(tmp_path, {})
    assert by_kind(objects, "InferencePool") == by_kind(objects, "HTTPRoute") == []
    assert "rel-kvplane-picker" not in {o["metadata"]["name"] for o in by_kind(objects, "Service")}
    router = router_of(objects)
    assert not [v for v in env_of(router) if v.startswith("KVPLANE_PICKER__")]
    assert "picker" not in {p["name"] for p in router["ports"]}
    assert router["readinessProbe"]["httpGet"]["path"] == "/readyz"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"router": {"replicas": 2}},
            "picker mode with more than one router replica needs the Redis index",
        ),
        (
            {"router": {"autoscaling": {"enabled": True, "maxReplicas": 4}}},
            "picker mode with more than one router replica needs the Redis index",
        ),
        ({"engines": {"enabled": False}}, "picker.inferencePool.selector must give"),
        (
            {"controlPlaneTls": {"enabled": False}},
            "picker.tls.enabled needs picker.tls.secretName",
        ),
        ({"picker": {"port": 50051}}, "picker.port must differ"),
        ({"picker": {"httpRoute": {"enabled": True}}}, "needs picker.httpRoute.parentRefs"),
        ({"picker": {"replicas": 2}}, "Additional property replicas is not allowed"),
        (
            {"picker": {"inferencePool": {"targetPorts": [1, 2, 3, 4, 5, 6, 7, 8, 9]}}},
            "targetPorts",
        ),
    ],
)
def test_picker_mode_refuses_what_would_not_work(
    tmp_path: Path, values: dict[str, Any], message: str
) -> None:
    values = {**values, "picker": {"enabled": True, **values.get("picker", {})}}
    with pytest.raises(RenderError, match=re.escape(message)):
        render(tmp_path, values)


def test_two_pickers_render_on_a_shared_redis(tmp_path: Path) -> None:
    for redis in ({"url": "redis://redis.cache.svc:6379/0"}, {"bundled": {"enabled": True}}):
        values = {"router": {"replicas": 2}, "redis": redis, "picker": {"enabled": True}}
        objects = render(tmp_path, values)
        config = one(objects, "ConfigMap", "rel-kvplane-router")["data"]["kvplane.toml"]
        assert 'backend = "redis"' in config
        assert one(objects, "Deployment", "rel-kvplane-router")["spec"]["replicas"] == 2

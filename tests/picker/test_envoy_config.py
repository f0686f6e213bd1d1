"""The Envoy bootstrap of `kvplane envoy-config` (router/picker/envoy_config.py): its
contents, pure, and the command; then, marked `heavy("envoy")`, a real Envoy 1.40
running it in front of tiny upstreams with a throwaway ext_proc picker written here, in
both body modes: the request goes where the picker says (header, metadata, no body, a
body in pieces, 8 MB), a client cannot steer it, a dead picker fails open or closed as
told, a comma list's next endpoint takes a refused connection's retry, active-active
pickers pass a dead one over, TLS to the picker, and when Envoy ends the picker's
stream."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import httpx
import pytest
from aiohttp import web
from envoy.config.core.v3 import base_pb2 as core_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvplane.cli import main
from kvplane.core.serving import free_port
from router.picker import envoy_config
from router.picker.envoy_config import (
    CIRCUIT_BREAKER_LIMIT,
    DESTINATION_HEADER,
    EXT_PROC_SERVICE,
    PICKER_CLUSTER,
    SERVED_HEADER,
    WORKERS_CLUSTER,
    BodyMode,
    EnvoyConfigError,
    build_bootstrap,
    parse_host_port,
    render,
)
from tests import heavy
from tests.certificates import self_signed
from tests.picker.envoy import RunningEnvoy, running_envoy
from tests.waiting import wait_until

ENVOY = pytest.mark.heavy("envoy")
BODY_MODES = [BodyMode.FULL_DUPLEX, BodyMode.BUFFERED]
WORKERS = ["10.0.0.1:8000", "10.0.0.2:8000"]


# --- the bootstrap, pure -----------------------------------------------------------


def _filters(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    (listener,) = bootstrap["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (manager,) = chain["filters"]
    filters: list[dict[str, Any]] = manager["typed_config"]["http_filters"]
    return filters


def _ext_proc(bootstrap: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = _filters(bootstrap)[1]["typed_config"]
    return config


def _cluster(bootstrap: dict[str, Any], name: str) -> dict[str, Any]:
    clusters = bootstrap["static_resources"]["clusters"]
    (cluster,) = [cluster for cluster in clusters if cluster["name"] == name]
    return cluster  # type: ignore[no-any-return]


def _addresses(cluster: dict[str, Any]) -> list[str]:
    (locality,) = cluster["load_assignment"]["endpoints"]
    sockets = [entry["endpoint"]["address"]["socket_address"] for entry in locality["lb_endpoints"]]
    return [f"{socket['address']}|{socket['port_value']}" for socket in sockets]


def test_client_headers_are_stripped_before_the_picker_then_the_router_sends() -> None:
    filters = _filters(build_bootstrap(endpoints=WORKERS))
    assert [entry["name"] for entry in filters] == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.router",
    ]
    removed = filters[0]["typed_config"]["mutations"]["request_mutations"]
    assert removed == [{"remove": DESTINATION_HEADER}, {"remove": SERVED_HEADER}]


@pytest.mark.parametrize("fail_open", [False, True])
def test_fail_open_is_envoys_failure_mode_allow(fail_open: bool) -> None:
    config = _ext_proc(build_bootstrap(endpoints=WORKERS, fail_open=fail_open))
    assert config["failure_mode_allow"] is fail_open


@pytest.mark.parametrize(
    ("body_mode", "envoy_mode", "trailers"),
    [
        (BodyMode.FULL_DUPLEX, "FULL_DUPLEX_STREAMED", "SEND"),
        (BodyMode.BUFFERED, "BUFFERED", "SKIP"),
    ],
)
def test_body_modes(body_mode: BodyMode, envoy_mode: str, trailers: str) -> None:
    config = _ext_proc(build_bootstrap(endpoints=WORKERS, body_mode=body_mode))
    assert config["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": envoy_mode,
        "request_trailer_mode": trailers,  # Envoy refuses FULL_DUPLEX_STREAMED without
        "response_header_mode": "SKIP",
        "response_body_mode": "NONE",
        "response_trailer_mode": "SKIP",
    }
    assert config["grpc_service"] == {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}}
    assert config["metadata_options"] == {
        "receiving_namespaces": {"untyped": ["envoy.lb"]},
        "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint", "envoy.lb"]},
    }
    assert config["message_timeout"] == "30s"


@pytest.mark.parametrize(
    ("body_mode", "response_mode", "trailers"),
    [
        (BodyMode.FULL_DUPLEX, "FULL_DUPLEX_STREAMED", "SEND"),
        (BodyMode.BUFFERED, "STREAMED", "SKIP"),
    ],
)
def test_the_response_body_option_streams_every_answer_through_the_picker(
    body_mode: BodyMode, response_mode: str, trailers: str
) -> None:
    config = _ext_proc(build_bootstrap(endpoints=WORKERS, body_mode=body_mode, response_body=True))
    mode = config["processing_mode"]
    assert mode["response_header_mode"] == "SEND"
    assert mode["response_body_mode"] == response_mode  # never BUFFERED: answers stream
    assert mode["response_trailer_mode"] == trailers


def test_the_default_is_full_duplex_and_fail_closed() -> None:
    config = _ext_proc(build_bootstrap(endpoints=WORKERS))
    assert config["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert config["failure_mode_allow"] is False


def test_the_workers_are_static_and_the_picker_chooses_among_them() -> None:
    bootstrap = build_bootstrap(endpoints=[*WORKERS, "[::0:1]:9000"])
    workers = _cluster(bootstrap, WORKERS_CLUSTER)
    assert workers["type"] == "STATIC"
    assert _addresses(workers) == ["10.0.0.1|8000", "10.0.0.2|8000", "::1|9000"]
    (policy,) = workers["load_balancing_policy"]["policies"]
    override = policy["typed_extension_config"]
    assert override["name"] == "envoy.load_balancing_policies.override_host"
    assert override["typed_config"]["override_host_sources"] == [
        {"header": DESTINATION_HEADER},
        {"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION_HEADER}]}},
    ]
    (fallback,) = override["typed_config"]["fallback_policy"]["policies"]
    assert fallback["typed_extension_config"]["name"] == "envoy.load_balancing_policies.round_robin"
    (threshold, _) = workers["circuit_breakers"]["thresholds"]
    assert threshold["max_requests"] == CIRCUIT_BREAKER_LIMIT


def test_the_route_retries_refused_connections_and_never_times_out() -> None:
    (listener,) = build_bootstrap(endpoints=WORKERS, retries=3)["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert manager["codec_type"] == "AUTO"
    (host,) = manager["route_config"]["virtual_hosts"]
    (route,) = host["routes"]
    assert route["route"] == {
        "cluster": WORKERS_CLUSTER,
        "timeout": "0s",
        "retry_policy": {"retry_on": "connect-failure,refused-stream,reset", "num_retries": 3},
    }
    assert route["request_body_buffer_limit"] == 32 * 1024 * 1024  # kvplane's own limit


def test_several_pickers_speak_http2_health_checked_with_raised_circuit_breakers() -> None:
    bootstrap = build_bootstrap(endpoints=WORKERS, pickers=["10.1.0.1:9002", "10.1.0.2:9002"])
    picker = _cluster(bootstrap, PICKER_CLUSTER)
    assert picker["type"] == "STATIC"
    assert _addresses(picker) == ["10.1.0.1|9002", "10.1.0.2|9002"]
    options = picker["typed_extension_protocol_options"]
    (http,) = options.values()
    assert http["explicit_http_config"] == {"http2_protocol_options": {}}
    for threshold in picker["circuit_breakers"]["thresholds"]:
        assert threshold["max_requests"] == threshold["max_pending_requests"] == 40_000
    (check,) = picker["health_checks"]
    assert check["grpc_health_check"] == {"service_name": EXT_PROC_SERVICE}
    assert check["interval"] == check["no_traffic_interval"] == "1s"
    assert "transport_socket" not in picker


def test_a_dead_picker_is_never_tried_so_that_fail_open_works_in_full_duplex() -> None:
    picker = _cluster(build_bootstrap(endpoints=WORKERS), PICKER_CLUSTER)
    assert picker["common_lb_config"] == {"healthy_panic_threshold": {"value": 0}}
    outliers = picker["outlier_detection"]
    assert outliers["consecutive_gateway_failure"] == 1
    assert outliers["enforcing_consecutive_gateway_failure"] == 100
    assert outliers["enforcing_consecutive_5xx"] == 0  # a picker's own error ejects nothing
    assert outliers["max_ejection_percent"] == 100


def test_a_picker_named_by_dns_makes_its_cluster_resolve_names() -> None:
    bootstrap = build_bootstrap(endpoints=WORKERS, pickers=["picker.kvplane.svc:9002"])
    assert _cluster(bootstrap, PICKER_CLUSTER)["type"] == "STRICT_DNS"


def test_picker_tls_does_not_verify_the_certificate() -> None:
    bootstrap = build_bootstrap(endpoints=WORKERS, pickers=["epp.svc:9002"], picker_tls=True)
    socket = _cluster(bootstrap, PICKER_CLUSTER)["transport_socket"]
    assert socket["name"] == "envoy.transport_sockets.tls"
    context = socket["typed_config"]
    assert context["common_tls_context"] == {"alpn_protocols": ["h2"]}  # no validation
    assert context["sni"] == "epp.svc"


def test_the_listener_and_the_admin_interface() -> None:
    bootstrap = build_bootstrap(endpoints=WORKERS, listen="0.0.0.0:8080", admin_port=9000)
    (listener,) = bootstrap["static_resources"]["listeners"]
    assert listener["address"] == {"socket_address": {"address": "0.0.0.0", "port_value": 8080}}
    assert bootstrap["admin"]["address"] == {
        "socket_address": {"address": "127.0.0.1", "port_value": 9000}
    }


def test_client_connections_are_capped() -> None:
    (monitor,) = build_bootstrap(endpoints=WORKERS)["overload_manager"]["resource_monitors"]
    assert monitor["name"] == "envoy.resource_monitors.global_downstream_max_connections"
    assert monitor["typed_config"]["max_active_downstream_connections"] == 50_000


def test_render_is_json_that_reads_back() -> None:
    bootstrap = build_bootstrap(endpoints=WORKERS)
    assert json.loads(render(bootstrap)) == bootstrap


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "expected HOST:PORT"),
        ("10.0.0.1", "expected HOST:PORT"),
        ("10.0.0.1:", "is not a port"),
        ("10.0.0.1:0", "is not a port"),
        ("10.0.0.1:65536", "is not a port"),
        ("10.0.0.1:http", "is not a port"),
        ("::1:8000", "in brackets"),
        ("[::1]8000", r"\[IPV6\]:PORT"),
        ("[10.0.0.1]:8000", "not an IPv6 address"),
        ("worker-1:8000", "not an IP address"),
        ("10.0.0.256:8000", "not an IP address"),
    ],
)
def test_an_endpoint_must_be_an_ip_and_a_port(text: str, why: str) -> None:
    with pytest.raises(EnvoyConfigError, match=why) as refused:
        build_bootstrap(endpoints=[WORKERS[0], text])
    assert str(refused.value).startswith(f"--endpoint {text!r}: ")


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"endpoints": []}, "no --endpoint"),
        ({"endpoints": [WORKERS[0], WORKERS[0]]}, "given twice"),
        ({"pickers": []}, "no --picker"),
        ({"pickers": ["picker_1:9002"]}, "not a host name"),
        ({"pickers": ["-picker:9002"]}, "not a host name"),
        ({"listen": "localhost:8080"}, "--listen 'localhost:8080'"),
        ({"admin_port": 0}, "--admin-port"),
        ({"listen": "127.0.0.1:9901"}, "the listener's port"),
        ({"message_timeout_s": 0}, "message timeout 0"),
        ({"message_timeout_s": float("nan")}, "message timeout nan"),
        ({"health_check_interval_s": -1}, "health check interval"),
        ({"retries": -1}, "retries -1"),
        ({"max_body_bytes": 0}, "max body bytes 0"),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], why: str) -> None:
    with pytest.raises(EnvoyConfigError, match=why):
        build_bootstrap(**{"endpoints": WORKERS, **options})


def test_addresses_are_written_as_envoy_names_them() -> None:
    assert str(parse_host_port("[0:0::1]:80", "--endpoint", ip_only=True)) == "[::1]:80"
    assert str(parse_host_port("10.0.0.1:80", "--endpoint", ip_only=True)) == "10.0.0.1:80"
    assert str(parse_host_port("epp.svc:9002", "--picker", ip_only=False)) == "epp.svc:9002"


# --- `kvplane envoy-config` --------------------------------------------------------


def test_the_command_prints_the_bootstrap(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["envoy-config", "--endpoint", WORKERS[0], "--endpoint", WORKERS[1],
            "--picker", "10.1.0.1:9002", "--picker", "10.1.0.2:9002", "--listen",
            "0.0.0.0:8080", "--body-mode", "buffered", "--fail-open", "--admin-port", "9000",
            "--picker-tls"]  # fmt: skip
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == build_bootstrap(
        endpoints=WORKERS,
        pickers=["10.1.0.1:9002", "10.1.0.2:9002"],
        listen="0.0.0.0:8080",
        body_mode=BodyMode.BUFFERED,
        fail_open=True,
        admin_port=9000,
        picker_tls=True,
    )


def test_the_commands_defaults_are_the_builders(tmp_path: Path) -> None:
    output = tmp_path / "envoy.yaml"
    assert main(["envoy-config", "--endpoint", WORKERS[0], "--output", str(output)]) == 0
    assert json.loads(output.read_text()) == build_bootstrap(endpoints=[WORKERS[0]])
    assert envoy_config.DEFAULT_PICKER == "127.0.0.1:9002"
    assert envoy_config.DEFAULT_LISTEN == "127.0.0.1:10000"
    assert envoy_config.DEFAULT_ADMIN_PORT == 9901


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "kvplane: envoy-config: no --endpoint: name every worker (IP:PORT)"),
        (["--endpoint", "worker-1:8000"], "kvplane: envoy-config: --endpoint 'worker-1:8000': "),
        (["--endpoint", WORKERS[0], "--picker", "x:y"], "kvplane: envoy-config: --picker 'x:y'"),
    ],
)
def test_the_command_refuses_bad_input_in_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["envoy-config", *args])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(message)
    assert captured.err.count("\n") == 1


# --- a real Envoy ------------------------------------------------------------------


@ENVOY
@pytest.mark.parametrize("body_mode", BODY_MODES)
@pytest.mark.parametrize("picker_tls", [False, True], ids=["plain", "tls"])
def test_envoy_accepts_the_bootstrap(body_mode: BodyMode, picker_tls: bool, tmp_path: Path) -> None:
    bootstrap = build_bootstrap(
        endpoints=[*WORKERS, "[::1]:8000"],
        pickers=["127.0.0.1:9002", "localhost:9003"],
        body_mode=body_mode,
        fail_open=True,
        picker_tls=picker_tls,
    )
    config = tmp_path / "envoy.yaml"  # JSON is YAML: what an operator would name it
    config.write_text(render(bootstrap))
    checked = subprocess.run(
        [str(heavy.envoy_binary()), "--mode", "validate", "-c", str(config),
         "--disable-hot-restart", "-l", "warning"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "warning" not in checked.stdout + checked.stderr


@dataclass(frozen=True, slots=True)
class Answer:
    """What the throwaway picker names: `destination` (IP:PORT[,IP:PORT...]) in the
    header, the `envoy.lb` metadata or both; None names nothing."""

    destination: str | None
    header: bool = True
    metadata: bool = True


@dataclass
class Stream:
    """One ext_proc stream as the picker saw it: (seconds, what) events."""

    events: list[tuple[float, str]] = field(default_factory=list)

    @property
    def ended(self) -> bool:
        return any(event == "done" for _, event in self.events)

    @property
    def ended_at(self) -> float:
        """When Envoy ended it: a half-close or a cancellation (it does either)."""
        ends = ("envoy ended the stream", "done")
        return min(moment for moment, event in self.events if event in ends)

    def at(self, what: str) -> float:
        moments = [moment for moment, event in self.events if event == what]
        assert moments, f"no {what!r} in {self.events}"
        return moments[0]


class ThrowawayPicker:
    """An endpoint picker as small as the protocol allows (GAIE's protocol, the message
    sequences llm-d's picker follows): BUFFERED, it answers the headers with nothing and
    the body with the mutation; FULL_DUPLEX_STREAMED, it holds the body to its end, then
    answers the headers with the mutation and sends the body back as streamed chunks; a
    request without a body gets the mutation on its headers. It ends the stream once it
    has answered, unless `hold`, where it waits for Envoy to end it."""

    def __init__(self, answer: Answer, *, hold: bool = False) -> None:
        self.answer = answer
        self.hold = hold
        self.streams: list[Stream] = []

    def _mutation(self) -> Any:
        common = ext_proc_pb2.CommonResponse()
        if self.answer.destination is not None and self.answer.header:
            option = core_pb2.HeaderValueOption(
                header=core_pb2.HeaderValue(
                    key=DESTINATION_HEADER, raw_value=self.answer.destination.encode()
                ),
                append_action=core_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            common.header_mutation.set_headers.append(option)
            common.clear_route_cache = True
        return common

    def _with_metadata(self, response: Any) -> Any:
        if self.answer.destination is not None and self.answer.metadata:
            metadata = struct_pb2.Struct()
            metadata.update({"envoy.lb": {DESTINATION_HEADER: self.answer.destination}})
            response.dynamic_metadata.CopyFrom(metadata)
        return response

    def _headers_answer(self) -> Any:
        return self._with_metadata(
            ext_proc_pb2.ProcessingResponse(
                request_headers=ext_proc_pb2.HeadersResponse(response=self._mutation())
            )
        )

    async def Process(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        stream = Stream()
        self.streams.append(stream)

        def note(what: str) -> None:
            stream.events.append((time.monotonic(), what))

        full_duplex = False
        chunks: list[bytes] = []
        try:
            async for request in requests:
                kind = request.WhichOneof("request")
                note(kind)
                if request.HasField("protocol_config"):  # on the first message
                    mode = request.protocol_config.request_body_mode
                    full_duplex = mode == mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
                if kind == "request_headers" and request.request_headers.end_of_stream:
                    yield self._headers_answer()  # no body
                elif kind == "request_headers" and not full_duplex:
                    yield ext_proc_pb2.ProcessingResponse(
                        request_headers=ext_proc_pb2.HeadersResponse()
                    )
                    continue
                elif kind == "request_headers":
                    continue  # answered once the body is in
                elif kind == "request_body" and not full_duplex:
                    yield self._with_metadata(
                        ext_proc_pb2.ProcessingResponse(
                            request_body=ext_proc_pb2.BodyResponse(response=self._mutation())
                        )
                    )
                elif kind == "request_body":
                    chunks.append(request.request_body.body)
                    if not request.request_body.end_of_stream:
                        continue
                    yield self._headers_answer()
                    for chunk in _streamed(b"".join(chunks)):
                        yield ext_proc_pb2.ProcessingResponse(request_body=chunk)
                else:
                    raise AssertionError(f"unexpected {kind} from Envoy")
                note("answered")
                if not self.hold:
                    return
            note("envoy ended the stream")
        finally:
            note("done")


def _streamed(body: bytes) -> Iterator[Any]:
    """The body back as FULL_DUPLEX_STREAMED chunks (llm-d cuts at 62,000 bytes)."""
    pieces = [body[start : start + 62_000] for start in range(0, len(body), 62_000)] or [b""]
    for number, piece in enumerate(pieces, 1):
        streamed = ext_proc_pb2.StreamedBodyResponse(
            body=piece, end_of_stream=number == len(pieces)
        )
        yield ext_proc_pb2.BodyResponse(
            response=ext_proc_pb2.CommonResponse(
                body_mutation=ext_proc_pb2.BodyMutation(streamed_response=streamed)
            )
        )


@asynccontextmanager
async def serving(picker: ThrowawayPicker, *, tls: bool = False) -> AsyncIterator[str]:
    """The picker and gRPC health (serving ExternalProcessor) on a free port: its address."""
    # BUFFERED, the whole body comes in one message: gRPC's default limit is 4 MiB
    limit = envoy_config.MAX_BODY_BYTES + 1024 * 1024
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit)])
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    checks = health.aio.HealthServicer()
    await checks.set(EXT_PROC_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    address = f"127.0.0.1:{free_port()}"
    if tls:
        server.add_secure_port(address, grpc.ssl_server_credentials([tuple(self_signed())]))
    else:
        server.add_insecure_port(address)
    await server.start()
    try:
        yield address
    finally:
        await server.stop(0)


@asynccontextmanager
async def upstreams(*names: str) -> AsyncIterator[dict[str, str]]:
    """A tiny HTTP server for each name, answering which it is, what it received (the
    body's length and digest, the destination header) after `?delay=S` seconds:
    name -> IP:PORT."""

    def app(name: str) -> web.Application:
        async def answer(request: web.Request) -> web.Response:
            body = await request.read()
            await asyncio.sleep(float(request.query.get("delay", "0")))
            return web.json_response(
                {
                    "name": name,
                    "bytes": len(body),
                    "sha256": hashlib.sha256(body).hexdigest(),
                    "destination": request.headers.get(DESTINATION_HEADER),
                }
            )

        application = web.Application(client_max_size=64 * 1024 * 1024)
        application.router.add_route("*", "/{path:.*}", answer)
        return application

    runners: list[web.AppRunner] = []
    addresses: dict[str, str] = {}
    try:
        for name in names:
            runner = web.AppRunner(app(name), access_log=None)
            runners.append(runner)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            addresses[name] = f"127.0.0.1:{port}"
        yield addresses
    finally:
        for runner in runners:
            await runner.cleanup()


BODY = json.dumps({"model": "m", "prompt": "x" * 150_000}).encode()  # several chunks


async def _post(
    envoy: RunningEnvoy, body: bytes = BODY, *, destination: str | None = None
) -> httpx.Response:
    """A completion request, naming `destination` itself if told to (as no client may)."""
    headers = {} if destination is None else {DESTINATION_HEADER: destination}
    async with httpx.AsyncClient(timeout=30.0) as client:
        return await client.post(envoy.url + "/v1/completions", content=body, headers=headers)


def _served_by(response: httpx.Response, body: bytes = BODY) -> str:
    assert response.status_code == 200, response.text
    echoed = response.json()
    assert echoed["bytes"] == len(body)
    assert echoed["sha256"] == hashlib.sha256(body).hexdigest()  # the body came through
    return str(echoed["name"])


@ENVOY
@pytest.mark.parametrize("body_mode", BODY_MODES)
async def test_the_request_reaches_the_endpoint_the_picker_names(
    body_mode: BodyMode, tmp_path: Path
) -> None:
    async with upstreams("a", "b") as workers:
        picker = ThrowawayPicker(Answer(workers["b"]))
        async with (
            serving(picker) as picker_address,
            running_envoy(
                tmp_path,
                endpoints=list(workers.values()),
                pickers=[picker_address],
                body_mode=body_mode,
            ) as envoy,
        ):
            for header, metadata in [(True, True), (True, False), (False, True)]:
                for name in ("a", "b"):
                    picker.answer = Answer(workers[name], header=header, metadata=metadata)
                    for _ in range(2):  # not round robin's luck
                        assert _served_by(await _post(envoy)) == name
                    assert _served_by(await _post(envoy, b""), b"") == name
                    async with httpx.AsyncClient(timeout=30.0) as client:
                        got = await client.get(envoy.url + "/v1/models")
                    assert _served_by(got, b"") == name
            # a body sent in pieces, as a client that streams its upload does
            picker.answer = Answer(workers["a"])

            async def pieces() -> AsyncIterator[bytes]:
                for start in range(0, len(BODY), 40_000):
                    yield BODY[start : start + 40_000]
                    await asyncio.sleep(0.01)

            async with httpx.AsyncClient(timeout=30.0) as client:
                got = await client.post(envoy.url + "/v1/completions", content=pieces())
            assert _served_by(got) == "a"
            failures = await envoy.stats(r"ext_proc\.(streams_failed|spurious_msgs_received)")
            assert set(failures.values()) == {0}, failures


@ENVOY
@pytest.mark.parametrize("body_mode", BODY_MODES)
async def test_a_client_cannot_name_its_own_endpoint(body_mode: BodyMode, tmp_path: Path) -> None:
    async with upstreams("a", "b") as workers:
        picker = ThrowawayPicker(Answer(None))  # names nothing: round robin chooses
        async with (
            serving(picker) as picker_address,
            running_envoy(
                tmp_path,
                endpoints=list(workers.values()),
                pickers=[picker_address],
                body_mode=body_mode,
            ) as envoy,
        ):
            served = []
            for _ in range(4):
                response = await _post(envoy, destination=workers["a"])
                served.append(_served_by(response))
                assert response.json()["destination"] is None  # stripped on the way in
            assert sorted(served) == ["a", "a", "b", "b"]


@ENVOY
@pytest.mark.parametrize("body_mode", BODY_MODES)
async def test_with_the_picker_down_fail_open_reaches_an_endpoint(
    body_mode: BodyMode, tmp_path: Path
) -> None:
    dead_picker = f"127.0.0.1:{free_port()}"
    async with (
        upstreams("a", "b") as workers,
        running_envoy(
            tmp_path,
            endpoints=list(workers.values()),
            pickers=[dead_picker],
            body_mode=body_mode,
            fail_open=True,
        ) as envoy,
    ):
        served = [_served_by(await _post(envoy, destination=workers["a"])) for _ in range(4)]
        assert sorted(served) == ["a", "a", "b", "b"]  # and the client's header is ignored
        assert (await envoy.stats(r"ext_proc\.failure_mode_allowed$")).popitem()[1] == 4


@ENVOY
@pytest.mark.parametrize("body_mode", BODY_MODES)
async def test_with_the_picker_down_fail_closed_answers_500(
    body_mode: BodyMode, tmp_path: Path
) -> None:
    dead_picker = f"127.0.0.1:{free_port()}"
    async with (
        upstreams("a") as workers,
        running_envoy(
            tmp_path, endpoints=list(workers.values()), pickers=[dead_picker], body_mode=body_mode
        ) as envoy,
    ):
        for _ in range(2):
            response = await _post(envoy, destination=workers["a"])
            assert response.status_code == 500
        upstream = await envoy.stats(rf"cluster\.{WORKERS_CLUSTER}\.upstream_rq_total$")
        assert set(upstream.values()) == {0}


@ENVOY
@pytest.mark.parametrize("body_mode", BODY_MODES)
async def test_a_refused_connection_goes_to_the_next_endpoint_of_the_list(
    body_mode: BodyMode, tmp_path: Path
) -> None:
    refusing = f"127.0.0.1:{free_port()}"  # a listed worker with nothing listening
    async with upstreams("a", "b") as workers:
        picker = ThrowawayPicker(Answer(f"{refusing},{workers['b']}"))
        async with (
            serving(picker) as picker_address,
            running_envoy(
                tmp_path,
                endpoints=[refusing, workers["a"], workers["b"]],
                pickers=[picker_address],
                body_mode=body_mode,
            ) as envoy,
        ):
            for _ in range(3):
                assert _served_by(await _post(envoy)) == "b"  # never round robin's a
            retries = await envoy.stats(rf"cluster\.{WORKERS_CLUSTER}\.upstream_rq_retry$")
            assert set(retries.values()) == {3}


@ENVOY
async def test_active_active_pickers_a_dead_one_is_passed_over(tmp_path: Path) -> None:
    """Fail closed, so that a request sent to a dead picker would be a 500: one down
    from the start gets none, one that dies costs at most the request that finds it
    dead (outlier detection), then the survivor takes every request."""
    dead_from_the_start = f"127.0.0.1:{free_port()}"
    async with upstreams("a", "b") as workers, AsyncExitStack() as first_picker:
        dying = ThrowawayPicker(Answer(workers["b"]))
        surviving = ThrowawayPicker(Answer(workers["b"]))
        dying_address = await first_picker.enter_async_context(serving(dying))
        async with (
            serving(surviving) as surviving_address,
            running_envoy(
                tmp_path,
                endpoints=list(workers.values()),
                pickers=[dead_from_the_start, dying_address, surviving_address],
            ) as envoy,
        ):
            for _ in range(6):
                assert _served_by(await _post(envoy)) == "b"
            assert len(dying.streams) == len(surviving.streams) == 3  # round robin
            await first_picker.aclose()
            statuses = [(await _post(envoy)).status_code for _ in range(10)]
            # the one that finds it dead is the first or, round robin, the second
            assert statuses.count(500) <= 1, statuses
            assert set(statuses[2:]) == {200}, statuses
            assert len(dying.streams) == 3


@ENVOY
@pytest.mark.parametrize("body_mode", BODY_MODES)
async def test_a_picker_that_dies_under_fail_open(body_mode: BodyMode, tmp_path: Path) -> None:
    """BUFFERED, Envoy lets the request through unpicked; FULL_DUPLEX_STREAMED, the one
    request that finds the picker dead once its body is on the way gets a 500 (Envoy
    fails open only before the first body chunk leaves), the next ones pass: outlier
    detection has ejected the picker, and the stream fails before it starts."""
    async with upstreams("a", "b") as workers, AsyncExitStack() as picker_running:
        picker = ThrowawayPicker(Answer(workers["b"]))
        picker_address = await picker_running.enter_async_context(serving(picker))
        async with running_envoy(
            tmp_path,
            endpoints=list(workers.values()),
            pickers=[picker_address],
            body_mode=body_mode,
            fail_open=True,
        ) as envoy:
            assert _served_by(await _post(envoy)) == "b"
            await picker_running.aclose()
            statuses = [(await _post(envoy)).status_code for _ in range(10)]
            allowed_500s = 1 if body_mode is BodyMode.FULL_DUPLEX else 0
            assert statuses.count(500) <= allowed_500s, statuses
            assert set(statuses[allowed_500s:]) == {200}, statuses


@ENVOY
@pytest.mark.parametrize("body_mode", BODY_MODES)
async def test_a_large_body_goes_through_and_is_retried(
    body_mode: BodyMode, tmp_path: Path
) -> None:
    """8 MB: over Envoy's default buffer of 1 MiB (a 507 on a retry, a 413 buffered) and
    gRPC's default message of 4 MiB (the picker's limit is raised here)."""
    body = b"x" * 8_000_000
    refusing = f"127.0.0.1:{free_port()}"
    async with upstreams("a", "b") as workers:
        picker = ThrowawayPicker(Answer(f"{refusing},{workers['b']}"))
        async with (
            serving(picker) as picker_address,
            running_envoy(
                tmp_path,
                endpoints=[refusing, *workers.values()],
                pickers=[picker_address],
                body_mode=body_mode,
            ) as envoy,
        ):
            assert _served_by(await _post(envoy, body), body) == "b"


@ENVOY
async def test_a_list_in_both_header_and_metadata_is_tried_twice(tmp_path: Path) -> None:
    """Envoy's override_host joins its sources: named in both (as the protocol asks),
    two refusing endpoints take all three attempts (two retries), the first twice;
    named in one, the third attempt would go round robin."""
    refusing = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    async with upstreams("a") as workers:
        picker = ThrowawayPicker(Answer(",".join(refusing)))
        async with (
            serving(picker) as picker_address,
            running_envoy(
                tmp_path, endpoints=[*refusing, workers["a"]], pickers=[picker_address]
            ) as envoy,
        ):
            assert (await _post(envoy)).status_code == 503
            hosts = await envoy.hosts(WORKERS_CLUSTER)
            assert [hosts[host]["cx_connect_fail"] for host in refusing] == ["2", "1"]
            assert hosts[workers["a"]]["rq_total"] == "0"


@ENVOY
async def test_the_picker_over_tls_without_verification(tmp_path: Path) -> None:
    async with upstreams("a", "b") as workers:
        picker = ThrowawayPicker(Answer(workers["a"]))
        async with (
            serving(picker, tls=True) as picker_address,
            running_envoy(
                tmp_path,
                endpoints=list(workers.values()),
                pickers=[picker_address],
                picker_tls=True,
            ) as envoy,
        ):
            for _ in range(2):
                assert _served_by(await _post(envoy)) == "a"


@ENVOY
@pytest.mark.parametrize(
    ("body_mode", "ended_by_envoy_before_the_upstream_answers"),
    [(BodyMode.FULL_DUPLEX, True), (BodyMode.BUFFERED, False)],
)
async def test_when_envoy_ends_the_stream_of_a_picker_that_keeps_it_open(
    body_mode: BodyMode, ended_by_envoy_before_the_upstream_answers: bool, tmp_path: Path
) -> None:
    """With the response phase skipped, Envoy 1.40 ends the ext_proc stream right after
    the picker's last answer in FULL_DUPLEX_STREAMED mode, but only when the exchange
    is over in BUFFERED mode: there a picker must end the stream itself (and ours does,
    see the tests above), or hold it for the whole response."""
    delay_s = 0.5
    async with upstreams("a") as workers:
        picker = ThrowawayPicker(Answer(workers["a"]), hold=True)
        async with (
            serving(picker) as picker_address,
            running_envoy(
                tmp_path, endpoints=list(workers.values()), pickers=[picker_address],
                body_mode=body_mode,
            ) as envoy,
        ):  # fmt: skip
            async with httpx.AsyncClient(timeout=30.0) as client:
                response = await client.post(
                    envoy.url + f"/v1/completions?delay={delay_s}", content=BODY
                )
            assert _served_by(response) == "a"
            (stream,) = picker.streams
            await wait_until("the stream's end", lambda: stream.ended)
            ended_after_answer_s = stream.ended_at - stream.at("answered")
            if ended_by_envoy_before_the_upstream_answers:
                assert ended_after_answer_s < delay_s / 2
            else:
                assert ended_after_answer_s >= delay_s * 0.9

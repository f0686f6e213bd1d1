"""Prefill/decode disaggregation with real processes: `kvplane engine-sim` in both roles
(NixlConnector's protocol, its transfers modelled), `kvplane agent --role` beside each,
and `kvplane router` splitting requests, as an operator runs them
(docs/pd-disaggregation.md). Every way a split request can go otherwise is counted."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvplane.core.serving import free_port
from simulations.processes import spawn_kvplane
from tests.metrics_text import sample_sum

pytestmark = pytest.mark.slow

ADMIN_TOKEN = "pd-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
MODEL = "kvplane-tiny"
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


@dataclass(frozen=True, slots=True)
class Fleet:
    router_url: str
    engines: dict[str, str]  # worker id -> engine URL

    def metric(self, name: str, **labels: str) -> float:
        return sample_sum(
            httpx.get(self.router_url + "/metrics", headers=ADMIN).text, name, **labels
        )

    def engine_metric(self, worker_id: str, name: str) -> float:
        return sample_sum(httpx.get(self.engines[worker_id] + "/metrics").text, name)

    def fault(self, worker_ids: Sequence[str], **fault: Any) -> None:
        for worker_id in worker_ids:
            response = httpx.post(self.engines[worker_id] + "/sim/faults", json=fault)
            assert response.status_code == 200, response.text

    def workers(self) -> dict[str, dict[str, Any]]:
        answer = httpx.get(self.router_url + "/fleet/workers", headers=ADMIN).json()
        return {row["worker_id"]: row for row in answer["workers"]}


@contextmanager
def pd_fleet(
    roles: dict[str, str], router_env: dict[str, str], **kv_transfer: str
) -> Iterator[Fleet]:
    """A router and, per worker id, an engine simulator with NixlConnector (and
    `kv_transfer`'s settings) and an agent registering it with its role."""
    grpc_port, http_port = free_port(), free_port()
    router_url = f"http://127.0.0.1:{http_port}"
    with ExitStack() as stack:
        stack.enter_context(
            spawn_kvplane(
                ["router", "--grpc-port", str(grpc_port), "--http-port", str(http_port)],
                router_url + "/healthz",
                env={"KVPLANE_HTTP__ADMIN_TOKEN": ADMIN_TOKEN, **router_env},
            )
        )
        engines = {}
        for worker_id, role in roles.items():
            port, events = free_port(), free_port()
            engine_url = engines[worker_id] = f"http://127.0.0.1:{port}"
            stack.enter_context(
                spawn_kvplane(
                    ["engine-sim", "--port", str(port), "--time-scale", "0",
                     "--kv-transfer-config", json.dumps(NIXL | kv_transfer),
                     "--kv-events-config",
                     json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events}"})],
                    engine_url + "/health",
                )
            )  # fmt: skip
            stack.enter_context(
                spawn_kvplane(
                    ["agent", "--worker-id", worker_id, "--engine-url", engine_url, "--role", role,
                     "--load-interval-s", "0.2",
                     "--kv-events-endpoint", f"tcp://127.0.0.1:{events}",
                     "--control-plane-address", f"127.0.0.1:{grpc_port}"],
                    None,
                )
            )  # fmt: skip
        fleet = Fleet(router_url, engines)
        _wait_for(lambda: set(fleet.workers()) == set(roles), "every worker registered")
        yield fleet


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


PREFILL = ("prefill-a", "prefill-b")


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    roles = {"prefill-a": "prefill", "prefill-b": "prefill", "decode-a": "decode"}
    with pd_fleet(roles, {"KVPLANE_DISAGGREGATION__MODE": "always"}) as running:
        yield running


def _complete(fleet: Fleet, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **extra}
    return httpx.post(fleet.router_url + "/v1/completions", json=body, timeout=30)


def _prompt(tag: str) -> str:
    return f"{tag} " + "the fleet shares a long system prompt " * 30


def test_the_roles_show_on_the_fleet_api_and_the_check(fleet: Fleet) -> None:
    workers = fleet.workers()
    assert {w: (row["role"], row["kv_connector"]) for w, row in workers.items()} == {
        "prefill-a": ("prefill", "NixlConnector"),
        "prefill-b": ("prefill", "NixlConnector"),
        "decode-a": ("decode", "NixlConnector"),
    }
    check = httpx.post(fleet.router_url + "/fleet/check", headers=ADMIN, timeout=30).json()
    assert [(m["model"], m["legs"]) for m in check["routing"]] == [(MODEL, "split")]


def test_a_split_request_runs_both_legs_and_the_client_gets_one_answer(fleet: Fleet) -> None:
    pulled_before = fleet.engine_metric("decode-a", "kvplane_sim:kv_pulled_blocks_total")
    split_before = fleet.metric("kvplane_legs_decided_total", split="true", reason="always")
    response = _complete(fleet, _prompt("split"))
    assert response.status_code == 200, response.text
    assert response.headers["x-kvplane-worker"] == "decode-a"
    assert response.headers["x-kvplane-prefill-worker"] in PREFILL
    answer = response.json()
    assert answer["object"] == "text_completion"
    assert answer["usage"]["completion_tokens"] == 4  # the decode's, not the prefill's one
    assert "kv_transfer_params" not in answer or answer["kv_transfer_params"] is None
    assert fleet.engine_metric("decode-a", "kvplane_sim:kv_pulled_blocks_total") > pulled_before
    assert fleet.metric("kvplane_legs_decided_total", split="true", reason="always") == (
        split_before + 1
    )
    assert fleet.metric("kvplane_prefill_legs_total", outcome="ok") >= 1
    # The decode engine published the blocks it pulled: the index holds them there.
    _wait_for(lambda: fleet.workers()["decode-a"]["index_entries"] > 0, "the decode's entries")
    # The same prompt again: its prefill worker (the one holding it) found it cached.
    again = _complete(fleet, _prompt("split"))
    assert again.headers["x-kvplane-prefill-worker"] == response.headers["x-kvplane-prefill-worker"]
    assert int(again.headers["x-kvplane-prefill-cached-tokens"]) >= 16 * 20


def test_a_streamed_split_request_streams_the_decode_answer(fleet: Fleet) -> None:
    body = {"model": MODEL, "prompt": _prompt("stream"), "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", fleet.router_url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["x-kvplane-prefill-worker"] in PREFILL
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert sum(1 for chunk in chunks if chunk["choices"]) == 3
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_a_prefill_that_hands_nothing_on_is_counted_and_decode_computes(fleet: Fleet) -> None:
    before = fleet.metric("kvplane_disaggregation_fallbacks_total", reason="no_kv_params")
    fleet.fault(PREFILL, pd_no_params=True)
    try:
        response = _complete(fleet, _prompt("no-params"))
    finally:
        fleet.fault(PREFILL, pd_no_params=False)
    assert response.status_code == 200, response.text
    assert response.headers["x-kvplane-worker"] == "decode-a"
    assert "x-kvplane-prefill-worker" not in response.headers
    assert fleet.metric("kvplane_disaggregation_fallbacks_total", reason="no_kv_params") == (
        before + 1
    )


@pytest.mark.parametrize("fault", [{"pd_fail_transfer": True}, {"pd_lease_s": 0}])
def test_a_failed_pull_is_counted_and_the_decode_worker_computes_it(
    fleet: Fleet, fault: dict[str, Any]
) -> None:
    before = fleet.metric("kvplane_disaggregation_fallbacks_total", reason="kv_load_failed")
    fleet.fault(PREFILL, **fault)
    try:
        response = _complete(fleet, _prompt(f"failed-pull-{sorted(fault)[0]}"))
    finally:
        fleet.fault(PREFILL, **{name: None if name == "pd_lease_s" else False for name in fault})
    assert response.status_code == 200, response.text
    assert response.headers["x-kvplane-worker"] == "decode-a"
    assert "x-kvplane-prefill-worker" not in response.headers
    assert fleet.metric("kvplane_disaggregation_fallbacks_total", reason="kv_load_failed") == (
        before + 1
    )
    assert fleet.metric("kvplane_requests_total", outcome="engine_error") == 0
    # The engines' own counts reach the router with their agents' load reports.
    if "pd_lease_s" in fault:
        _wait_for(lambda: _load(fleet, *PREFILL, kind="kv_leases_expired") >= 1, "leases")
    _wait_for(lambda: _load(fleet, "decode-a", kind="kv_load_failures") >= 1, "failed pulls")


def _load(fleet: Fleet, *worker_ids: str, kind: str) -> int:
    workers = fleet.workers()
    return sum((workers[w]["load"] or {}).get(kind, 0) for w in worker_ids)


def test_a_pull_the_decode_recomputes_is_seen_in_its_agents_reports() -> None:
    roles = {"prefill-a": "prefill", "decode-a": "decode"}
    env = {"KVPLANE_DISAGGREGATION__MODE": "always"}
    with pd_fleet(roles, env, kv_load_failure_policy="recompute") as fleet:
        fleet.fault(["prefill-a"], pd_fail_transfer=True)
        response = _complete(fleet, _prompt("recomputed"))
        assert response.status_code == 200, response.text
        assert response.headers["x-kvplane-prefill-worker"] == "prefill-a"
        # The engine recomputed it: its answer says nothing, its agent does.
        assert fleet.metric("kvplane_disaggregation_fallbacks_total") == 0
        _wait_for(lambda: _load(fleet, "decode-a", kind="kv_load_failures") == 1, "the count")
        metrics = httpx.get(fleet.router_url + "/metrics", headers=ADMIN).text
        assert 'kvplane_worker_load{kind="kv_load_failures",worker="decode-a"} 1.0' in metrics


def test_a_client_cannot_send_kv_transfer_params(fleet: Fleet) -> None:
    params = {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 5600}
    response = _complete(fleet, "hello", kv_transfer_params=params)
    assert response.status_code == 400
    assert "kv_transfer_params" in response.json()["error"]["message"]


def test_a_dead_prefill_worker_falls_back_then_the_model_is_reported() -> None:
    roles = {"prefill-a": "prefill", "decode-a": "decode"}
    with pd_fleet(roles, {"KVPLANE_DISAGGREGATION__MODE": "always"}) as fleet:
        assert _complete(fleet, _prompt("warm")).headers["x-kvplane-prefill-worker"] == "prefill-a"
        with pytest.raises(httpx.TransportError):  # the fault kills the engine at once
            fleet.fault(["prefill-a"], die=True)
        response = _complete(fleet, _prompt("after-death"))
        assert response.status_code == 200, response.text
        assert response.headers["x-kvplane-worker"] == "decode-a"
        assert fleet.metric("kvplane_disaggregation_fallbacks_total", reason="prefill_failed") == 1

        def reported() -> bool:
            check = httpx.post(fleet.router_url + "/fleet/check", headers=ADMIN, timeout=30)
            return any("no live prefill worker" in p for p in check.json()["problems"])

        _wait_for(reported, "the check to report the model without prefill workers")
        response = _complete(fleet, _prompt("no-prefill"))
        assert response.status_code == 200
        assert fleet.metric("kvplane_legs_decided_total", reason="no_prefill_worker") >= 1
        assert fleet.metric("kvplane_disaggregation_fallbacks_total", reason="no_prefill_worker")


def test_a_model_without_prefill_workers_is_refused_when_so_configured() -> None:
    env = {"KVPLANE_DISAGGREGATION__WHEN_NO_PREFILL": "refuse"}
    with pd_fleet({"decode-a": "decode"}, env) as fleet:
        response = _complete(fleet, "hello there")
        assert response.status_code == 503
        assert "no live prefill worker" in response.json()["error"]["message"]
        assert fleet.metric("kvplane_requests_total", outcome="no_prefill_worker") == 1


def test_a_request_the_prefill_refuses_gets_the_decode_workers_refusal(fleet: Fleet) -> None:
    before = fleet.metric("kvplane_disaggregation_fallbacks_total", reason="prefill_refused")
    body = {"model": "no-such-model", "prompt": _prompt("refused"), "max_tokens": 4}
    response = httpx.post(fleet.router_url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 404  # the engine's own answer, as a whole request gets
    assert response.headers["x-kvplane-worker"] == "decode-a"
    assert fleet.metric("kvplane_disaggregation_fallbacks_total", reason="prefill_refused") == (
        before + 1
    )
    assert fleet.metric("kvplane_prefill_legs_total", outcome="engine_refused") >= 1

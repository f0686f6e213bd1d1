"""A fleet's wiring, proven or failed loudly, with real processes: `kvplane engine-sim`,
`kvplane agent`, `kvplane router` and `kvplane check`, as an operator runs them.

One router in front of three engines:
- `good`: the engine binds `tcp://*:PORT`, the agent connects to 127.0.0.1;
- `miswired`: the engine is given `tcp://127.0.0.1:PORT` (so it connects, as vLLM does)
  and so is the agent: nothing binds, ZMQ reports nothing, no event ever arrives;
- `other-tokenizer`: wired right, but its engine tokenises with another tokenizer than
  the router's, so none of the router's keys can ever match the engine's;
- `dropping`: wired right, but its engine publishes nothing (every batch dropped), as an
  engine with events configured and none ever sent;
- `crossed`: its agent probes one engine and subscribes to another's events (`good`'s):
  an agent pointed at the wrong engine, whose events flow and say nothing of its own.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import pytest

from benchmarks.live.routers import check_wiring
from kvplane.core.serving import free_port
from router.check import BlindFleet
from simulations.processes import spawn_kvplane
from tests.core.test_tokenizer import write_word_tokenizer
from tests.one_worker_stack import one_worker_stack

ADMIN_TOKEN = "wiring-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
AGENT_REPORTS_WITHIN_S = 8.0  # the agent's grace (3 s) and a load interval, with room


@dataclass(frozen=True, slots=True)
class Fleet:
    router_url: str
    agent_logs: dict[str, Path]


def _kv_config(host: str, events: int, replay: int) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://{host}:{events}",
            "replay_endpoint": f"tcp://{host}:{replay}",
        }
    )


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    grpc_port, http_port = free_port(), free_port()
    router_url = f"http://127.0.0.1:{http_port}"
    with tempfile.TemporaryDirectory() as scratch, ExitStack() as stack:
        tokenizer_dir = Path(scratch) / "word-tokenizer"
        write_word_tokenizer(tokenizer_dir, chat_template=None)
        stack.enter_context(
            spawn_kvplane(
                ["router", "--grpc-port", str(grpc_port), "--http-port", str(http_port)],
                router_url + "/healthz",
                env={"KVPLANE_HTTP__ADMIN_TOKEN": ADMIN_TOKEN},
            )
        )
        logs = {}
        endpoints: dict[str, tuple[int, int]] = {}
        for worker, engine_host, engine_args, agent_args in [
            ("good", "*", [], []),
            ("miswired", "127.0.0.1", [], []),
            ("other-tokenizer", "*", ["--tokenizer", str(tokenizer_dir)], []),
            ("dropping", "*", ["--drop-event-fraction", "1"], ["--events-silent-after-s", "2"]),
            ("crossed", "*", [], []),
        ]:
            port, events, replay = free_port(), free_port(), free_port()
            endpoints[worker] = (events, replay)
            engine_url = f"http://127.0.0.1:{port}"
            stack.enter_context(
                spawn_kvplane(
                    ["engine-sim", "--port", str(port), "--time-scale", "0",
                     "--kv-events-config", _kv_config(engine_host, events, replay),
                     *engine_args],
                    engine_url + "/health",
                )
            )  # fmt: skip
            if worker == "crossed":
                events, replay = endpoints["good"]
            logs[worker] = Path(scratch) / f"{worker}.log"
            log: IO[bytes] = stack.enter_context(logs[worker].open("wb"))
            stack.enter_context(
                spawn_kvplane(
                    ["agent", "--worker-id", worker, "--engine-url", engine_url,
                     "--kv-events-endpoint", f"tcp://127.0.0.1:{events}",
                     "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
                     "--control-plane-address", f"127.0.0.1:{grpc_port}", *agent_args],
                    None,
                    log=log,
                )
            )  # fmt: skip
        _wait_for(lambda: len(_workers(router_url)) == 5, "five workers registered")
        yield Fleet(router_url, logs)


def _wait_for(condition: Any, what: str, timeout_s: float = AGENT_REPORTS_WITHIN_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _workers(router_url: str) -> dict[str, dict[str, Any]]:
    answer = httpx.get(router_url + "/fleet/workers", headers=ADMIN).json()
    return {row["worker_id"]: row for row in answer["workers"]}


def _checks(row: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {check["name"]: check for check in row["wiring"]["checks"]}


def kvplane_check(
    router_url: str, *flags: str, token: str = ADMIN_TOKEN
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvplane.cli", "check", "--router-url", router_url, *flags],
        env={"KVPLANE_HTTP__ADMIN_TOKEN": token, "PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.slow
def test_the_miswired_agent_says_so_within_seconds_with_the_fix(fleet: Fleet) -> None:
    def logged() -> bool:
        return (
            "no KV event publisher accepted a connection"
            in fleet.agent_logs["miswired"].read_text()
        )

    _wait_for(logged, "the miswired agent's error")
    text = fleet.agent_logs["miswired"].read_text()
    assert "WARNING" in text
    assert '"endpoint": "tcp://*:' in text  # which side must bind, and how
    assert '"replay_endpoint": "tcp://*:' in text
    assert "no KV event publisher" not in fleet.agent_logs["good"].read_text()


@pytest.mark.slow
def test_the_fleet_api_and_the_metrics_show_the_miswired_worker(fleet: Fleet) -> None:
    def events_failing() -> bool:
        return _checks(_workers(fleet.router_url)["miswired"])["events"]["status"] == "fail"

    _wait_for(events_failing, "the router to hear of the miswired agent")
    workers = _workers(fleet.router_url)
    miswired = workers["miswired"]
    assert miswired["wiring"]["blind"]
    events = _checks(miswired)["events"]
    assert "not_connected" in events["detail"]
    assert "tcp://*:" in events["detail"]
    assert _checks(miswired)["replay"]["status"] == "fail"
    assert not workers["good"]["wiring"]["blind"]
    metrics = httpx.get(fleet.router_url + "/metrics", headers=ADMIN).text
    assert (
        'kvplane_worker_wiring_check{check="events",status="fail",worker="miswired"} 1.0' in metrics
    )
    assert 'kvplane_worker_blind{worker="miswired"} 1.0' in metrics
    assert 'kvplane_worker_blind{worker="good"} 0.0' in metrics


@pytest.mark.slow
def test_token_counts_that_differ_are_reported_within_a_handful_of_requests(
    tmp_path: Path,
) -> None:
    write_word_tokenizer(tmp_path, chat_template=None)
    with one_worker_stack(
        "other",
        router_env={"KVPLANE_HTTP__ADMIN_TOKEN": ADMIN_TOKEN},
        engine_args=["--tokenizer", str(tmp_path)],
    ) as fleet:
        _wait_for(lambda: "other" in _workers(fleet.router_url), "the worker to register")
        with httpx.Client(base_url=fleet.router_url) as client:
            for turn in range(5):  # the router's own traffic is what is compared
                response = client.post(
                    "/v1/completions",
                    json={"model": "kvplane-tiny", "prompt": f"hello world {turn} " * 20,
                          "max_tokens": 1},
                )  # fmt: skip
                assert response.status_code == 200
            # 3,000 words: over the engine's 8,192 tokens by the router's count, well
            # within them by the engine's; with the counts known to differ, the router
            # does not hold its own count against the engine's limit.
            words = " ".join(f"q{n}zx{n * 7 % 97}" for n in range(3000))
            response = client.post(
                "/v1/completions",
                json={"model": "kvplane-tiny", "prompt": words, "max_tokens": 1},
            )
            assert response.status_code == 200, response.text
        row = _workers(fleet.router_url)["other"]
        metrics = httpx.get(fleet.router_url + "/metrics", headers=ADMIN).text
        ready = httpx.get(fleet.router_url + "/readyz").json()
    tokenizer = _checks(row)["tokenizer"]
    assert tokenizer["status"] == "fail"
    assert "of the last 6 requests" in tokenizer["detail"]
    assert row["wiring"]["blind"]
    assert (
        'kvplane_prompt_token_checks_total{model="kvplane-tiny",result="mismatch",worker="other"}'
        " 6.0" in metrics
    )
    assert 'kvplane_model_routing_predictions_only{model="kvplane-tiny"} 1.0' in metrics
    assert ready["routing"] == "predictions-only"
    assert ready["predictions_only_models"] == ["kvplane-tiny"]


@pytest.mark.slow
def test_an_engine_that_caches_and_publishes_nothing_is_reported_silent(fleet: Fleet) -> None:
    engine_url = _workers(fleet.router_url)["dropping"]["base_url"]
    with httpx.Client(base_url=engine_url) as engine:
        for turn in range(3):  # straight to the engine: new blocks cached, none announced
            answer = engine.post(
                "/v1/completions",
                json={"prompt": f"fresh words {turn} " * 30, "max_tokens": 1},
            )
            assert answer.status_code == 200

    def silent() -> bool:
        return "wiring: events silent" in fleet.agent_logs["dropping"].read_text()

    _wait_for(silent, "the dropping agent to report silence", timeout_s=15)
    events = _checks(_workers(fleet.router_url)["dropping"])["events"]
    assert events["status"] == "fail"
    assert "silent" in events["detail"]
    assert "--enable-prefix-caching" in events["detail"]
    # The good engine served the same kind of traffic, and its agent heard every block.
    assert "events silent" not in fleet.agent_logs["good"].read_text()


@pytest.mark.slow
def test_an_agent_that_reads_another_engines_events_fails_the_probe(fleet: Fleet) -> None:
    result = kvplane_check(fleet.router_url, "--json", "--wait-s", "2")
    rows = {row["worker_id"]: row for row in json.loads(result.stdout)["workers"]}
    crossed = {check["name"]: check for check in rows["crossed"]["checks"]}
    assert crossed["probe_tokenizer"]["status"] == "pass"
    assert crossed["probe_index"]["status"] == "fail"
    assert "reads another engine" in crossed["probe_index"]["fix"]
    assert crossed["events"]["status"] != "fail"  # its agent hears events: someone's
    assert rows["crossed"]["blind"]
    assert rows["good"]["ok"]  # the engine it reads is fine, and checked fine


@pytest.mark.slow
def test_kvplane_check_fails_naming_each_broken_worker_and_its_fix(fleet: Fleet) -> None:
    result = kvplane_check(fleet.router_url, "--wait-s", "2")
    assert result.returncode == 1, result.stderr
    out = result.stdout
    assert "worker miswired (model kvplane-tiny, live): FAILED" in out
    assert 'set "endpoint": "tcp://*:' in out
    assert "worker other-tokenizer (model kvplane-tiny, live): FAILED" in out
    assert "probe_tokenizer" in out
    assert "the router does not tokenise as this engine" in out
    assert "worker good (model kvplane-tiny, live): ok" in out
    assert any(line.startswith("FAILED: ") for line in out.splitlines())
    as_json = json.loads(kvplane_check(fleet.router_url, "--json", "--wait-s", "2").stdout)
    rows = {row["worker_id"]: row for row in as_json["workers"]}
    assert not as_json["ok"]
    assert rows["good"]["ok"]
    assert not rows["good"]["blind"]
    assert rows["miswired"]["blind"]
    assert rows["other-tokenizer"]["blind"]
    probe = {check["name"]: check for check in rows["good"]["checks"]}
    assert probe["probe_index"]["status"] == "pass"
    assert probe["probe_tokenizer"]["status"] == "pass"


@pytest.mark.slow
def test_the_live_bake_off_refuses_to_measure_a_blind_fleet(fleet: Fleet) -> None:
    with pytest.raises(BlindFleet, match="miswired: events: events not_connected"):
        check_wiring(fleet.router_url, ADMIN_TOKEN)


@pytest.mark.slow
def test_kvplane_check_passes_on_a_fleet_wired_right() -> None:
    with one_worker_stack("right", router_env={"KVPLANE_HTTP__ADMIN_TOKEN": ADMIN_TOKEN}) as fleet:
        _wait_for(lambda: "right" in _workers(fleet.router_url), "the worker to register")
        result = kvplane_check(fleet.router_url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "worker right (model kvplane-tiny, live): ok" in result.stdout
    assert "PASSED" in result.stdout
    assert "model kvplane-tiny: cache aware" in result.stdout


@pytest.mark.slow
def test_kvplane_check_with_the_wrong_token_says_so(fleet: Fleet) -> None:
    result = kvplane_check(fleet.router_url, "--no-probe", token="not-the-token")
    assert result.returncode == 2
    assert "answered 401 (is the admin token the router's?)" in result.stderr


def test_kvplane_check_without_a_token_or_a_router_cannot_ask() -> None:
    unreachable = f"http://127.0.0.1:{free_port()}"
    result = kvplane_check(unreachable)
    assert result.returncode == 2
    assert "cannot reach" in result.stderr
    no_token = subprocess.run(
        [sys.executable, "-m", "kvplane.cli", "check", "--router-url", unreachable],
        env={"PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert no_token.returncode == 2
    assert "KVPLANE_HTTP__ADMIN_TOKEN" in no_token.stderr


@pytest.mark.parametrize(
    "router_url",
    ["127.0.0.1:8080", "file:///etc/hostname", "http://[::1", "http://127.0.0.1:abc", "http://:80"],
)
def test_kvplane_check_refuses_what_is_not_an_http_url(router_url: str) -> None:
    result = kvplane_check(router_url)
    assert result.returncode == 2
    assert "is not an http:// or https:// URL" in result.stderr
    assert "Traceback" not in result.stderr


def test_kvplane_check_follows_no_redirect_with_the_token() -> None:
    """A redirect is reported as the router's answer: following it would send the admin
    token wherever the redirect points."""
    seen: list[str] = []

    class Redirecting(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # the check's request
            seen.append(f"POST {self.headers.get('Authorization')}")
            self.send_response(302)
            self.send_header("location", "/elsewhere")
            self.send_header("content-length", "0")
            self.end_headers()

        def do_GET(self) -> None:  # where urllib would follow it
            seen.append(f"GET {self.headers.get('Authorization')}")
            self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with http.server.HTTPServer(("127.0.0.1", 0), Redirecting) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            result = kvplane_check(f"http://127.0.0.1:{server.server_port}")
        finally:
            server.shutdown()
    assert result.returncode == 2
    assert "answered 302" in result.stderr
    assert seen == [f"POST Bearer {ADMIN_TOKEN}"]


def test_kvplane_check_refuses_a_token_no_header_can_carry() -> None:
    result = kvplane_check(f"http://127.0.0.1:{free_port()}", token="secret\n")
    assert result.returncode == 2
    assert "KVPLANE_HTTP__ADMIN_TOKEN holds a character no header can carry" in result.stderr

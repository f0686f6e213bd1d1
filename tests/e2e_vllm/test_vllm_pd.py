"""Prefill/decode disaggregation through kvplane with two real vLLM CPU engines.

Both engines run NixlConnector with a host KV buffer (`kv_buffer_device = "cpu"`, the
`nixl` package from PyPI, UCX over loopback): one agent registers its engine as a
prefill worker, the other as a decode worker, and the router (`disaggregation.mode =
always`) splits a request in two. The decode engine pulls the prompt's KV from the
prefill engine and generates; its own metrics say so (`external_kv_transfer` prompt
tokens, a NIXL transfer), and the router falls back on nothing.

The engines start in this module (not the package's `vllm_fleet`), with the conftest's
model and launch command plus the connector's flags.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvplane.core.keys import KeyNamespace, block_keys
from kvplane.core.serving import free_port
from kvplane.core.tokenizer import load_tokenizer
from router.index.base import PrefixMatch
from router.tenants import derive_cache_salt, own_scope
from simulations.processes import spawn_kvplane
from tests.e2e_vllm.conftest import (
    ADMIN,
    BLOCK,
    FIGURES,
    MODEL,
    SALT_SECRET,
    TENANT_KEYS,
    VLLM_PYTHON,
    VllmReplica,
    _agent_args,
    _router_config,
    build_model,
    index_lookup,
    wait_for,
)

pytestmark = [pytest.mark.heavy("vllm"), pytest.mark.timeout(600)]

NIXL = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
    # How long a prefill engine keeps a finished prompt's blocks for the decode engine
    # to pull (vLLM's default 30 s). On two busy cores a pull once began 33 s after
    # the prefill leg: the blocks were released first, the decode engine read them
    # anyway and answered 200 (the prefill engine logged "Potentially invalid KV
    # blocks ... may have expired"). The test asserts no lease expired.
    "kv_connector_extra_config": {"kv_lease_duration": 180},
}
PREFILL, DECODE = "vllm-prefill", "vllm-decode"


@dataclass
class NixlReplica(VllmReplica):
    """A `VllmReplica` with NixlConnector; its NIXL side channel on its own port."""

    side_channel_port: int = field(default_factory=free_port)

    def extra_args(self) -> list[str]:
        return ["--kv-transfer-config", json.dumps(NIXL)]

    def extra_env(self) -> dict[str, str]:
        return {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
        }

    def while_starting(self) -> None:
        self.unpin()  # its warm-up ran for minutes bound to one core with the other's

    def unpin(self) -> None:
        """Let every thread of the engine run on every CPU again.

        On the CPU backend NixlConnector binds each engine's worker to the last core of
        its NUMA node (vLLM's `discover_numa_topology`), so both engines' workers share
        one core while each spins (its idle loop and its NIXL progress thread): split
        requests took 10 to 40 s so, 3.5 s unbound on two quiet cores, and two engines'
        start-up took over five minutes. The binding comes during start-up: this is done
        while it starts and once it is healthy."""
        assert self.process is not None
        every_cpu = set(range(os.cpu_count() or 1))
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                if int(stat[stat.rindex(")") + 2 :].split()[2]) != self.process.pid:
                    continue
                for task in (entry / "task").iterdir():
                    os.sched_setaffinity(int(task.name), every_cpu)
            except (OSError, ValueError, IndexError):
                continue


@dataclass
class PdFleet:
    router_url: str
    redis_url: str
    redis_prefix: str
    model_dir: Path
    prefill: NixlReplica
    decode: NixlReplica


@pytest.fixture(scope="module")
def pd_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdFleet]:
    work = tmp_path_factory.mktemp("e2e-vllm-pd")
    model_dir = work / "model"
    build_model(model_dir)
    if subprocess.run([str(VLLM_PYTHON), "-c", "import nixl"], capture_output=True).returncode:
        pytest.fail(
            f"no `nixl` in {VLLM_PYTHON.parent.parent}: run `make vllm-env` (it installs "
            "PyPI's nixl, whose UCX backend runs on the CPU)"
        )
    prefill = NixlReplica(PREFILL, model_dir, work)
    decode = NixlReplica(DECODE, model_dir, work)
    prefix = f"e2epd{uuid.uuid4().hex[:8]}"
    config = work / "router.toml"
    _router_config(config, redis_url, prefix, model_dir)
    http_port, grpc_port = free_port(), free_port()
    router_url = f"http://127.0.0.1:{http_port}"
    with ExitStack() as stack:
        for replica in (prefill, decode):
            stack.callback(replica.kill)
            replica.launch()
        FIGURES["pd_engine_start_s"] = [
            round(replica.wait_healthy(), 1) for replica in (prefill, decode)
        ]
        for replica in (prefill, decode):
            replica.unpin()
        stack.enter_context(
            spawn_kvplane(
                ["router", "--config", str(config), "--http-port", str(http_port),
                 "--grpc-port", str(grpc_port), "--log-level", "WARNING"],
                router_url + "/readyz",
                env={"KVPLANE_HTTP__ADMIN_TOKEN": "e2e-admin",
                     "KVPLANE_DISAGGREGATION__MODE": "always"},
            )
        )  # fmt: skip
        for replica, role in ((prefill, "prefill"), (decode, "decode")):
            args = [*_agent_args(replica, grpc_port), "--role", role]
            stack.enter_context(spawn_kvplane(args, None))
        fleet = PdFleet(router_url, redis_url, prefix, model_dir, prefill, decode)

        def split_ready() -> bool:
            body = httpx.get(router_url + "/fleet/workers", headers=ADMIN, timeout=10).json()
            states = {row["worker_id"]: row["state"] for row in body["workers"]}
            legs = {row["model"]: row["legs"] for row in body["routing"]}
            return states == {PREFILL: "live", DECODE: "live"} and legs.get(MODEL) == "split"

        wait_for("a prefill and a decode worker are live, and the model splits", split_ready, 60)
        warm_up(fleet)
        yield fleet


def warm_up(fleet: PdFleet) -> None:
    """Split requests until one goes through, before the tests' own (which count from
    there). A pair's first transfer does NIXL's handshake, whose reply vLLM 0.32 waits
    5 s for (hard-coded): two engines on two busy cores can miss it, and the decode
    engine then fails the request (`kv_load_failure_policy = "fail"`), which the router
    counts as kv_load_failed and serves whole: the fallback, seen with a real engine.
    Just after both engines report healthy, the router's connect to one can also time
    out (2 s) while the cores are busy (seen in CI: 503, `cannot connect`): the warm-up
    tries again, and fails only when no attempt was answered."""
    headers = {"authorization": f"Bearer {TENANT_KEYS['globex']}"}
    answers: list[str] = []
    for _ in range(5):
        response = httpx.post(
            fleet.router_url + "/v1/completions",
            json={"model": MODEL, "prompt": prompt("the warm-up"), "max_tokens": 1},
            headers=headers,
            timeout=180,
        )
        answers.append(f"{response.status_code}: {response.text[:300]}")
        if response.status_code == 200 and "x-kvplane-prefill-worker" in response.headers:
            break
        if response.status_code != 200:
            time.sleep(2)
    assert any(answer.startswith("200") for answer in answers), answers
    FIGURES["pd_warm_up_answers"] = [answer.split(":")[0] for answer in answers]
    FIGURES["pd_warm_up_fallbacks"] = metric(
        fleet.router_url, "kvplane_disaggregation_fallbacks_total", ADMIN
    )


def metric(url: str, name: str, headers: dict[str, str] | None = None, **labels: str) -> float:
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def by_source(url: str, source: str) -> float:
    return metric(url, "vllm:prompt_tokens_by_source_total", source=source)


def holders(fleet: PdFleet, text: str, tenant: str) -> dict[str, PrefixMatch]:
    """The index's answer for the prompt's blocks, read straight from Redis."""
    scope = derive_cache_salt(SALT_SECRET.encode(), own_scope(tenant))
    assert scope is not None
    tokens = load_tokenizer(fleet.model_dir).completion_tokens(text)
    keys = block_keys(tokens, KeyNamespace(MODEL, BLOCK, cache_scope=scope))
    return index_lookup(fleet.redis_url, fleet.redis_prefix, keys)


def prompt(topic: str) -> str:
    """About 300 tokens: nine full blocks."""
    return " ".join(
        f"Sentence {n} of the incident report on {topic}: write down what failed and when."
        for n in range(6)
    )


def test_split_request_pulls_the_prompt_from_the_prefill_engine(pd_fleet: PdFleet) -> None:
    fleet, tenant = pd_fleet, "acme"
    text = prompt("the storage cluster")
    pulled_before = by_source(fleet.decode.base_url, "external_kv_transfer")
    computed_before = by_source(fleet.decode.base_url, "local_compute")
    failed_before = metric(fleet.decode.base_url, "vllm:nixl_num_failed_transfers_total")
    fallbacks_before = metric(fleet.router_url, "kvplane_disaggregation_fallbacks_total", ADMIN)
    legs_before = metric(fleet.router_url, "kvplane_prefill_legs_total", ADMIN)
    started = time.monotonic()
    response = httpx.post(
        fleet.router_url + "/v1/completions",
        json={"model": MODEL, "prompt": text, "max_tokens": 4},
        headers={"authorization": f"Bearer {TENANT_KEYS[tenant]}"},
        timeout=180,
    )
    FIGURES["pd_split_request_s"] = round(time.monotonic() - started, 1)
    assert response.status_code == 200, response.text
    assert response.headers["x-kvplane-prefill-worker"] == PREFILL
    assert response.headers["x-kvplane-worker"] == DECODE
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == 4

    # The prefill engine computed the prompt; the decode engine pulled all of it over
    # NIXL and computed none of it.
    prompt_tokens = usage["prompt_tokens"]
    assert by_source(fleet.prefill.base_url, "local_compute") >= prompt_tokens
    pulled = by_source(fleet.decode.base_url, "external_kv_transfer") - pulled_before
    assert pulled == prompt_tokens
    assert by_source(fleet.decode.base_url, "local_compute") == computed_before
    assert metric(fleet.decode.base_url, "vllm:nixl_xfer_time_seconds_count") >= 1
    assert metric(fleet.decode.base_url, "vllm:nixl_num_failed_transfers_total") == failed_before
    assert metric(fleet.prefill.base_url, "vllm:nixl_num_kv_expired_reqs_total") == 0

    # Nothing fell back, and the router counted one prefill leg.
    router = fleet.router_url
    assert metric(router, "kvplane_disaggregation_fallbacks_total", ADMIN) == fallbacks_before
    assert metric(router, "kvplane_prefill_legs_total", ADMIN) == legs_before + 1

    # Both engines published the prompt's blocks (the decode engine's are those it
    # pulled), so the index finds the whole prompt on both workers.
    full_blocks = prompt_tokens // BLOCK
    wait_for(
        "both workers hold the prompt in the index",
        lambda: (
            {worker: match.blocks for worker, match in holders(fleet, text, tenant).items()}
            == {PREFILL: full_blocks, DECODE: full_blocks}
        ),
        timeout_s=10,
    )


def test_streamed_split_request(pd_fleet: PdFleet) -> None:
    """The decode leg streams (the prefill leg never does)."""
    fleet = pd_fleet
    pulled_before = by_source(fleet.decode.base_url, "external_kv_transfer")
    legs_before = metric(fleet.router_url, "kvplane_prefill_legs_total", ADMIN)
    fallbacks_before = metric(fleet.router_url, "kvplane_disaggregation_fallbacks_total", ADMIN)
    body = {
        "model": MODEL,
        "prompt": prompt("the billing service"),
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"authorization": f"Bearer {TENANT_KEYS['acme']}"}
    with httpx.stream(
        "POST", fleet.router_url + "/v1/completions", json=body, headers=headers, timeout=180
    ) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["x-kvplane-prefill-worker"] == PREFILL
        assert response.headers["x-kvplane-worker"] == DECODE
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 4
    pulled = by_source(fleet.decode.base_url, "external_kv_transfer") - pulled_before
    assert pulled == usage["prompt_tokens"]
    assert metric(fleet.router_url, "kvplane_prefill_legs_total", ADMIN) == legs_before + 1
    fallbacks = metric(fleet.router_url, "kvplane_disaggregation_fallbacks_total", ADMIN)
    assert fallbacks == fallbacks_before

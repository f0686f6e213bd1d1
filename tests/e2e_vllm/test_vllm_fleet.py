"""kvplane in front of two real vLLM replicas: what the router believes is what vLLM does.

The tests share one fleet and run in this order; the last one kills and restarts a
replica. Requests go one at a time with a pause for the KV events, so that each
prediction can be held to the engine's own report.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvplane.core.keys import KeyNamespace, block_keys
from kvplane.core.tokenizer import load_tokenizer
from router.index.base import PrefixMatch
from router.tenants import derive_cache_salt, own_scope
from tests.e2e_vllm.conftest import (
    ADMIN,
    BLOCK,
    FIGURES,
    LEASE_S,
    LOAD_INTERVAL_S,
    MODEL,
    SALT_SECRET,
    TENANT_KEYS,
    VllmFleet,
    index_lookup,
    wait_for,
)

# Starting two vLLM servers takes a minute or two on a cold machine (the suite's first
# test pays for it); each test is well under that.
pytestmark = [pytest.mark.heavy("vllm"), pytest.mark.timeout(600)]

EVENTS_SETTLE_S = 0.4  # an engine's events reach the index in milliseconds; margin
_TOPICS = (
    "the storage cluster", "the billing service", "the search index", "the mail relay",
    "the build farm", "the payment gateway", "the log pipeline", "the image cache",
    "the login service", "the job scheduler",
)  # fmt: skip


def prompt(topic: str, sentences: int = 6) -> str:
    """A prompt of roughly 40 tokens a sentence with the shipped tokenizer."""
    return " ".join(
        f"Sentence {n} of the incident report on {topic}: write down what failed and when."
        for n in range(sentences)
    )


@dataclass(frozen=True)
class Answer:
    worker: str
    predicted: int
    reported: int
    prompt_tokens: int


def complete(fleet: VllmFleet, text: str, tenant: str = "acme", *, chat: bool = False) -> Answer:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2}
    if chat:
        body["messages"] = [{"role": "system", "content": text}, {"role": "user", "content": "?"}]
    else:
        body["prompt"] = text
    response = httpx.post(
        fleet.router_url + ("/v1/chat/completions" if chat else "/v1/completions"),
        json=body,
        headers={"authorization": f"Bearer {TENANT_KEYS[tenant]}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return Answer(
        worker=response.headers["x-kvplane-worker"],
        predicted=int(response.headers["x-kvplane-cached-tokens"]),
        reported=int(details.get("cached_tokens") or 0),
        prompt_tokens=usage["prompt_tokens"],
    )


def salt(tenant: str) -> str:
    value = derive_cache_salt(SALT_SECRET.encode(), own_scope(tenant))
    assert value is not None
    return value


def keys_of(fleet: VllmFleet, text: str, cache_scope: str) -> list[int]:
    tokens = load_tokenizer(fleet.model_dir).completion_tokens(text)
    return block_keys(tokens, KeyNamespace(MODEL, BLOCK, cache_scope=cache_scope))


def lookup(fleet: VllmFleet, keys: list[int], tries: int = 5) -> dict[str, PrefixMatch]:
    return index_lookup(fleet.redis_url, fleet.redis_prefix, keys, tries)


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", headers=ADMIN, timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def set_drained(fleet: VllmFleet, worker_id: str, drained: bool) -> None:
    action = "drain" if drained else "undrain"
    response = httpx.post(
        f"{fleet.router_url}/fleet/workers/{worker_id}/{action}", headers=ADMIN, timeout=10
    )
    assert response.status_code == 200


def served_by(fleet: VllmFleet, worker_id: str, text: str, tenant: str = "acme") -> Answer:
    """The request answered by `worker_id`: every other replica drained meanwhile."""
    others = [r.worker_id for r in fleet.replicas if r.worker_id != worker_id]
    for other in others:
        set_drained(fleet, other, True)
    try:
        answer = complete(fleet, text, tenant)
    finally:
        for other in others:
            set_drained(fleet, other, False)
    assert answer.worker == worker_id
    return answer


def test_a_served_prefix_is_predicted_on_its_replica_and_hit_there(vllm_fleet: VllmFleet) -> None:
    text = prompt(_TOPICS[0])
    first = complete(vllm_fleet, text)
    keys = keys_of(vllm_fleet, text, salt("acme"))
    servable = (first.prompt_tokens - 1) // BLOCK

    def indexed() -> bool:
        match = lookup(vllm_fleet, keys).get(first.worker)
        return match is not None and match.blocks >= servable

    wait_for("the agent's events put the prefix in the index", indexed)
    time.sleep(3.2)  # the router's own prediction (3 s) has expired: only events count
    locality = httpx.post(
        vllm_fleet.router_url + "/fleet/locality",
        json={"model": MODEL, "prompt": text, "tenant": "acme"},
        headers=ADMIN,
        timeout=10,
    ).json()
    assert locality["chosen"] == first.worker
    row = next(w for w in locality["workers"] if w["worker_id"] == first.worker)
    assert row["cached_tokens"] == servable * BLOCK

    holder = vllm_fleet.replica(first.worker)
    hits_before = metric(holder.base_url, "vllm:prefix_cache_hits_total")
    repeat = complete(vllm_fleet, text)
    assert repeat.worker == first.worker
    assert repeat.reported == repeat.predicted == servable * BLOCK
    assert metric(holder.base_url, "vllm:prefix_cache_hits_total") - hits_before == repeat.reported


def test_tenants_are_kept_apart_in_vllm_and_in_the_index(vllm_fleet: VllmFleet) -> None:
    text = prompt(_TOPICS[1])
    worker = vllm_fleet.replicas[0].worker_id
    served_by(vllm_fleet, worker, text, "acme")
    time.sleep(EVENTS_SETTLE_S)
    again = served_by(vllm_fleet, worker, text, "acme")
    assert again.reported > 0
    other = served_by(vllm_fleet, worker, text, "globex")  # the same replica, same prompt
    assert other.predicted == 0
    assert other.reported == 0  # vLLM kept the two salts apart
    time.sleep(EVENTS_SETTLE_S)
    # The router passed each tenant's own salt, and keyed the blocks under it.
    assert salt("acme") != salt("globex")
    for tenant in ("acme", "globex"):
        match = lookup(vllm_fleet, keys_of(vllm_fleet, text, salt(tenant))).get(worker)
        assert match is not None
        assert match.blocks == (again.prompt_tokens - 1) // BLOCK
    assert lookup(vllm_fleet, keys_of(vllm_fleet, text, "")) == {}  # never unsalted


def test_predictions_match_vllm_through_evictions(vllm_fleet: VllmFleet) -> None:
    rng = random.Random(7)
    removed_before = metric(vllm_fleet.router_url, "kvplane_blocks_applied_total", kind="removed")
    texts = [prompt(topic, rng.randint(4, 9)) for topic in _TOPICS]
    answers = []
    for _ in range(36):
        text = rng.choice(texts[: rng.randint(3, len(texts))])  # the first ones come back more
        answers.append(complete(vllm_fleet, text, chat=rng.random() < 0.3))
        time.sleep(EVENTS_SETTLE_S)
    errors = [abs(a.predicted - a.reported) for a in answers]
    FIGURES["mixed_workload"] = {
        "requests": len(answers),
        "predicted_cached_tokens": sum(a.predicted for a in answers),
        "reported_cached_tokens": sum(a.reported for a in answers),
        "max_abs_difference_tokens": max(errors),
        "requests_off_by_a_block_or_more": sum(1 for e in errors if e >= BLOCK),
        "per_worker": dict(Counter(a.worker for a in answers)),
    }
    removed = metric(vllm_fleet.router_url, "kvplane_blocks_applied_total", kind="removed")
    assert removed > removed_before  # the small caches evicted, and the index followed
    assert sum(a.reported for a in answers) > 0
    assert max(errors) <= BLOCK, [(a.predicted, a.reported) for a in answers]


def test_kvplane_check_proves_both_replicas_wired(vllm_fleet: VllmFleet) -> None:
    """After the traffic above: the agents hear vLLM's events, the router counts prompt
    tokens as vLLM does, and a probe's blocks reach the index under each replica."""
    result = subprocess.run(
        [sys.executable, "-m", "kvplane.cli", "check", "--router-url", vllm_fleet.router_url,
         "--json", "--wait-s", "10"],
        env={**os.environ, "KVPLANE_HTTP__ADMIN_TOKEN": "e2e-admin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    verdict = json.loads(result.stdout)
    for row in verdict["workers"]:
        checks = {check["name"]: check["status"] for check in row["checks"]}
        assert checks["events"] == "pass", row
        assert checks["tokenizer"] == "pass", row  # vLLM's own usage.prompt_tokens
        assert checks["probe_tokenizer"] == checks["probe_index"] == "pass", row
    assert verdict["routing"] == [{"model": MODEL, "routing": "cache_aware", "legs": "whole"}]
    FIGURES["kvplane_check"] = {
        row["worker_id"]: {check["name"]: check["detail"] for check in row["checks"]}
        for row in verdict["workers"]
    }


class _Traffic(threading.Thread):
    """Non-streamed requests, one after another, until stopped; every outcome kept."""

    def __init__(self, fleet: VllmFleet, texts: list[str]) -> None:
        super().__init__(daemon=True)
        self.fleet, self.texts = fleet, texts
        self.stopping = threading.Event()
        self.answers: list[tuple[float, str]] = []
        self.failures: list[str] = []

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            turn = 0
            while not self.stopping.is_set():
                response = client.post(
                    self.fleet.router_url + "/v1/completions",
                    json={"model": MODEL, "prompt": self.texts[turn % len(self.texts)],
                          "max_tokens": 2},
                    headers={"authorization": f"Bearer {TENANT_KEYS['acme']}"},
                )  # fmt: skip
                turn += 1
                if response.status_code == 200:
                    self.answers.append((time.monotonic(), response.headers["x-kvplane-worker"]))
                else:
                    self.failures.append(f"{response.status_code}: {response.text[:200]}")


def test_a_killed_replica_is_forgotten_within_its_lease_and_comes_back(
    vllm_fleet: VllmFleet,
) -> None:
    victim, survivor = vllm_fleet.replicas
    text = prompt("the replica that dies", 8)
    served_by(vllm_fleet, victim.worker_id, text)
    keys = keys_of(vllm_fleet, text, salt("acme"))
    wait_for("the victim's prefix is indexed", lambda: victim.worker_id in lookup(vllm_fleet, keys))
    old_incarnation = vllm_fleet.workers()[victim.worker_id]["incarnation"]

    traffic = _Traffic(vllm_fleet, [text, prompt(_TOPICS[2]), prompt(_TOPICS[3])])
    traffic.start()
    try:
        time.sleep(1.0)
        victim.kill()
        killed_at = time.monotonic()
        lived = wait_for(
            "the dead replica's locations leave lookups",
            lambda: victim.worker_id not in lookup(vllm_fleet, keys),
            timeout_s=LEASE_S * 3,
        )
        purged = lived + wait_for(
            "the dead replica leaves the registry",
            lambda: victim.worker_id not in vllm_fleet.workers(),
            timeout_s=LEASE_S * 3,
        )
        time.sleep(1.0)
    finally:
        traffic.stopping.set()
        traffic.join(timeout=60)
    FIGURES["dead_replica"] = {
        "locations_lived_s": round(lived, 2),
        "registry_purged_after_s": round(purged, 2),
        "lease_s": LEASE_S,
        "requests_during": len(traffic.answers) + len(traffic.failures),
        "failed": len(traffic.failures),
    }
    # The agent finds the engine down on its second failed probe and renews the lease
    # once more as it says so; the entries go when that lease runs out.
    assert lived <= 2 * LOAD_INTERVAL_S + LEASE_S + 1.0
    assert traffic.failures == []
    after = [worker for at, worker in traffic.answers if at > killed_at + 0.5]
    assert after
    assert set(after) == {survivor.worker_id}

    victim.launch()
    FIGURES["engine_restart_s"] = round(victim.wait_healthy(), 1)

    def back() -> bool:
        row = vllm_fleet.workers().get(victim.worker_id)
        return row is not None and row["state"] == "live"

    wait_for("the restarted replica is live again", back, timeout_s=60)
    assert vllm_fleet.workers()[victim.worker_id]["incarnation"] > old_incarnation
    served_by(vllm_fleet, victim.worker_id, text)
    wait_for("the index fills again", lambda: victim.worker_id in lookup(vllm_fleet, keys))

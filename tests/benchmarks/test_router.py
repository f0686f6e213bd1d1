"""`kvplane bench router` end to end with tiny parameters: the report's shape, and
figures that are measurements (positive), not their size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.router import PEER, STREAM_MAX_TOKENS
from kvplane.cli import main

pytestmark = pytest.mark.slow

DECISION_FIELDS = {
    "prompt_tokens",
    "workers",
    "index",
    "decision_p50_us",
    "decision_p99_us",
    "lookup_cpu_us",
    "lookup_server_us",
    "tokenize_p50_us",
    "tokenize_shared_p50_us",
    "tokenize_shared_text_p50_us",
}
PROXY_FIELDS = {
    "added_latency_p50_ms",
    "requests_per_s",
    "direct_requests_per_s",
    "router_cpu_ms_per_request",
    "bare_added_latency_p50_ms",
    "bare_requests_per_s",
    "bare_cpu_ms_per_request",
}


def test_bench_router_writes_decisions_and_proxy_figures(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    report_path = tmp_path / "router.json"
    status = main(
        [
            "bench", "router", "--json", str(report_path),
            "--index", "memory,redis", "--redis-url", redis_url, "--groups", "2",
            "--prompt-tokens", "64,256", "--workers", "3",
            "--decisions", "20", "--requests", "60", "--concurrency", "4",
            "--sequential", "10", "--streamed", "24",
        ]
    )  # fmt: skip
    assert status == 0
    printed = capsys.readouterr().out
    assert "decide p99" in printed
    assert "requests/s through the router" in printed
    assert "a bare pass-through on the same server and client stack" in printed
    assert "streamed chats: 24 a path" in printed

    report = json.loads(report_path.read_text())
    rows = report["decisions"]
    assert [(row["prompt_tokens"], row["index"]) for row in rows] == [
        (64, "memory"),
        (64, "redis"),
        (256, "memory"),
        (256, "redis"),
    ]
    for row in rows:
        assert row.keys() >= DECISION_FIELDS
        assert row["workers"] == 3
        assert row["entries"] > 0
        for field in ("decision_p50_us", "decision_p99_us", "lookup_cpu_us", "tokenize_p50_us"):
            assert row[field] > 0, field
        assert row["decision_p99_us"] >= row["decision_p50_us"]
        # Redis's time a lookup, from its own counters: only where Redis answered.
        assert (row["lookup_server_us"] is None) == (row["index"] == "memory")
        assert row["index"] == "memory" or row["lookup_server_us"] > 0
    assert report["redis_groups"] == 2

    proxy = report["proxy"]
    assert proxy.keys() >= PROXY_FIELDS
    assert proxy["errors"] == 0
    for field in (
        "requests_per_s",
        "direct_requests_per_s",
        "router_cpu_ms_per_request",
        "bare_requests_per_s",
    ):
        assert proxy[field] > 0, field
    # (Not the bare proxy's CPU: it comes in 10 ms ticks, and 60 requests may take none.)
    # A difference of two medians: only its being a number is certain.
    assert isinstance(proxy["added_latency_p50_ms"], float)
    assert proxy["proxied_latency_p50_ms"] > 0
    assert proxy["direct_latency_p50_ms"] > 0
    # The peer, from `make peers-env` (which `make test` builds), in the same run.
    peer = proxy["peer"]
    assert peer["name"] == PEER
    assert peer["version"] not in ("", "unknown")
    assert peer["requests_per_s"] > 0

    streamed = report["streamed"]
    assert streamed["errors"] == 0
    assert streamed["requests"] == 24
    assert [path["name"] for path in streamed["paths"]] == ["direct", "kvplane", "bare", PEER]
    # Each token its own event, as engines stream them (then usage and [DONE]): the
    # relays were measured on chunks, not on whole answers.
    assert streamed["events_per_answer"] >= STREAM_MAX_TOKENS
    for path in streamed["paths"]:
        assert path["first_chunk_p50_ms"] > 0, path["name"]
        assert path["answer_p50_ms"] >= path["first_chunk_p50_ms"], path["name"]
        assert path["requests_per_s"] > 0, path["name"]
    direct, through_kvplane = streamed["paths"][0], streamed["paths"][1]
    assert direct["cpu_ms_per_request"] is None  # the engine's own CPU is no path's
    assert through_kvplane["cpu_ms_per_request"] > 0

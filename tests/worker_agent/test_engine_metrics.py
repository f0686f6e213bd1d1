"""Engine load and cache configuration from vLLM's and SGLang's Prometheus metrics."""

from __future__ import annotations

import pytest

from simulations.engine_sim.app import cache_config_labels
from simulations.engine_sim.config import EngineSimConfig
from simulations.engine_sim.metrics import EngineMetrics
from worker_agent.engines.base import release_of
from worker_agent.engines.sglang import SglangAdapter
from worker_agent.engines.vllm import VllmAdapter
from worker_agent.events import EngineCacheConfig, EngineLoad

VLLM = VllmAdapter()
SGLANG = SglangAdapter()


def simulator_metrics(
    *, running: int, waiting: int, usage: float, block_size: int = 32, num_blocks: int = 1000
) -> str:
    config = EngineSimConfig(block_size=block_size, num_gpu_blocks_override=num_blocks)
    metrics = EngineMetrics("kvplane-tiny", cache_config_labels(config))
    metrics.running.set(running)
    metrics.waiting.set(waiting)
    metrics.kv_cache_usage.set(usage)
    metrics.prefix_cache_queries.inc(4096)  # other series must not disturb the gauges
    metrics.time_to_first_token.observe(0.05)
    return metrics.render().decode()


def vllm_text(usage_name: str, *engines: tuple[float, float, float]) -> str:
    """vLLM's exposition of (running, waiting, usage) per data-parallel engine."""
    lines = []
    for name, column, doc in [
        ("vllm:num_requests_running", 0, "Number of requests in model execution batches."),
        ("vllm:num_requests_waiting", 1, "Number of requests waiting to be processed."),
        (usage_name, 2, "KV-cache usage. 1 means 100 percent usage."),
    ]:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge"]
        lines += [
            f'{name}{{engine="{index}",model_name="meta-llama/Llama-3.1-8B"}} {values[column]}'
            for index, values in enumerate(engines)
        ]
    return "\n".join(lines) + "\n"


PRE_0_12_TWO_ENGINES = (
    vllm_text("vllm:gpu_cache_usage_perc", (3.0, 1.0, 0.2), (4.0, 5.0, 0.6))
    + "# HELP vllm:gpu_prefix_cache_hits_total Prefix cache hits.\n"
    + "# TYPE vllm:gpu_prefix_cache_hits_total counter\n"
    + 'vllm:gpu_prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 96.0\n'
)


# --- vLLM load --------------------------------------------------------------------------------


def test_vllm_load_from_the_simulators_metrics() -> None:
    text = simulator_metrics(running=3, waiting=2, usage=0.25)
    assert "vllm:kv_cache_usage_perc{" in text  # the current name
    assert VLLM.parse_load(text) == EngineLoad(running=3, waiting=2, kv_usage=0.25)


def test_vllm_load_from_pre_0_12_names_over_two_data_parallel_engines() -> None:
    load = VLLM.parse_load(PRE_0_12_TWO_ENGINES)
    assert (load.running, load.waiting) == (7, 6)  # summed over the engines
    assert load.kv_usage == pytest.approx(0.4)  # averaged: each engine reports its own fraction


def test_vllm_load_from_current_names_over_two_data_parallel_engines() -> None:
    text = vllm_text("vllm:kv_cache_usage_perc", (0.0, 2.0, 0.5), (8.0, 0.0, 1.0))
    assert VLLM.parse_load(text) == EngineLoad(running=8, waiting=2, kv_usage=0.75)


@pytest.mark.parametrize(("usage", "expected"), [(1.25, 1.0), (-0.5, 0.0), (0.0, 0.0), (1.0, 1.0)])
def test_vllm_usage_is_clamped_to_a_fraction(usage: float, expected: float) -> None:
    text = vllm_text("vllm:kv_cache_usage_perc", (1.0, 0.0, usage))
    assert VLLM.parse_load(text).kv_usage == expected


@pytest.mark.parametrize(
    "missing",
    ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"],
)
def test_vllm_load_without_a_gauge_raises(missing: str) -> None:
    text = vllm_text("vllm:kv_cache_usage_perc", (3.0, 1.0, 0.2), (4.0, 5.0, 0.6))
    assert VLLM.parse_load(text) == EngineLoad(7, 6, pytest.approx(0.4))
    kept = "\n".join(line for line in text.splitlines() if missing not in line) + "\n"
    with pytest.raises(ValueError, match="lack vLLM's request and KV cache gauges"):
        VLLM.parse_load(kept)


def test_vllm_load_from_sglang_metrics_raises() -> None:
    text = "sglang:num_running_reqs 1\nsglang:num_queue_reqs 0\nsglang:token_usage 0.1\n"
    with pytest.raises(ValueError, match="lack vLLM's"):
        VLLM.parse_load(text)


GARBAGE = {
    "prose": "this is not a metrics page",
    "html": "<html><body>502 Bad Gateway</body></html>",
    "braces": "{{{",
    "non-numeric value": "vllm:num_requests_running abc\n",
    "unterminated labels": 'vllm:num_requests_running{engine="0" 1\n',
    "control bytes": "\x00\x01\x02",
}


@pytest.mark.parametrize("text", GARBAGE.values(), ids=GARBAGE)
def test_garbage_metrics_raise(text: str) -> None:
    with pytest.raises(ValueError, match=r"unreadable metrics|lack"):
        VLLM.parse_load(text)
    with pytest.raises(ValueError, match=r"unreadable metrics|lack"):
        SGLANG.parse_load(text)
    assert VLLM.parse_cache_config(text) is None  # none of them has the line


@pytest.mark.parametrize(
    "line", [GARBAGE["non-numeric value"], GARBAGE["unterminated labels"]], ids=str
)
def test_a_malformed_line_of_a_metric_read_is_unreadable(line: str) -> None:
    with pytest.raises(ValueError, match="unreadable metrics"):
        VLLM.parse_load(line)
    with pytest.raises(ValueError, match="unreadable metrics"):
        VLLM.parse_cache_config(line.replace("vllm:num_requests_running", "vllm:cache_config_info"))


def test_empty_metrics_raise() -> None:
    with pytest.raises(ValueError, match="lack"):
        VLLM.parse_load("")
    with pytest.raises(ValueError, match="lack"):
        SGLANG.parse_load("")


def test_vllm_nan_usage_is_not_a_load() -> None:
    text = vllm_text("vllm:kv_cache_usage_perc", (1.0, 0.0, float("nan")))
    try:
        load = VLLM.parse_load(text)
    except ValueError:
        return
    assert 0.0 <= load.kv_usage <= 1.0


def test_vllm_infinite_request_gauge_raises_value_error() -> None:
    text = vllm_text("vllm:kv_cache_usage_perc", (float("inf"), 0.0, 0.5))
    with pytest.raises(ValueError):  # noqa: PT011 - the adapter contract is a bare ValueError
        VLLM.parse_load(text)


# --- vLLM cache configuration ----------------------------------------------------------------


def test_vllm_cache_config_from_the_simulators_metrics() -> None:
    text = simulator_metrics(running=0, waiting=0, usage=0.0, block_size=16, num_blocks=4096)
    assert VLLM.parse_cache_config(text) == EngineCacheConfig(block_size=16, num_blocks=4096)


def test_vllm_cache_config_from_a_hand_written_info_gauge() -> None:
    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",'
        'num_cpu_blocks="0",num_gpu_blocks="27034",num_gpu_blocks_override="None"} 1.0\n'
        + PRE_0_12_TWO_ENGINES
    )
    assert VLLM.parse_cache_config(text) == EngineCacheConfig(block_size=32, num_blocks=27034)


def test_vllm_cache_config_before_profiling_has_no_block_count() -> None:
    text = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
    assert VLLM.parse_cache_config(text) == EngineCacheConfig(block_size=16, num_blocks=None)


def test_vllm_cache_config_without_labels_has_none() -> None:
    text = 'vllm:cache_config_info{cache_dtype="auto"} 1.0\n'
    assert VLLM.parse_cache_config(text) == EngineCacheConfig(block_size=None, num_blocks=None)


def test_vllm_cache_config_absent() -> None:
    assert VLLM.parse_cache_config(PRE_0_12_TWO_ENGINES) is None
    assert VLLM.parse_cache_config("") is None


# --- SGLang -----------------------------------------------------------------------------------

SGLANG_TEXT = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen3-0.6B",tp_rank="0"} 5.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="Qwen/Qwen3-0.6B",tp_rank="0"} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="Qwen/Qwen3-0.6B",tp_rank="0"} 0.3
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{engine_type="unified",model_name="Qwen/Qwen3-0.6B",tp_rank="0"} 0.9
"""


def test_sglang_load() -> None:
    assert SGLANG.parse_load(SGLANG_TEXT) == EngineLoad(running=5, waiting=2, kv_usage=0.3)


def test_sglang_usage_is_clamped_to_a_fraction() -> None:
    text = SGLANG_TEXT.replace("} 0.3", "} 1.7")
    assert SGLANG.parse_load(text).kv_usage == 1.0


@pytest.mark.parametrize(
    "missing", ["sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"]
)
def test_sglang_load_without_a_gauge_raises(missing: str) -> None:
    text = "\n".join(line for line in SGLANG_TEXT.splitlines() if missing not in line) + "\n"
    with pytest.raises(ValueError, match="lack SGLang's request and token gauges"):
        SGLANG.parse_load(text)


def test_sglang_load_from_vllm_metrics_raises() -> None:
    with pytest.raises(ValueError, match="lack SGLang's"):
        SGLANG.parse_load(simulator_metrics(running=1, waiting=1, usage=0.5))


def test_sglang_has_no_cache_config() -> None:
    assert SGLANG.parse_cache_config(SGLANG_TEXT) is None


def test_sglang_token_usage_is_averaged_over_data_parallel_ranks() -> None:
    text = "".join(
        f'sglang:num_running_reqs{{dp_rank="{rank}",tp_rank="0"}} {running}\n'
        f'sglang:num_queue_reqs{{dp_rank="{rank}",tp_rank="0"}} {waiting}\n'
        f'sglang:token_usage{{dp_rank="{rank}",tp_rank="0"}} {usage}\n'
        for rank, (running, waiting, usage) in enumerate([(2, 1, 0.25), (3, 1, 0.75)])
    )
    assert SGLANG.parse_load(text) == EngineLoad(running=5, waiting=2, kv_usage=0.5)


@pytest.mark.parametrize(
    ("version", "warned"),
    [("0.5.17", True), ("0.5.9", True), ("0.5.18", False), ("0.5.18.post1", False),
     ("0.6", False), ("main", False)],
)  # fmt: skip
def test_sglang_releases_that_share_hashes_across_tenants_are_named(
    version: str, warned: bool
) -> None:
    warnings = SglangAdapter().release_warnings(version)
    assert bool(warnings) == warned
    assert all(version in warning and "0.5.18" in warning for warning in warnings)
    assert VllmAdapter().release_warnings(version) == []


def test_a_release_is_read_from_its_leading_numbers() -> None:
    assert release_of("0.5.18.post1") == (0, 5, 18)
    assert release_of("0.33") == (0, 33, 0)
    assert release_of("v0.33") is None

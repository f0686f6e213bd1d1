"""The interface every engine adapter implements, and Prometheus text helpers."""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable
from typing import Protocol

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvplane.core.kv_transfer import KvTransferConfig
from worker_agent.engines.kv_event_wire import DecodedBatch
from worker_agent.events import (
    EngineCacheConfig,
    EngineLoad,
    PrefixCacheCounters,
)


class EngineAdapter(Protocol):
    kind: str
    version_path: str  # where the engine says its release: a JSON object with "version"

    def decode_batch(self, payload: bytes) -> DecodedBatch:
        """A KV event batch's timestamp, usable events and skipped events;
        WireDecodeError if its envelope is broken."""
        ...

    def parse_load(self, metrics_text: str) -> EngineLoad:
        """Load from the engine's /metrics text; ValueError if the metrics are missing."""
        ...

    def parse_cache_config(self, metrics_text: str) -> EngineCacheConfig | None:
        """The cache configuration the engine exposes in its metrics, if any."""
        ...

    def parse_kv_transfer_config(self, metrics_text: str) -> KvTransferConfig | None:
        """The engine's KV connector and role, as far as its metrics show them; None
        where they do not."""
        ...

    def parse_prefix_cache(self, metrics_text: str) -> PrefixCacheCounters | None:
        """The engine's prefix-cache counters, if its metrics have them (ValueError if
        they do not parse)."""
        ...

    def release_warnings(self, version: str) -> list[str]:
        """What is known to go wrong with this release of the engine, one line each."""
        ...


_RELEASE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


def release_of(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version string such as "0.5.18.post1"; None if it
    starts otherwise."""
    found = _RELEASE.match(version)
    if found is None:
        return None
    major, minor, patch = found.groups()
    return int(major), int(minor), int(patch or 0)


_METRIC_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_samples(metrics_text: str, names: Collection[str]) -> list[Sample]:
    """The samples of the metrics `names` in a Prometheus text exposition; ValueError if
    they do not parse. Only their lines are parsed: parsing an engine's whole exposition
    (its histograms above all) costs milliseconds, every load interval, in every agent."""
    prefixes = tuple(names)  # str.startswith in C first: most lines are other metrics
    lines = [
        line
        for line in metrics_text.splitlines()
        if line.startswith(prefixes) and _sample_name(line) in names
    ]
    try:
        return [
            sample
            for family in text_string_to_metric_families("\n".join(lines) + "\n")
            for sample in family.samples
        ]
    except Exception as error:  # the parser raises bare ValueError, TypeError, ...
        raise ValueError(f"unreadable metrics: {type(error).__name__}") from None


def metric_families(metrics_text: str) -> set[str]:
    """The names of the families a Prometheus text exposition declares (`# TYPE`) or
    has samples of, whether or not any sample has a value yet."""
    names = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split(" ", 3)[2])
        elif name := _sample_name(line):
            names.add(name)
    return names


def _sample_name(line: str) -> str:
    """The metric name a sample line starts with ('' for comments and blank lines)."""
    name = _METRIC_NAME.match(line)
    return name.group() if name else ""


def values(samples: Iterable[Sample], *names: str) -> list[float]:
    """Every finite value (one per data-parallel engine) of the first name present;
    ValueError if any is NaN or infinite."""
    samples = list(samples)
    for name in names:
        found = [float(sample.value) for sample in samples if sample.name == name]
        if found:
            if not all(math.isfinite(value) for value in found):
                raise ValueError(f"{name} is not a finite number")
            return found
    return []


def total(samples: Iterable[Sample], *names: str) -> float | None:
    """The sum over data-parallel engines of the first name present."""
    found = values(samples, *names)
    return sum(found) if found else None


def mean(samples: Iterable[Sample], *names: str) -> float | None:
    """The mean over data-parallel engines (each reports its own fraction)."""
    found = values(samples, *names)
    return sum(found) / len(found) if found else None


_START_TIME = ("process_start_time_seconds",)


def process_start_time(metrics_text: str) -> float | None:
    """The engine process's start time (prometheus_client's standard process metrics,
    which vLLM and SGLang expose): a change means the engine restarted."""
    try:
        start = total(metric_samples(metrics_text, _START_TIME), _START_TIME[0])
    except ValueError:
        return None
    return start


def prefix_cache_counters(
    metrics_text: str, queried: tuple[str, ...], hits: tuple[str, ...], prefilled: str
) -> PrefixCacheCounters | None:
    """Sums over data-parallel engines (and labels) of the first names present; None
    unless all three are."""
    samples = metric_samples(metrics_text, {*queried, *hits, prefilled})
    queried_tokens, hit_tokens = total(samples, *queried), total(samples, *hits)
    prefilled_requests = total(samples, prefilled)
    if queried_tokens is None or hit_tokens is None or prefilled_requests is None:
        return None
    return PrefixCacheCounters(queried_tokens, hit_tokens, prefilled_requests)

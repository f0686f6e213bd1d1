"""Engine adapters: each turns one engine's wire messages and metrics into the agent's
domain events and nothing else. Adding an engine means adding one module here."""

from __future__ import annotations

from worker_agent.engines.base import EngineAdapter
from worker_agent.engines.sglang import SglangAdapter
from worker_agent.engines.vllm import VllmAdapter

ADAPTERS: dict[str, type[EngineAdapter]] = {"vllm": VllmAdapter, "sglang": SglangAdapter}


def adapter_for(kind: str) -> EngineAdapter:
    return ADAPTERS[kind]()

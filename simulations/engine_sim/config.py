"""Every setting of `kvplane engine-sim`, typed, in one place.

Flags are generated from the fields below, so `--help` documents each one with its
default. Where vLLM has a flag for the same setting the field carries vLLM's name and
format (`--block-size`, `--num-gpu-blocks-override`, `--kv-events-config '{...}'`, ...),
so the simulator drops into a script or manifest written for vLLM. Every field can also
be set from the environment as `KVPLANE_ENGINE_SIM_<FIELD>`; flags win.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvplane.core.flags import add_model_flags, given_flags
from simulations.engine_sim.kv_events import WireFormat
from simulations.engine_sim.scheduler import SchedulerLimits
from simulations.engine_sim.timing import TimingModel

_DEFAULT_TIMING = TimingModel()


class KVEventsConfig(BaseModel):
    """vLLM's `--kv-events-config` JSON, with vLLM's defaults."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    enable_kv_cache_events: bool = False
    publisher: Literal["zmq", "null"] = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = Field(default=10_000, ge=1)
    hwm: int = Field(default=100_000, ge=0)
    topic: str = ""

    @property
    def publishing(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


class EngineSimConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVPLANE_ENGINE_SIM_", frozen=True)

    # Serving (vLLM's flags).
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0: any free port)")
    model: str = Field("kvplane-tiny", description="name of the simulated model")
    served_model_name: list[str] | None = Field(
        None, description="names the API answers to (default: --model); the first is reported"
    )
    tokenizer: Path | None = Field(
        None, description="Hugging Face tokenizer directory (default: kvplane's tiny tokenizer)"
    )
    lora_modules: list[str] = Field(
        default_factory=list,
        description="LoRA adapters served as extra models: NAME or NAME=PATH (path unused)",
    )
    max_model_len: int = Field(8192, ge=2, description="longest prompt plus output, in tokens")
    enable_scale_out: bool = Field(
        False,
        description="serve the render endpoints (/v1/completions/render, "
        "/v1/chat/completions/render) that routers such as vllm-router tokenise through; "
        "off, they answer 403 as vLLM's do",
    )
    seed: int = Field(0, description="seed of the generated output tokens")

    # KV cache (vLLM's flags).
    block_size: int = Field(16, ge=1, le=4096, description="tokens per KV block")
    num_gpu_blocks_override: int | None = Field(
        None, ge=1, description="KV blocks in the cache (default 8192)"
    )
    enable_prefix_caching: bool = Field(True, description="reuse cached prefixes")
    enable_prompt_tokens_details: bool = Field(
        True,
        description="report usage.prompt_tokens_details.cached_tokens (vLLM's default: off)",
    )
    kv_events_config: KVEventsConfig = Field(
        KVEventsConfig(),
        description="KV event publishing, vLLM's JSON: enable_kv_cache_events, publisher, "
        "endpoint, replay_endpoint, buffer_steps, hwm, topic",
    )

    # Scheduling (vLLM's flags).
    max_num_seqs: int = Field(256, ge=1, description="most requests running at once")
    max_num_batched_tokens: int = Field(8192, ge=1, description="token budget of one step")

    # Timing model (simulator only): see simulations/engine_sim/timing.py.
    time_scale: float = Field(
        1.0, ge=0, description="multiplies every modelled duration (0: no waiting at all)"
    )
    prefill_ms_per_token: float = Field(
        _DEFAULT_TIMING.prefill_ms_per_token, ge=0, description="prefill time per uncached token"
    )
    prefill_overhead_ms: float = Field(
        _DEFAULT_TIMING.prefill_overhead_ms, ge=0, description="fixed cost of a step that prefills"
    )
    decode_step_ms: float = Field(
        _DEFAULT_TIMING.decode_step_ms, ge=0, description="fixed cost of a step that decodes"
    )
    decode_ms_per_request: float = Field(
        _DEFAULT_TIMING.decode_ms_per_request, ge=0, description="decode step cost per request"
    )
    decode_ms_per_context_token: float = Field(
        _DEFAULT_TIMING.decode_ms_per_context_token,
        ge=0,
        description="decode step cost per token of context across the batch",
    )

    # Wire forms and hashing (simulator only).
    kv_events_format: WireFormat = Field(
        WireFormat.VLLM_0_32, description="which vLLM release's event bytes to send"
    )
    hash_seed: str = Field(
        "", description="seeds the engine's block hashes (like PYTHONHASHSEED for vLLM)"
    )

    # Faults (simulator only); more at run time through POST /sim/faults.
    fail_after_requests: int | None = Field(
        None, ge=0, description="serve N requests, then die abruptly when the next arrives"
    )
    drop_event_fraction: float = Field(
        0.0, ge=0, le=1, description="fraction of event batches not sent (a sequence gap)"
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="logging threshold"
    )

    @field_validator("kv_events_config", mode="before")
    @classmethod
    def _parse_json(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"not valid JSON ({error.msg})") from None
        return value

    @model_validator(mode="after")
    def _check_lora_names(self) -> EngineSimConfig:
        if set(self.lora_names) & set(self.model_names):
            raise ValueError("a LoRA module cannot have a served model's name")
        return self

    @property
    def model_names(self) -> list[str]:
        return self.served_model_name or [self.model]

    @property
    def lora_names(self) -> list[str]:
        return [module.split("=", 1)[0] for module in self.lora_modules]

    @property
    def num_blocks(self) -> int:
        return self.num_gpu_blocks_override or 8192

    @property
    def timing(self) -> TimingModel:
        return TimingModel(
            prefill_ms_per_token=self.prefill_ms_per_token,
            prefill_overhead_ms=self.prefill_overhead_ms,
            decode_step_ms=self.decode_step_ms,
            decode_ms_per_request=self.decode_ms_per_request,
            decode_ms_per_context_token=self.decode_ms_per_context_token,
        )

    @property
    def limits(self) -> SchedulerLimits:
        return SchedulerLimits(self.max_num_seqs, self.max_num_batched_tokens)


def add_engine_sim_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field of EngineSimConfig, named after the field."""
    add_model_flags(parser, EngineSimConfig)


def config_from_args(args: argparse.Namespace) -> EngineSimConfig:
    """Flags given on the command line over environment over defaults."""
    return EngineSimConfig(**given_flags(args, EngineSimConfig.model_fields))

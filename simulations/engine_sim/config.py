"""Every setting of `kvplane engine-sim`, typed, in one place.

Flags are generated from the fields below, so `--help` documents each one with its
default. Where vLLM has a flag for the same setting the field carries vLLM's name and
format (`--block-size`, `--num-gpu-blocks-override`, `--kv-events-config '{...}'`,
`--kv-transfer-config '{...}'`, `--kv-offloading-size`, ...),
so the simulator drops into a script or manifest written for vLLM. Every field can also
be set from the environment as `KVPLANE_ENGINE_SIM_<FIELD>`; flags win.
"""

from __future__ import annotations

import argparse
import json
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvplane.core.flags import add_model_flags, given_flags
from simulations.engine_sim.kv_events import WireFormat
from simulations.engine_sim.protocol import validation_message
from simulations.engine_sim.scheduler import SchedulerLimits
from simulations.engine_sim.timing import TimingModel

_DEFAULT_TIMING = TimingModel()

# The KV connectors the simulator models: vLLM's pull-mode P/D (kv_transfer.py) and its
# native CPU offloading (offload.py). vLLM runs two at once only under MultiConnector.
NIXL_CONNECTOR = "NixlConnector"
OFFLOADING_CONNECTOR = "OffloadingConnector"
_CONNECTORS = (NIXL_CONNECTOR, OFFLOADING_CONNECTOR)
_GIB = 1 << 30
# vLLM pads each offloaded block to whole memory pages (CPUOffloadingSpec).
_PAGE_BYTES = mmap.PAGESIZE


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


class KVTransferConfig(BaseModel):
    """vLLM's `--kv-transfer-config` JSON: the fields the simulator reads, vLLM's names."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    kv_connector: str | None = None  # None: no P/D
    # Required with a connector, as vLLM requires it. NixlConnector itself treats every
    # role alike (either engine may serve either leg), and so does the simulator.
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] | None = None
    kv_buffer_device: Literal["cuda", "cpu"] = "cuda"  # reported only: there is no device
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    # Read for OffloadingConnector (OffloadingExtraConfig), not for NixlConnector.
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _role_of_a_connector(self) -> KVTransferConfig:
        if self.kv_connector is not None and self.kv_role is None:
            # vLLM's words (vllm/config/kv_transfer.py).
            raise ValueError("Please specify kv_role when kv_connector is set")
        return self

    @field_validator("kv_connector")
    @classmethod
    def _simulated_connector(cls, name: str | None) -> str | None:
        if name is not None and name not in _CONNECTORS:
            raise ValueError(
                f"the simulator models only {NIXL_CONNECTOR} and {OFFLOADING_CONNECTOR}, "
                f"not {name!r}"
            )
        return name

    @model_validator(mode="after")
    def _offloading_extra_config(self) -> KVTransferConfig:
        if self.kv_connector == OFFLOADING_CONNECTOR:
            self.offloading_extra_config()  # refuses what the simulator does not model
        return self

    def offloading_extra_config(self) -> OffloadingExtraConfig:
        try:
            return OffloadingExtraConfig.model_validate(self.kv_connector_extra_config)
        except ValidationError as error:
            raise ValueError(
                f"kv_connector_extra_config of {OFFLOADING_CONNECTOR}: {validation_message(error)}"
            ) from None


class OffloadingExtraConfig(BaseModel):
    """The `kv_connector_extra_config` keys of vLLM's OffloadingConnector that change what
    the simulator does; a setting it does not model is refused, other keys ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    cpu_bytes_to_use: float | None = Field(None, gt=0)  # --kv-offloading-size sets it
    offload_prompt_only: bool = True  # vLLM's default: decode-phase blocks stay on the device
    eviction_policy: Literal["lru"] = "lru"  # vLLM also has "arc"
    spec_name: Literal["CPUOffloadingSpec"] = "CPUOffloadingSpec"
    # One block per offloaded chunk (vLLM's default); checked against --block-size.
    blocks_per_chunk: Literal[1] | None = None
    block_size: int | None = None
    store_threshold: int = Field(0, le=1)  # 2 or more: vLLM's reuse filter
    self_describing_kv_events: Literal[False] = False  # opt-in stores with their tokens


@dataclass(frozen=True, slots=True)
class CPUOffloading:
    """The CPU tier the configuration asks for (simulations/engine_sim/offload.py)."""

    num_blocks: int
    offload_prompt_only: bool


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

    kv_transfer_config: KVTransferConfig = Field(
        KVTransferConfig(),
        description="vLLM's JSON: kv_connector (NixlConnector: prefill/decode "
        "disaggregation; OffloadingConnector: CPU offloading, kv_connector_extra_config "
        "cpu_bytes_to_use and offload_prompt_only; or none), kv_role, kv_buffer_device, "
        "kv_load_failure_policy (fail or recompute)",
    )
    kv_offloading_size: float | None = Field(
        None,
        gt=0,
        description="GiB of CPU memory for offloaded KV blocks: vLLM's native CPU "
        "offloading (OffloadingConnector), as many blocks of --block-size x "
        "--kv-bytes-per-token as fit",
    )
    kv_offloading_backend: Literal["native"] = Field(
        "native", description="vLLM's offloading backend (its lmcache is not modelled)"
    )

    # Scheduling (vLLM's flags).
    max_num_seqs: int = Field(256, ge=1, description="most requests running at once")
    max_num_batched_tokens: int = Field(8192, ge=1, description="token budget of one step")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="fcfs: requests are served in order of arrival, and a request's "
        "priority is ignored; priority: by the request's priority (lower first), then "
        "arrival, and the running request with the largest is preempted first",
    )

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

    # The P/D transfer model (simulator only): see simulations/engine_sim/kv_transfer.py.
    kv_bytes_per_token: int = Field(
        131_072,
        ge=1,
        description="the model's KV cache bytes per token (default: an 8B model such as "
        "Llama 3 8B in fp16, K and V x 32 layers x 8 KV heads x 128 dims x 2 bytes)",
    )
    kv_transfer_bytes_per_s: float = Field(
        25e9, gt=0, description="bandwidth of the link a decode engine pulls KV blocks over"
    )
    kv_lease_s: float = Field(
        30.0,
        ge=0,
        description="how long a prefill engine keeps a finished request's blocks for the "
        "decode engine to pull (vLLM's kv_lease_duration)",
    )

    # The CPU offloading model (simulator only): see simulations/engine_sim/offload.py.
    cpu_offload_blocks: int | None = Field(
        None,
        ge=1,
        description="turn CPU offloading on with a CPU tier of this many blocks (instead of "
        "--kv-offloading-size or cpu_bytes_to_use)",
    )
    kv_offload_bytes_per_s: float = Field(
        20e9,
        gt=0,
        description="bandwidth of the copies between device and CPU blocks, both ways "
        "(20e9: about PCIe 4.0 x16)",
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

    @field_validator("kv_events_config", "kv_transfer_config", mode="before")
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

    @model_validator(mode="after")
    def _check_pulled_blocks_can_be_cached(self) -> EngineSimConfig:
        # The decode side receives pulled blocks into its prefix cache (vLLM writes them
        # into the request's own blocks, which the simulator does not model apart).
        if self.pd and not self.enable_prefix_caching:
            raise ValueError(
                f"--kv-transfer-config with {NIXL_CONNECTOR} needs --enable-prefix-caching: "
                "the simulator caches the blocks a decode engine pulls"
            )
        return self

    @model_validator(mode="after")
    def _check_offloading(self) -> EngineSimConfig:
        sizes = []  # where the CPU tier's size comes from
        if self.cpu_offload_blocks is not None:
            sizes.append("--cpu-offload-blocks")
        if self.kv_offloading_size is not None:
            sizes.append("--kv-offloading-size")
        if sizes and self.kv_transfer_config.kv_connector == NIXL_CONNECTOR:
            # vLLM's --kv-offloading-size would replace the connector with its own.
            raise ValueError(
                f"{sizes[0]} with {NIXL_CONNECTOR}: vLLM runs CPU offloading beside P/D "
                "only under MultiConnector, which the simulator does not model"
            )
        if self.kv_connector != OFFLOADING_CONNECTOR:
            return self
        extra = self.kv_transfer_config.offloading_extra_config()
        if extra.cpu_bytes_to_use is not None and self.kv_offloading_size is None:
            sizes.append("cpu_bytes_to_use")
        if not sizes:
            raise ValueError(
                "cpu_bytes_to_use must be specified in kv_connector_extra_config (vLLM's "
                "words), or the simulator's --cpu-offload-blocks"
            )
        if len(sizes) > 1 and self.cpu_offload_blocks is not None:
            raise ValueError(f"the CPU tier's size is given twice: {' and '.join(sizes)}")
        if extra.block_size not in (None, self.block_size):
            raise ValueError(
                f"kv_connector_extra_config block_size {extra.block_size}: the simulator "
                f"offloads one block of {self.block_size} tokens at a time"
            )
        if self.kv_events_format is WireFormat.VLLM_0_9:
            raise ValueError(
                "CPU offloading with --kv-events-format vllm-0.9: that release had no "
                "offloading, and its events name no medium"
            )
        if self.cpu_offloading is None:
            raise ValueError(
                f"the CPU tier would hold no block: {self._cpu_bytes():.0f} bytes for "
                f"blocks of {self._padded_block_bytes()} bytes"
            )
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
    def kv_connector(self) -> str | None:
        """The connector the engine runs: as vLLM, --kv-offloading-size (and here
        --cpu-offload-blocks) makes it OffloadingConnector."""
        if self.kv_offloading_size is not None or self.cpu_offload_blocks is not None:
            return OFFLOADING_CONNECTOR
        return self.kv_transfer_config.kv_connector

    @property
    def kv_role(self) -> str | None:
        if self.kv_transfer_config.kv_connector is None and self.kv_connector is not None:
            return "kv_both"  # vLLM's role for the connector --kv-offloading-size sets
        return self.kv_transfer_config.kv_role

    @property
    def pd(self) -> bool:
        """Prefill/decode disaggregation (NixlConnector) is on."""
        return self.kv_connector == NIXL_CONNECTOR

    @property
    def cpu_offloading(self) -> CPUOffloading | None:
        """The CPU tier, if the engine offloads; sized as vLLM's CPUOffloadingSpec sizes
        it: the bytes given over each block's bytes, padded to whole pages."""
        if self.kv_connector != OFFLOADING_CONNECTOR:
            return None
        extra = self.kv_transfer_config.offloading_extra_config()
        num_blocks = self.cpu_offload_blocks or int(self._cpu_bytes()) // self._padded_block_bytes()
        if not num_blocks:
            return None
        return CPUOffloading(num_blocks, extra.offload_prompt_only)

    def _cpu_bytes(self) -> float:
        if self.kv_offloading_size is not None:
            return self.kv_offloading_size * _GIB  # vLLM's cpu_bytes_to_use for it
        return self.kv_transfer_config.offloading_extra_config().cpu_bytes_to_use or 0.0

    def _padded_block_bytes(self) -> int:
        block_bytes = self.block_size * self.kv_bytes_per_token
        return -(-block_bytes // _PAGE_BYTES) * _PAGE_BYTES

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

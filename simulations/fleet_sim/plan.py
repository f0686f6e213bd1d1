"""`kvplane plan`: how much KV cache a replica holds, from the model's exact config.

KV bytes per token = 2 (keys and values) x layers x KV heads x head dim x bytes per
element, read from a Hugging Face `config.json` (multi-latent attention, as in
DeepSeek V2/V3, caches one latent of `kv_lora_rank + qk_rope_head_dim` per layer
instead). The cache of a replica is what its GPUs keep for it: memory x utilisation
per GPU, less the weights and a reserve for activations. Nothing here is a
universal figure: a different config gives a different answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_DTYPE_BYTES = {
    "float32": 4, "float": 4, "fp32": 4,
    "bfloat16": 2, "float16": 2, "half": 2, "bf16": 2, "fp16": 2,
    "float8": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
}  # fmt: skip
GIB = 2**30


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    latent_dim: int | None  # multi-latent attention: one latent per layer and token
    dtype_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        if self.latent_dim is not None:
            return self.layers * self.latent_dim * self.dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


def model_shape(config: dict[str, Any], kv_dtype: str | None = None) -> ModelShape:
    """The KV-relevant shape of a Hugging Face config (a text config nested under
    `text_config`, as multimodal models have it, is used when present)."""
    config = config.get("text_config", config)
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"the model config lacks {error} (a decoder's config.json?)") from None
    dtype = (
        kv_dtype or str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    ).lower()
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {dtype!r} (known: {', '.join(sorted(_DTYPE_BYTES))})")
    latent = None
    if config.get("kv_lora_rank"):
        latent = int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim") or 0)
    return ModelShape(layers, kv_heads, head_dim, latent, _DTYPE_BYTES[dtype])


def read_model_config(path: Path) -> dict[str, Any]:
    """A Hugging Face `config.json`, or the one in the model directory `path`."""
    config_file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read the model config {config_file}: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} is not a JSON object (a config.json?)")
    return config


def read_model_shape(path: Path, kv_dtype: str | None = None) -> ModelShape:
    return model_shape(read_model_config(path), kv_dtype)


@dataclass(frozen=True, slots=True)
class Replica:
    gpus: int  # tensor parallelism: the weights and the cache are split over them
    gpu_memory_gib: float
    memory_utilization: float  # vLLM's --gpu-memory-utilization
    weights_gib: float  # the whole model, all GPUs together
    reserve_gib_per_gpu: float  # activations, CUDA graphs, fragmentation


@dataclass(frozen=True, slots=True)
class Plan:
    kv_bytes_per_token: int
    kv_cache_gib: float  # per replica
    tokens_per_replica: int
    blocks_per_replica: int
    blocks_per_gpu: int
    replicas: int
    fleet_tokens: int
    mean_request_tokens: float | None  # prompt + output, of the workload
    concurrent_requests: int | None  # the fleet's cache holds this many at once


def plan(
    shape: ModelShape,
    replica: Replica,
    *,
    replicas: int,
    block_size: int = 16,
    mean_request_tokens: float | None = None,
) -> Plan:
    usable = replica.gpus * (
        replica.gpu_memory_gib * replica.memory_utilization - replica.reserve_gib_per_gpu
    )
    cache_gib = usable - replica.weights_gib
    if cache_gib <= 0:
        raise ValueError(
            f"no room for a KV cache: {usable:.1f} GiB usable on {replica.gpus} GPU(s), "
            f"{replica.weights_gib:.1f} GiB of weights"
        )
    tokens = int(cache_gib * GIB // shape.kv_bytes_per_token)
    blocks = tokens // block_size
    fleet_tokens = blocks * block_size * replicas
    concurrent = None
    if mean_request_tokens:
        concurrent = int(fleet_tokens // mean_request_tokens)
    return Plan(
        kv_bytes_per_token=shape.kv_bytes_per_token,
        kv_cache_gib=round(cache_gib, 2),
        tokens_per_replica=blocks * block_size,
        blocks_per_replica=blocks,
        blocks_per_gpu=blocks // replica.gpus,
        replicas=replicas,
        fleet_tokens=fleet_tokens,
        mean_request_tokens=mean_request_tokens,
        concurrent_requests=concurrent,
    )

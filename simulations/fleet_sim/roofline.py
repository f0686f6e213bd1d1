"""A timing model for a model and GPU, from the model's exact config and the GPU's
datasheet: a roofline estimate, for fleets the default timing model does not describe
(llm-d's benchmark ran Qwen3-32B on two H100s per replica, say).

Prefill is bound by arithmetic: 2 FLOPs per weight of the decoder layers per token,
at a fraction (`compute`) of the GPU's dense bf16 peak. A decode step is bound by
memory: every step reads all the weights once (the step's base time) and every
decoding request's KV (time per context token, at a fraction `memory` of the
bandwidth), plus each new token's own arithmetic (time per request). Any step pays
the engine's own CPU work (`step_overhead_ms`: scheduling, sampling). Tensor
parallelism divides weights, FLOPs and KV heads between the GPUs; the all-reduces
between them are not modelled.

A step that both prefills and decodes pays the weight read twice (once in each
term): the timing model adds its two parts, which is conservative for mixed steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulations.engine_sim.timing import TimingModel
from simulations.fleet_sim.plan import model_shape, read_model_config


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    dense_bf16_flops: float  # per second, the datasheet's dense (not sparse) figure
    memory_bytes_per_s: float


# Datasheet figures (SXM parts).
GPUS = {
    "a100": Gpu("A100 SXM 80GB", 312e12, 2.039e12),
    "h100": Gpu("H100 SXM", 989e12, 3.35e12),
    "h200": Gpu("H200 SXM", 989e12, 4.8e12),
}


@dataclass(frozen=True, slots=True)
class Efficiency:
    """What fraction of the datasheet an engine reaches; assumptions, not measurements:
    about half the peak for large prefill matrix products, four fifths of the memory
    bandwidth for streaming weights and KV."""

    compute: float = 0.5
    memory: float = 0.8
    step_overhead_ms: float = 2.0


@dataclass(frozen=True, slots=True)
class DecoderSize:
    layer_weights: int  # parameters of the decoder layers (what every token multiplies)
    head_weights: int  # the output projection to the vocabulary
    weight_bytes: int  # what a step reads: layers, output head, at the config's dtype
    kv_bytes_per_token: int


def decoder_size(config: dict[str, Any], kv_dtype: str | None = None) -> DecoderSize:
    """Parameter counts of a dense decoder with a gated MLP (Llama, Qwen, Mistral)."""
    text = config.get("text_config", config)
    if any(key in text for key in ("num_experts", "n_routed_experts", "num_local_experts")):
        raise ValueError("mixture-of-experts configs are not modelled (dense decoders only)")
    shape = model_shape(config, kv_dtype)
    try:
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        intermediate = int(text["intermediate_size"])
        vocab = int(text["vocab_size"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"the model config lacks {error} (a decoder's config.json?)") from None
    attention = hidden * (heads + 2 * shape.kv_heads) * shape.head_dim
    attention += heads * shape.head_dim * hidden
    layer_weights = shape.layers * (attention + 3 * hidden * intermediate)
    head_weights = hidden * vocab
    weight_bytes = (layer_weights + head_weights) * _weight_dtype_bytes(text)
    return DecoderSize(layer_weights, head_weights, weight_bytes, shape.kv_bytes_per_token)


def _weight_dtype_bytes(config: dict[str, Any]) -> int:
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").lower()
    return 4 if dtype in {"float32", "float", "fp32"} else 2


def roofline_timing(
    size: DecoderSize,
    gpu: Gpu,
    tensor_parallel: int = 1,
    efficiency: Efficiency = Efficiency(),
) -> TimingModel:
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be at least 1, got {tensor_parallel}")
    flops = gpu.dense_bf16_flops * efficiency.compute * tensor_parallel / 1000  # per ms
    bandwidth = gpu.memory_bytes_per_s * efficiency.memory * tensor_parallel / 1000  # per ms
    weight_read_ms = size.weight_bytes / bandwidth
    return TimingModel(
        prefill_ms_per_token=2 * size.layer_weights / flops,
        prefill_overhead_ms=efficiency.step_overhead_ms + weight_read_ms,
        decode_step_ms=efficiency.step_overhead_ms + weight_read_ms,
        decode_ms_per_request=2 * (size.layer_weights + size.head_weights) / flops,
        decode_ms_per_context_token=size.kv_bytes_per_token / bandwidth,
    )


def read_roofline_timing(
    config_path: Path, gpu: str, tensor_parallel: int = 1, kv_dtype: str | None = None
) -> TimingModel:
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r} (known: {', '.join(sorted(GPUS))})")
    size = decoder_size(read_model_config(config_path), kv_dtype)
    return roofline_timing(size, GPUS[gpu], tensor_parallel)

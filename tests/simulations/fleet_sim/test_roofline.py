"""The roofline timing model: parameter counts from a config, each timing field from
the datasheet and the efficiency assumptions, tensor parallelism, and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulations.engine_sim.timing import StepWork, step_seconds
from simulations.fleet_sim.roofline import (
    GPUS,
    Efficiency,
    decoder_size,
    read_roofline_timing,
    roofline_timing,
)

MODELS = Path(__file__).resolve().parents[3] / "simulations" / "models"


def test_llama3_8b_has_its_published_parameter_count() -> None:
    size = decoder_size(json.loads((MODELS / "llama3-8b.json").read_text()))
    # Per layer: attention 4096 x (32 + 2 x 8) x 128 + 32 x 128 x 4096, MLP 3 x 4096 x 14336.
    assert size.layer_weights == 32 * (4096 * 48 * 128 + 4096 * 4096 + 3 * 4096 * 14336)
    assert size.head_weights == 4096 * 128_256
    # With the input embedding (not read by a step) that is Llama 3 8B's 8.03 billion.
    assert (size.layer_weights + 2 * size.head_weights) / 1e9 == pytest.approx(8.03, abs=0.01)
    assert size.weight_bytes == 2 * (size.layer_weights + size.head_weights)
    assert size.kv_bytes_per_token == 131_072


def test_each_field_follows_from_the_datasheet_and_the_efficiencies() -> None:
    size = decoder_size(json.loads((MODELS / "qwen3-32b.json").read_text()))
    h100, efficiency = GPUS["h100"], Efficiency()
    one = roofline_timing(size, h100)
    flops_per_ms = 989e12 * 0.5 / 1000
    bytes_per_ms = 3.35e12 * 0.8 / 1000
    assert one.prefill_ms_per_token == pytest.approx(2 * size.layer_weights / flops_per_ms)
    assert one.decode_step_ms == pytest.approx(2.0 + size.weight_bytes / bytes_per_ms)
    assert one.prefill_overhead_ms == one.decode_step_ms
    assert one.decode_ms_per_context_token == pytest.approx(262_144 / bytes_per_ms)
    # Two GPUs share the arithmetic, the weights and the KV heads; not the CPU's work.
    two = roofline_timing(size, h100, tensor_parallel=2, efficiency=efficiency)
    assert two.prefill_ms_per_token == pytest.approx(one.prefill_ms_per_token / 2)
    assert two.decode_step_ms - 2.0 == pytest.approx((one.decode_step_ms - 2.0) / 2)
    # A decode step of 32 requests of 8k context on Qwen3-32B, 2 x H100: tens of ms.
    step = step_seconds(two, StepWork(0, 32, 32 * 8192))
    assert 0.02 < step < 0.05
    # A faster memory makes decoding, not prefill, faster.
    h200 = roofline_timing(size, GPUS["h200"], tensor_parallel=2)
    assert h200.decode_step_ms < two.decode_step_ms
    assert h200.prefill_ms_per_token == two.prefill_ms_per_token


def test_bad_configs_and_settings_are_refused(tmp_path: Path) -> None:
    moe = {**json.loads((MODELS / "qwen3-32b.json").read_text()), "num_experts": 128}
    with pytest.raises(ValueError, match="mixture-of-experts"):
        decoder_size(moe)
    with pytest.raises(ValueError, match="intermediate_size"):
        decoder_size({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64})
    with pytest.raises(ValueError, match="unknown GPU"):
        read_roofline_timing(MODELS / "llama3-8b.json", "tpu")
    with pytest.raises(ValueError, match="at least 1"):
        read_roofline_timing(MODELS / "llama3-8b.json", "h100", tensor_parallel=0)
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the model config"):
        read_roofline_timing(tmp_path, "h100")  # a directory: its config.json
    broken.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        read_roofline_timing(broken, "h100")

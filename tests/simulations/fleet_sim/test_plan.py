"""`kvplane plan`: KV bytes per token from the exact config, and what a fleet holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplane.cli import main
from simulations.fleet_sim.plan import Replica, model_shape, plan

LLAMA_8B = {
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_size": 4096, "torch_dtype": "bfloat16",
}  # fmt: skip
QWEN_05B = {
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "hidden_size": 896, "torch_dtype": "bfloat16",
}  # fmt: skip
DEEPSEEK_V3 = {
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "hidden_size": 7168, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16",
}  # fmt: skip


def test_kv_bytes_per_token_come_from_the_config() -> None:
    assert model_shape(LLAMA_8B).kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 131,072
    assert model_shape(QWEN_05B).kv_bytes_per_token == 2 * 24 * 2 * 64 * 2  # 12,288
    assert model_shape(LLAMA_8B, "fp8").kv_bytes_per_token == 65_536
    assert model_shape({**LLAMA_8B, "head_dim": 256}).kv_bytes_per_token == 262_144
    # Multi-latent attention caches one latent per layer, not keys and values per head.
    assert model_shape(DEEPSEEK_V3).kv_bytes_per_token == 61 * (512 + 64) * 2
    assert model_shape({"text_config": LLAMA_8B}).kv_bytes_per_token == 131_072


def test_a_replica_holds_what_its_memory_leaves_after_the_weights() -> None:
    replica = Replica(gpus=1, gpu_memory_gib=80, memory_utilization=0.9, weights_gib=15,
                      reserve_gib_per_gpu=1)  # fmt: skip
    result = plan(model_shape(LLAMA_8B), replica, replicas=8, block_size=16,
                  mean_request_tokens=4096)  # fmt: skip
    assert result.kv_cache_gib == pytest.approx(80 * 0.9 - 1 - 15)
    assert result.tokens_per_replica == 56 * 2**30 // 131_072 // 16 * 16
    assert result.blocks_per_gpu == result.blocks_per_replica
    assert result.fleet_tokens == 8 * result.tokens_per_replica
    assert result.concurrent_requests == result.fleet_tokens // 4096
    two = Replica(gpus=2, gpu_memory_gib=80, memory_utilization=0.9, weights_gib=15,
                  reserve_gib_per_gpu=1)  # fmt: skip
    assert plan(model_shape(LLAMA_8B), two, replicas=1).blocks_per_gpu > result.blocks_per_gpu


def test_no_room_for_a_cache_is_an_error() -> None:
    replica = Replica(gpus=1, gpu_memory_gib=24, memory_utilization=0.9, weights_gib=30,
                      reserve_gib_per_gpu=1)  # fmt: skip
    with pytest.raises(ValueError, match="no room for a KV cache"):
        plan(model_shape(LLAMA_8B), replica, replicas=1)


def test_the_command_prints_the_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_8B))
    code = main(["plan", str(tmp_path), "--gpu-memory-gib", "80", "--weights-gib", "15",
                 "--replicas", "8", "--workload", "shared-prefix"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "KV bytes per token:      131,072" in out
    assert "concurrency:" in out
    assert main(["plan", str(tmp_path / "missing.json"), "--gpu-memory-gib", "80",
                 "--weights-gib", "1"]) == 2  # fmt: skip

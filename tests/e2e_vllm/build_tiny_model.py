"""Build the tiny model the vLLM end-to-end suite serves, deterministically and offline.

Run with the vLLM environment's Python (it has torch): `python build_tiny_model.py
TOKENIZER_DIR OUT_DIR`. The tokenizer is kvplane's shipped byte-level BPE with its chat
template, saved next to the model so that vLLM and the router read the same files.
The model is a Llama with random weights from a fixed seed, in the shapes vLLM's CPU
backend accepts (head_dim 32; the block size must be a multiple of 32).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

SEED = 0


def build(tokenizer_dir: Path, out: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    tokenizer.save_pretrained(str(out))
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=256,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out))


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]))

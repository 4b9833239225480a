"""Write the TTFT benchmark's random Llama and its tokenizer to a directory (run with .venv-vllm).

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/ttft_model.py OUT_DIR

Big enough that prefill compute shows on a CPU (8 layers, hidden 1024, 16 query heads and
4 KV heads of 64, MLP 2048: ~70M parameters, ~0.15 GFLOP per prompt token), small enough to
start in a minute on a busy 2-core machine. Random weights from a fixed seed and the real-vLLM
tier's word-level tokenizer (tests/real_vllm_model.py): no hub. Timing only: nobody checks the
tokens, so Llama's default initializer range is fine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.real_vllm_model import SEED, VOCAB_SIZE, build_tokenizer

MAX_POSITIONS = 8192  # room for the 4k-token prompts and their few generated tokens
CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": MAX_POSITIONS,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def build(out_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(out_dir)  # float32
    build_tokenizer(out_dir)
    # The tier's tokenizer says 1024 tokens at most; these prompts are longer.
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["model_max_length"] = MAX_POSITIONS
    config_path.write_text(json.dumps(tokenizer_config, indent=2))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUT_DIR", file=sys.stderr)
        return 2
    out_dir = Path(argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    build(out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

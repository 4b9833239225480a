"""Write a tiny seeded random model and its tokenizer to a directory (run with .venv-vllm's python).

    .venv-vllm/bin/python tests/real_vllm_model.py OUT_DIR [llama|qwen3-next|gemma3|deepseek-v2]

``llama`` (the default) is a dense 2-layer Llama; ``qwen3-next`` a hybrid: linear-attention
(gated delta net, a recurrent state per request) and full-attention layers alternating;
``gemma3`` a sliding-window hybrid: Gemma3's text model, 5 sliding-window layers (64 tokens)
and 1 full-attention layer; ``deepseek-v2`` an MLA model: DeepSeek-V2's attention (one
576-wide latent per token and layer), dense MLPs.

No hub: the weights come from a fixed seed, the tokenizer is a word-level vocabulary built in
memory. The weights are drawn wider than Llama's default (initializer_range 0.2 instead of
0.02) so that greedy decoding wanders through the vocabulary instead of repeating one token;
a repeating model would hide wrong KV. The same seed gives the same files on every run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
SEED = 1234
# Head size 64 is one of the CPU attention backend's sizes; 2 KV heads make the K/V head
# dimension visible to the connector's layout (1 head would hide head-order mistakes).
CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


# The hybrid: the same vocabulary, 4 layers alternating linear and full attention, a small MoE.
# Linear-attention head dims of 64: the CPU kernels refuse smaller ones. bf16, the dtype the
# CPU build runs Qwen3-Next's kernels in.
HYBRID_CONFIG: dict[str, Any] = {
    **CONFIG,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention"] * 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
    "dtype": "bfloat16",
}
# The sliding-window hybrid: Gemma3's text model, five layers attending over the last 64 tokens
# and one over the whole prompt (vLLM gives each its own cache group). Two KV heads, as above,
# so that a TP 2 engine holds one head per rank.
SLIDING_CONFIG: dict[str, Any] = {
    **CONFIG,
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "sliding_window": 64,
    "query_pre_attn_scalar": 64,
}
# The MLA model: DeepSeek-V2's attention with the latent the CPU MLA kernel compiles for
# (kv_lora_rank 512 + rope 64 = 576 values per token and layer, one "head"); every layer's MLP
# dense (first_k_dense_replace = the layer count), no query LoRA: a small checkpoint.
MLA_CONFIG: dict[str, Any] = {
    **CONFIG,
    "num_key_value_heads": 4,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "first_k_dense_replace": 2,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
}
MODELS = ("llama", "qwen3-next", "gemma3", "deepseek-v2")


def build_tokenizer(out_dir: Path) -> None:
    """A whitespace word-level tokenizer whose ids are exactly 0..VOCAB_SIZE-1."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(len(vocab), VOCAB_SIZE)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=CONFIG["max_position_embeddings"],
    )
    wrapped.save_pretrained(out_dir)


def build_model(out_dir: Path, kind: str = "llama") -> None:
    import torch

    torch.manual_seed(SEED)
    if kind == "qwen3-next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        model = Qwen3NextForCausalLM(Qwen3NextConfig(**HYBRID_CONFIG)).to(torch.bfloat16)
    elif kind == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        model = Gemma3ForCausalLM(Gemma3TextConfig(**SLIDING_CONFIG))  # float32
    elif kind == "deepseek-v2":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        model = DeepseekV2ForCausalLM(DeepseekV2Config(**MLA_CONFIG))  # float32
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**CONFIG))  # float32: torch's default dtype
    model.save_pretrained(out_dir)


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or (len(argv) == 3 and argv[2] not in MODELS):
        print(f"usage: {argv[0]} OUT_DIR [{'|'.join(MODELS)}]", file=sys.stderr)
        return 2
    out_dir = Path(argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    build_model(out_dir, argv[2] if len(argv) == 3 else "llama")
    build_tokenizer(out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

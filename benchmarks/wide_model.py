"""A randomly initialised DeepseekV3ForCausalLM at Kimi K2.5's width, for GPU checks at scale: hidden
7168, 64 MLA heads with K2.5's ranks, 8 experts per token of K2.5's size plus 1 shared, but
``--layers`` layers (8), 8 routed experts and a 32k vocabulary (4.45B parameters at 8 layers, 8.3 GB in
bfloat16), built on ``--device`` in bfloat16 and saved. The per-token work of a layer and the
hidden-state bytes per token (57,344 in bf16) are K2.5's. Random weights: its states mean nothing.

Usage: python benchmarks/wide_model.py OUT_DIR [--hidden 7168] [--heads 64] [--layers 8] [--device cuda]
then e.g. python benchmarks/extraction_throughput.py --weights OUT_DIR --device cuda --compute-dtype bfloat16
--dtype bfloat16, or python benchmarks/rerun_noise.py OUT_DIR.
"""
from __future__ import annotations

import argparse
import json
import time


def r64(x: float) -> int:
    """``x`` rounded down to a multiple of 64, at least 64 (grouped GEMMs want 16-byte strides)."""
    return max(64, int(x) // 64 * 64)


def wide_config(hidden: int = 7168, heads: int = 64, layers: int = 8):
    """The ``DeepseekV3Config`` (module docstring); widths other than 7168 scale K2.5's sizes."""
    from transformers import DeepseekV3Config

    scale = hidden / 7168
    return DeepseekV3Config(
        vocab_size=32768, hidden_size=hidden, intermediate_size=r64(18432 * scale), moe_intermediate_size=r64(2048 * scale),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, n_shared_experts=1,
        n_routed_experts=8, n_group=1, topk_group=1, num_experts_per_tok=8, first_k_dense_replace=1,
        kv_lora_rank=r64(512 * scale), q_lora_rank=r64(1536 * scale), qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, max_position_embeddings=8192, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        tie_word_embeddings=False)


def main() -> None:
    import torch
    from transformers import DeepseekV3ForCausalLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    t = time.time()
    torch.manual_seed(0)
    with torch.device(a.device):
        model = DeepseekV3ForCausalLM(wide_config(a.hidden, a.heads, a.layers)).to(torch.bfloat16).eval()
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(a.out, safe_serialization=True)
    print(json.dumps({"params": n, "build_and_save_s": round(time.time() - t, 1), "hidden": a.hidden,
                      "layers": a.layers}), flush=True)


if __name__ == "__main__":
    main()

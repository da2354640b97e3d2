"""A tiny, randomly initialised DeepSeek-V3 model for the embedded demo and the tests.

It runs the real ``transformers`` ``DeepseekV3ForCausalLM`` class (the architecture of Kimi K2.5's
text model: MLA attention, dense first layers, then MoE layers with shared and group-routed
experts) at toy size, so hidden-state extraction is exercised end to end on a CPU. Its weights are
random: its hidden states mean nothing and must never be used to train a drafter.

Contract:

* :func:`demo_config` is a pure function of ``(vocab_size, seed)`` (``seed`` is recorded only).
* :func:`build_demo_model` is deterministic: the same arguments and the same torch/transformers
  versions give byte-identical files (``config.json``, ``model.safetensors``, ...). It does not
  disturb the caller's global RNG state.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: Shape of the demo model (8 layers, hidden 64, 8 routed experts, 2 dense first layers).
DEMO_LAYERS = 8
DEMO_HIDDEN = 64


def demo_config(vocab_size: int, seed: int = 0):
    """Return a tiny ``transformers.DeepseekV3Config`` with vocabulary ``vocab_size``.

    8 decoder layers, hidden size 64, 4 heads with MLA (q_lora 32, kv_lora 16), the first 2 layers
    dense, the other 6 MoE with 8 routed experts in 2 groups (top-1 group, 2 experts per token)
    plus 1 shared expert. No multi-token-prediction layers. ``seed`` is stored in the config as
    ``demo_seed`` so the saved model says how it was made.
    """
    from transformers import DeepseekV3Config

    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    cfg = DeepseekV3Config(
        vocab_size=int(vocab_size),
        hidden_size=DEMO_HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=DEMO_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=2,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=8192,
        num_mtp_layers=0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    cfg.demo_seed = int(seed)
    return cfg


def _readme(vocab_size: int, seed: int, n_params: int) -> str:
    return f"""# Demo model (RANDOM WEIGHTS: not a real model)

A tiny `DeepseekV3ForCausalLM` built by `eagledata.demo.model.build_demo_model` for the embedded
demo and the tests. Its weights are random (seed {seed}); its outputs and hidden states mean
nothing. Never train a drafter on data extracted from it.

- architecture: the real transformers DeepseekV3 class (MLA attention, {DEMO_LAYERS} decoder layers,
  first 2 dense, then MoE with 8 routed experts + 1 shared expert), hidden size {DEMO_HIDDEN}
- vocabulary: {vocab_size} (matches the demo tokenizer, whose ids mean nothing for any real model)
- parameters: {n_params:,}
- weights: `model.safetensors`, float32. Rebuilding with the same seed and the same
  torch/transformers versions gives byte-identical files.
"""


def write_weight_index(model_dir: Path) -> None:
    """``model.safetensors.index.json`` beside the one ``model.safetensors``: the weight map a sharded
    checkpoint has, which some trainers read (SpecForge's ``TargetHead.from_pretrained`` finds the LM
    head through it), so the demo model stands in for a real one there too. Loaders that find
    ``model.safetensors`` read it directly."""
    from safetensors.torch import load_file

    weights = model_dir / "model.safetensors"
    tensors = load_file(weights)  # a few MB
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {k: weights.name for k in sorted(tensors)}}
    (model_dir / f"{weights.name}.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n",
                                                          encoding="utf-8")


def build_demo_model(out_dir: str | Path, vocab_size: int, seed: int = 0) -> Path:
    """Build the demo model with random weights drawn from ``seed`` and save it to ``out_dir``
    (``config.json``, ``generation_config.json``, ``model.safetensors`` with its
    ``model.safetensors.index.json``, ``README.md``).
    Returns ``out_dir``. Deterministic (see module docstring)."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = demo_config(vocab_size, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DeepseekV3ForCausalLM(cfg).to(torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, safe_serialization=True)
    write_weight_index(out)
    tmp = out / f"README.md.tmp-{os.getpid()}"
    tmp.write_text(_readme(vocab_size, seed, n_params), encoding="utf-8")
    os.replace(tmp, out / "README.md")
    return out

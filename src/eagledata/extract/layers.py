"""Layer semantics: which decoder outputs EAGLE-3 trains on, and how each engine numbers them.

``layers`` are 0-based decoder-layer indices meaning "the OUTPUT of decoder layer i" (HF
``output_hidden_states[i + 1]``, SGLang/vLLM aux layer ``i + 1``); see :mod:`eagledata.extract.core`.
"""

from __future__ import annotations

from typing import Sequence

from eagledata.extract.base import ExtractionError


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's three target layers ``[1, L//2 - 1, L - 4]`` as "output of decoder layer i".

    = HF ``output_hidden_states[i + 1]`` and SGLang/vLLM aux layer ids ``i + 1``.
    ``default_layers(61) == [1, 29, 57]``. Requires ``num_layers >= 5`` (all three distinct)."""
    if num_layers < 5:
        raise ExtractionError(f"default EAGLE-3 layers need at least 5 decoder layers, model has {num_layers}")
    return [1, num_layers // 2 - 1, num_layers - 4]


def resolve_layers(layers: Sequence[int] | None, num_layers: int) -> list[int]:
    """``layers`` validated against the model (each 0 <= i < L, no duplicates, order kept), or
    :func:`default_layers` when ``None``."""
    if layers is None:
        return default_layers(num_layers)
    out = [int(i) for i in layers]
    if not out:
        raise ExtractionError("extraction layers must not be empty")
    bad = [i for i in out if not 0 <= i < num_layers]
    if bad:
        raise ExtractionError(f"layers {bad} out of range for a {num_layers}-layer model (0-based 'output of layer i')")
    if len(set(out)) != len(out):
        raise ExtractionError(f"duplicate layers in {out}")
    return out


def layer_semantics(layers: Sequence[int]) -> str:
    """Human-readable statement of what the stored tensors are (written into every shard)."""
    hf = [i + 1 for i in layers]
    return (
        f"aux_hidden_states[:, j, :] is the output of decoder layer layers[j] (0-based) for layers={list(layers)}; "
        f"= HF output_hidden_states{hf} (index 0 = embeddings) = SGLang/vLLM aux layer ids {hf}. hidden_state is "
        "the raw output of the last decoder layer, BEFORE the final norm (vLLM speculators' convention; not in HF "
        "output_hidden_states); final_norm_weight and the metadata's final_norm_eps give the norm "
        "(x * rsqrt(mean(x^2) + eps) * weight in float32), whose output is SpecForge's hidden_state "
        "(HF output_hidden_states[-1])."
    )


# --------------------------------------------------------------------------- hashing / io

"""FP8 storage of hidden states (``extraction.dtype: float8_e4m3fn``, issue 12 point 6), as vLLM
speculators stores them (its ``fp8_utils``, format ``per_token_scaled``): every token's row of each
layer is divided by ``scale = max(|row|) / 448`` (clamped at 1e-12) and cast to e4m3; the scale is
kept in float32. A shard then holds ``aux_hidden_states`` [N, n_layers, H] and ``hidden_state``
[N, H] as ``F8_E4M3`` plus ``aux_hidden_states_scale`` [N, n_layers] and ``hidden_state_scale`` [N]
float32: 1 byte per value + 4 bytes per token and layer (bf16: 2 bytes per value).

Dequantized (:func:`dequantize`, ``fp8.float() * scale``) the values are what the checks see and
what the exports convert to the trainer's dtype (bf16 by default) on write. The forward runs in
float32 (:data:`FORWARD_DTYPE`) and is quantized on the CPU.

torch is imported inside functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

FP8 = "float8_e4m3fn"
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_FORMAT = "per_token_scaled"
#: the dtype the backend hands over when the shard is stored in FP8 (quantized from it)
FORWARD_DTYPE = "float32"
#: the scale tensor of each hidden-state tensor of an FP8 shard
SCALES = {"aux_hidden_states": "aux_hidden_states_scale", "hidden_state": "hidden_state_scale"}


def is_fp8(dtype: str) -> bool:
    return dtype == FP8


def quantize(t: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """``(fp8, scale)``: ``t`` [..., H] per row (last dim) in e4m3 and the float32 scale [...]."""
    import torch

    t32 = t.to(torch.float32)
    scale = (t32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (t32 / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def dequantize(q: "torch.Tensor", scale: "torch.Tensor", dtype: Any = None) -> "torch.Tensor":
    """``q.float() * scale`` (float32), cast to ``dtype`` when given."""
    import torch

    out = q.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)
    return out if dtype is None else out.to(dtype)


def stored(row: int, aux: "torch.Tensor", final: "torch.Tensor", dtype: str) -> tuple[list[tuple[str, int, Any]], tuple[Any, Any]]:
    """One sample's rows to write (``(tensor name, first row, values)``) in the stored ``dtype``, and
    the values as stored (dequantized for FP8) for the checks."""
    if not is_fp8(dtype):
        return [("aux_hidden_states", row, aux), ("hidden_state", row, final)], (aux, final)
    qa, sa = quantize(aux)
    qf, sf = quantize(final)
    items = [("aux_hidden_states", row, qa), ("aux_hidden_states_scale", row, sa),
             ("hidden_state", row, qf), ("hidden_state_scale", row, sf)]
    return items, (dequantize(qa, sa), dequantize(qf, sf))

"""The model's final norm, stored beside the pre-norm final state so that one extraction serves both
trainers: vLLM speculators reads the state BEFORE the final norm, SpecForge the state AFTER it
(:func:`apply_final_norm` derives it at export time).

The norm is the DeepSeek-V3 / Kimi K2.5 RMSNorm (also Llama's, Qwen's, Mistral's):
``y = x * rsqrt(mean(x^2, -1) + eps) * weight``, computed here in float32 whatever the stored dtype.
A model whose final norm is something else (a bias, Gemma's ``1 + weight``, LayerNorm) is refused
at extraction time by :func:`check_rms_norm`, which runs the model's own norm module on a probe and
compares.

torch is imported inside functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eagledata.extract.base import ExtractionError

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: What the stored final state is, written into every shard and manifest.
FINAL_STORED = "before"
NORM_KIND = "rmsnorm"
NORM_FORMULA = "x * rsqrt(mean(x^2, -1) + eps) * weight, in float32"


@dataclass(frozen=True)
class FinalNorm:
    """The final RMSNorm's parameters: ``weight`` a float32 CPU tensor [H], ``eps`` a float."""

    weight: Any
    eps: float

    def apply(self, x: "torch.Tensor", out_dtype: "torch.dtype | None" = None) -> "torch.Tensor":
        """:func:`apply_final_norm` with these parameters."""
        return apply_final_norm(x, self.weight, self.eps, out_dtype)


def apply_final_norm(x: "torch.Tensor", weight: "torch.Tensor", eps: float,
                     out_dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """RMSNorm of ``x`` [..., H] in float32: ``x * rsqrt(mean(x^2) + eps) * weight``, cast to
    ``out_dtype`` (default: ``x``'s dtype)."""
    import torch

    xf = x.to(torch.float32)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + float(eps)) * weight.to(torch.float32)
    return y.to(out_dtype or x.dtype)


def norm_eps(module: Any) -> float:
    """The epsilon of an RMSNorm module (``variance_epsilon`` in HF and SGLang, ``eps`` elsewhere)."""
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    raise ExtractionError(f"final norm {type(module).__name__} has no epsilon attribute (variance_epsilon / eps)")


def final_norm_of(module: Any) -> FinalNorm:
    """The :class:`FinalNorm` of a loaded norm module (weight copied to float32 on the CPU)."""
    import torch

    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 1:
        raise ExtractionError(f"final norm {type(module).__name__} has no 1-D weight: not an RMSNorm")
    if getattr(module, "bias", None) is not None:
        raise ExtractionError(f"final norm {type(module).__name__} has a bias: not an RMSNorm")
    return FinalNorm(weight.detach().to("cpu", torch.float32).clone(), norm_eps(module))


def check_rms_norm(module: Any, norm: FinalNorm, seed: int = 0) -> None:
    """Run ``module`` on a random probe and raise :class:`ExtractionError` unless
    :func:`apply_final_norm` with ``norm`` reproduces it (within the module's dtype)."""
    import torch

    w = module.weight
    gen = torch.Generator().manual_seed(seed)
    probe = torch.randn((3, w.shape[0]), generator=gen, dtype=torch.float32) * 3.0
    with torch.inference_mode():
        got = module(probe.to(w.device, w.dtype)).to("cpu", torch.float32)
    want = apply_final_norm(probe.to(w.dtype), norm.weight, norm.eps, torch.float32)
    tol = 1e-5 if w.dtype == torch.float32 else 2e-2
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
    if not err <= tol:
        raise ExtractionError(
            f"the model's final norm {type(module).__name__} is not {NORM_FORMULA} (relative error {err:.3g} on a "
            "probe): the post-norm state could not be derived from the stored pre-norm one")

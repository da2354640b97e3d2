"""Sanity checks of one extract job, per shard (issue 12 point 8).

* :class:`ShardChecks` sees every sample's stored tensors (``aux`` [T, n_layers, H], ``final`` [T, H],
  in the stored dtype): any NaN/Inf fails the job with :class:`NonFiniteError` naming the shard, the
  sample and the tensor; it accumulates the per-layer RMS (float32 sums per sample, float64 across
  samples) recorded in the manifest.
* :func:`pick_rerun_sample` chooses one sample per shard (the shortest sample batched with others: the
  most padded, so padding and batch shape are exercised, and the cheapest to re-run), and :func:`compare_rerun`
  checks that sample's result re-run alone against its batched result, token by token: fails with
  :class:`RerunMismatchError` when, for some token and layer, ``||alone - batched|| / ||batched||``
  over the hidden vector exceeds ``rtol`` (by the coarser of the stored and computed dtypes,
  :data:`RERUN_RTOL`); records that largest relative difference and the max abs diff.

torch is imported inside functions.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

from eagledata.extract.base import ExtractionError

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: Tolerance of the batched-vs-alone re-run by dtype, on a token's relative difference
#: ``||alone - batched|| / ||batched||`` over its hidden vector: 64 units of rounding (2^-p) for the
#: 16-bit dtypes, 8 for FP8 storage, 1e-3 for float32. A batch computes with other kernel shapes than a
#: sample alone, so in a 16-bit compute dtype the two differ by rounding that grows with depth: measured
#: on an H200 (a random DeepSeek-V3 at Kimi K2.5's width, 7168, bf16) up to 0.035 per token by layer 23
#: of 24 and 0.13 for single values (4e-5 in float32). A batching bug (padding, positions, dropped
#: tokens) changes whole tokens: O(1).
RERUN_RTOL = {"float32": 1e-3, "float16": 64 * 2.0 ** -11, "bfloat16": 64 * 2.0 ** -8,
              "float8_e4m3fn": 8 * 2.0 ** -4}
_COARSENESS = ["float32", "float16", "bfloat16", "float8_e4m3fn"]


class NonFiniteError(ExtractionError):
    """A stored hidden-state tensor holds NaN or Inf."""


class RerunMismatchError(ExtractionError):
    """A sample re-run alone differs from its batched result beyond the dtype tolerance."""


def layer_names(layers: Sequence[int]) -> list[str]:
    """Keys of the RMS record: ``layer_{i}`` per aux layer, then ``final`` (before the norm)."""
    return [f"layer_{i}" for i in layers] + ["final"]


class ShardChecks:
    """NaN/Inf check and per-layer RMS over one shard's stored tensors."""

    def __init__(self, shard_name: str, layers: Sequence[int]):
        self.shard_name = shard_name
        self.names = layer_names(layers)
        self.sumsq = [0.0] * len(self.names)
        self.count = [0] * len(self.names)

    def add(self, sample_id: str, aux: "torch.Tensor", final: "torch.Tensor") -> None:
        """Check one sample's stored tensors, then add them to the RMS sums.

        One pass per tensor, in float32 (pairwise sums: a few 1e-6 relative at most, below the 6 digits
        kept; 2 to 5 times cheaper than float64 on a CPU, whose pass cost about as much as a bf16 forward
        at K2.5's width on an H200). A NaN or
        Inf makes its sum non-finite; so does a finite value beyond about 1.8e19 (its square overflows
        float32), so a non-finite sum is taken again in float64, where it is finite exactly when every
        value is (a finite float32/bf16/fp8 value squares to at most ~1.2e77). Only a sum still
        non-finite scans the values, to name the first bad one."""
        a_list, f_sq = self._sums_of_squares(aux, final, "float32")
        if not all(math.isfinite(v) for v in a_list + [f_sq]):
            a_list, f_sq = self._sums_of_squares(aux, final, "float64")
            if not all(math.isfinite(v) for v in a_list + [f_sq]):
                self._raise_non_finite(sample_id, aux, final)
        for j, v in enumerate(a_list):
            self.sumsq[j] += v
            self.count[j] += aux.shape[0] * (aux.shape[2] if aux.dim() > 2 else 1)
        self.sumsq[-1] += f_sq
        self.count[-1] += final.numel()

    def _sums_of_squares(self, aux: "torch.Tensor", final: "torch.Tensor", dtype: str) -> tuple[list[float], float]:
        """Per aux layer and of the final state: the sum of squared values, computed in ``dtype``."""
        import torch

        dt = getattr(torch, dtype)
        a = aux.to(dt)
        a_sq = (a * a).sum(dim=tuple(d for d in range(a.dim()) if d != 1)).tolist() if a.numel() \
            else [0.0] * (len(self.names) - 1)
        f = final.to(dt)
        return a_sq, float((f * f).sum())

    def _raise_non_finite(self, sample_id: str, aux: "torch.Tensor", final: "torch.Tensor") -> None:
        import torch

        for name, t in (("aux_hidden_states", aux), ("hidden_state", final)):
            bad = ~torch.isfinite(t.to(torch.float32))
            if bool(bad.any()):
                pos = bad.nonzero()[0].tolist()
                raise NonFiniteError(
                    f"{self.shard_name}: sample {sample_id!r}: {int(bad.sum())} NaN/Inf value(s) in {name} "
                    f"(first at token {pos[0]}{', layer ' + self.names[pos[1]] if name == 'aux_hidden_states' else ''})")
        raise NonFiniteError(f"{self.shard_name}: sample {sample_id!r}: non-finite sum of squares")

    def rms(self) -> dict[str, float | None]:
        """Per-layer RMS over every stored value of the shard (``None`` for an empty shard)."""
        return {n: (float(f"{math.sqrt(s / c):.6g}") if c else None) for n, s, c in zip(self.names, self.sumsq, self.count)}


def pick_rerun_sample(batches: Sequence[Sequence[int]]) -> int | None:
    """The sample re-run alone: the last sample of the last batch with more than one sample (batches
    run longest first, so that is the shortest sample batched with others: the most padded, so padding
    and batch shape are exercised, and the cheapest to re-run), else the first sample (``None`` for an
    empty shard)."""
    for batch in reversed(batches):
        if len(batch) > 1:
            return batch[-1]
    return batches[0][0] if batches and batches[0] else None


def rerun_rtol(stored: str, computed: str | None) -> float:
    """Tolerance of the re-run check: that of the coarser of the stored and computed dtypes. A
    computed dtype not known (an SGLang server with ``compute_dtype: auto``) is taken as bfloat16, what
    such a server runs a large model in: a float32 tolerance there would fail sound jobs."""
    names = [d for d in (stored, computed or "bfloat16") if d in RERUN_RTOL]
    return RERUN_RTOL[max(names, key=_COARSENESS.index)] if names else RERUN_RTOL["float32"]


def compare_rerun(shard_name: str, sample_id: str, batched: tuple[Any, Any], alone: tuple[Any, Any],
                  rtol: float) -> dict[str, Any]:
    """Compare a sample's batched ``(aux, final)`` with its result re-run alone; the record for the
    manifest (``sample``, ``max_token_rel_diff``, ``max_abs_diff``, ``rtol``); raises
    :class:`RerunMismatchError` when a token's hidden vector (per layer) differs by more than
    ``rtol`` relative: ``||alone - batched|| > rtol * ||batched||``."""
    import torch

    worst_abs = worst_rel = 0.0
    for name, b, a in (("aux_hidden_states", batched[0], alone[0]), ("hidden_state", batched[1], alone[1])):
        b64, a64 = b.to(torch.float64), a.to(torch.float64)  # one sample: float64 norms cannot overflow
        if b64.shape != a64.shape:
            raise RerunMismatchError(f"{shard_name}: sample {sample_id!r}: {name} re-run alone has shape "
                                     f"{tuple(a64.shape)}, batched {tuple(b64.shape)}")
        if not b64.numel():
            continue
        if not bool(torch.isfinite(a64).all()):  # the batched values were checked by ShardChecks
            raise RerunMismatchError(f"{shard_name}: sample {sample_id!r}: {name} re-run alone holds NaN or Inf "
                                     "where its batched result is finite")
        diff = a64 - b64
        worst_abs = max(worst_abs, float(diff.abs().max()))
        d_norm, b_norm = diff.norm(dim=-1), b64.norm(dim=-1)  # per token (and layer)
        rel = d_norm / b_norm.clamp_min(torch.finfo(torch.float64).tiny)  # 0 where nothing differs
        k = int(rel.argmax())
        worst = float(rel.flatten()[k])
        worst_rel = max(worst_rel, worst)
        if worst > rtol:
            token = k // rel.shape[1] if rel.dim() > 1 else k
            raise RerunMismatchError(
                f"{shard_name}: sample {sample_id!r}: {name} re-run alone differs from its batched result by "
                f"{worst:.3g} of the hidden vector's norm at token {token} (tolerance {rtol:.3g}): batching changes "
                "the values (padding or attention mask bug?)")
    return {"sample": sample_id, "max_token_rel_diff": float(f"{worst_rel:.6g}"), "max_abs_diff": worst_abs,
            "rtol": rtol}

"""The draft-vocabulary mapping both trainers use: the ``draft_vocab_size`` most frequent target
token ids over the loss-masked (completion) positions of the exported samples.

* ``d2t`` int64 [D]: offsets, ``target_id = draft_id + d2t[draft_id]`` (ids selected, sorted);
* ``t2d`` bool [V]: True for the target ids in the draft vocabulary.

Selection as vLLM speculators' ``build_vocab_mappings_from_distribution`` does it: ids seen at least
once, by count descending then id ascending, the first D; fewer than D seen: padded with the
smallest ids not selected yet. Files:

* SpecForge: ``vocab_mapping/vocab_mapping.pt``, a ``torch.save`` dict ``{"d2t", "t2d"}`` (its
  ``load_vocab_mapping`` copies both into the draft model's buffers);
* speculators: ``d2t.npy`` / ``t2d.npy`` (``np.save``; its train script at c05b95b loads them from
  the data path), the same arrays as ``d2t-{D}.npy`` / ``t2d-{D}.npy`` (release 0.9.0 looks for those
  names, ``D`` its ``--draft-vocab-size``, and otherwise rebuilds them from ``token_freq.pt`` into the
  data path) and ``token_freq.pt`` (``torch.save`` of ``{token_id: count}`` plain ints, loaded with
  ``weights_only=True``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagledata.export.common import write_torch
from eagledata.extract.base import ExtractionError
from eagledata.io import atomic_path


def build_mapping(counts: Any, draft_vocab_size: int) -> tuple[Any, Any]:
    """``(d2t, t2d)`` from ``counts`` int64 [V] (module docstring); ``draft_vocab_size`` <= V."""
    import torch

    vocab = int(counts.numel())
    if not 1 <= draft_vocab_size <= vocab:
        raise ExtractionError(f"draft_vocab_size must be in [1, {vocab}] (the target vocabulary), got {draft_vocab_size}")
    seen = torch.nonzero(counts > 0).flatten()
    order = sorted(seen.tolist(), key=lambda t: (-int(counts[t]), t))[:draft_vocab_size]
    chosen = set(order)
    for t in range(draft_vocab_size):
        if len(order) >= draft_vocab_size:
            break
        if t not in chosen:
            order.append(t)
            chosen.add(t)
    selected = torch.tensor(sorted(order), dtype=torch.long)
    d2t = selected - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[selected] = True
    return d2t, t2d


def effective_draft_vocab(requested: int, vocab_size: int) -> int:
    """``requested`` capped at the target vocabulary (a tiny demo vocabulary is smaller than 32000)."""
    if requested < 1:
        raise ExtractionError(f"export.draft_vocab_size must be >= 1, got {requested}")
    return min(int(requested), int(vocab_size))


def coverage(counts: Any, t2d: Any) -> float | None:
    """Share of the counted completion tokens that the draft vocabulary holds."""
    total = int(counts.sum())
    return round(int(counts[t2d].sum()) / total, 6) if total else None


def write_specforge_mapping(out_dir: Path, d2t: Any, t2d: Any) -> str:
    """``vocab_mapping/vocab_mapping.pt`` (relative path returned)."""
    rel = "vocab_mapping/vocab_mapping.pt"
    (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
    write_torch(out_dir / rel, {"d2t": d2t.clone(), "t2d": t2d.clone()})
    return rel


def write_speculators_mapping(out_dir: Path, counts: Any, d2t: Any, t2d: Any) -> list[str]:
    """``d2t.npy``, ``t2d.npy``, ``d2t-{D}.npy``, ``t2d-{D}.npy`` (``D`` = ``len(d2t)``) and
    ``token_freq.pt`` in ``out_dir`` (names returned)."""
    import numpy as np

    d = len(d2t)
    names = ["d2t.npy", "t2d.npy", f"d2t-{d}.npy", f"t2d-{d}.npy"]
    for name, t in zip(names, (d2t, t2d, d2t, t2d)):
        with atomic_path(out_dir / name) as tmp:
            with open(tmp, "wb") as fh:
                np.save(fh, t.numpy())
    freq = {int(i): int(counts[i]) for i in counts.nonzero().flatten().tolist()}
    write_torch(out_dir / "token_freq.pt", freq)
    return names + ["token_freq.pt"]

"""SpecForge export (offline EAGLE-3 training; its trainer walks a directory for ``*.ckpt`` and
``torch.load``s each):

* ``rows_{g}-{g_end}/data_{i}.ckpt`` for sample ``i`` (our global sample order, ``index.parquet``),
  ``g = i // group_size * group_size``, ``g_end = g + min(group_size, S - g)`` (as SpecForge's
  ``prepare_hidden_states.py`` names them; group size 2000);
* each file a ``torch.save`` dict: ``input_ids`` [T] int64, ``loss_mask`` [T] int64,
  ``hidden_state`` [1, T, H] and ``aux_hidden_state`` [1, T, n_layers * H] (layers concatenated in
  order on the last dim) in the stored dtype;
* needs ``final_norm: after``: SpecForge computes target logits as ``lm_head(hidden_state)`` with no
  norm of its own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from eagledata.export.common import (
    common_meta,
    finish,
    iter_samples,
    prepare_target,
    read_hidden_manifest,
    require_final_norm,
    source_key,
)
from eagledata.extract.base import ExtractionError
from eagledata.io import atomic_path

log = logging.getLogger("eagledata.export.specforge")

SPECFORGE_GROUP_SIZE = 2000


def specforge_path(sample: int, total: int, group_size: int = SPECFORGE_GROUP_SIZE) -> str:
    """``rows_{g}-{g_end}/data_{sample}.ckpt`` (relative)."""
    g = sample // group_size * group_size
    return f"rows_{g}-{g + min(group_size, total - g)}/data_{sample}.ckpt"


def export_specforge(hidden_dir: str | Path, out_dir: str | Path, *, group_size: int = SPECFORGE_GROUP_SIZE,
                     work_dir: str | Path | None = None) -> dict[str, Any]:
    """Write SpecForge's offline layout (module docstring). Returns the export metadata."""
    import torch

    hidden_dir, out_dir = Path(hidden_dir), Path(out_dir)
    manifest = read_hidden_manifest(hidden_dir)
    require_final_norm(manifest, hidden_dir, "after", "SpecForge", "its trainer applies only lm_head", "specforge")
    if group_size < 1:
        raise ExtractionError(f"export.specforge_group_size must be >= 1, got {group_size}")
    target = prepare_target(out_dir, Path(work_dir) if work_dir else None,
                             source_key(hidden_dir, "specforge", {"group_size": group_size}))
    total = int(manifest["samples"])
    rows: dict[str, list] = {"sample": [], "id": [], "file": [], "tokens": [], "shard": []}
    tokens = 0
    for s in iter_samples(hidden_dir):
        rel = specforge_path(s.sample, total, group_size)
        path = target / rel
        t, n, h = s.aux.shape
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            data = {
                "input_ids": s.input_ids.to(torch.int64).contiguous().clone(),
                "loss_mask": s.loss_mask.to(torch.int64).contiguous().clone(),
                "hidden_state": s.final.contiguous().clone().unsqueeze(0),
                "aux_hidden_state": s.aux.reshape(t, n * h).contiguous().clone().unsqueeze(0),
            }
            with atomic_path(path) as tmp:
                torch.save(data, tmp)
        rows["sample"].append(s.sample)
        rows["id"].append(s.id)
        rows["file"].append(rel)
        rows["tokens"].append(t)
        rows["shard"].append(s.shard)
        tokens += t
    meta = common_meta(manifest, hidden_dir, "specforge", len(rows["sample"]), tokens)
    meta.update({
        "group_size": group_size,
        "layout": "rows_{g}-{g_end}/data_{sample}.ckpt: torch.save dict input_ids [T] int64, loss_mask [T] int64, "
                  f"hidden_state [1, T, H], aux_hidden_state [1, T, {len(manifest['layers'])} * H] ({manifest['dtype']})",
        "specforge_aux_hidden_states_layers": manifest["layers"],
    })
    log.info("SpecForge export %s: %d samples, %d tokens", out_dir, meta["samples"], tokens)
    return finish(target, out_dir, Path(work_dir) if work_dir else None, rows, meta)

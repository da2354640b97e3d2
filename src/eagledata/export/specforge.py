"""SpecForge export (offline EAGLE-3 training; its ``OfflineManifestReader`` walks a directory for
``*.ckpt`` and ``torch.load``s each, ``normalize_offline_sample`` maps the keys):

* ``rows_{g}-{g_end}/data_{i}.ckpt`` for sample ``i`` (our global sample order, ``index.parquet``),
  ``g = i // group_size * group_size``, ``g_end = g + min(group_size, S - g)`` (as SpecForge's
  ``prepare_hidden_states.py`` names them; group size 2000; the reader parses no names);
* each file a ``torch.save`` dict: ``input_ids`` [T] int64, ``loss_mask`` [T] int64,
  ``hidden_state`` [1, T, H] and ``aux_hidden_state`` [1, T, n_layers * H] (layers concatenated in
  order on the last dim) in the export dtype (bf16 by default: SpecForge's target head is bf16);
* ``hidden_state`` is AFTER the final norm (SpecForge computes target logits as
  ``lm_head(hidden_state)``), derived from the stored pre-norm state with the stored norm
  (:func:`eagledata.extract.norm.apply_final_norm`, float32);
* ``vocab_mapping/vocab_mapping.pt``: ``{"d2t", "t2d"}`` (:mod:`eagledata.export.vocab`).

Files are written per hidden shard into ``{out}.store`` and hard-linked into the layout
(:mod:`eagledata.export.common`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from eagledata.export.common import (
    HiddenShard,
    Sample,
    assemble,
    end_export,
    start_export,
)
from eagledata.export.vocab import write_specforge_mapping
from eagledata.extract.base import ExtractionError

log = logging.getLogger("eagledata.export.specforge")

SPECFORGE_GROUP_SIZE = 2000


def specforge_path(sample: int, total: int, group_size: int = SPECFORGE_GROUP_SIZE) -> str:
    """``rows_{g}-{g_end}/data_{sample}.ckpt`` (relative)."""
    g = sample // group_size * group_size
    return f"rows_{g}-{g + min(group_size, total - g)}/data_{sample}.ckpt"


def specforge_sample(s: Sample, shard: HiddenShard, dtype: Any) -> dict[str, Any]:
    """The ``torch.save`` dict of one sample (module docstring)."""
    import torch

    t, n, h = s.aux.shape
    return {
        "input_ids": s.input_ids.to(torch.int64).contiguous().clone(),
        "loss_mask": s.loss_mask.to(torch.int64).contiguous().clone(),
        "hidden_state": shard.norm.apply(s.final, dtype).contiguous().clone().unsqueeze(0),
        "aux_hidden_state": s.aux.to(dtype).reshape(t, n * h).contiguous().clone().unsqueeze(0),
    }


def export_specforge(hidden_dir: str | Path, out_dir: str | Path, *, group_size: int = SPECFORGE_GROUP_SIZE,
                     dtype: str = "bfloat16", draft_vocab_size: int = 32000, work_dir: str | Path | None = None,
                     store_dir: str | Path | None = None,
                     code_version: str | None = None, keep_replaced_bytes: int = 0) -> dict[str, Any]:
    """Write SpecForge's offline layout (module docstring). Returns the export metadata.
    ``code_version``, ``keep_replaced_bytes``: see :func:`~eagledata.export.common.start_export`."""
    import torch

    if group_size < 1:
        raise ExtractionError(f"export.specforge_group_size must be >= 1, got {group_size}")
    run = start_export("specforge", hidden_dir, out_dir, dtype, "specforge_dtype", draft_vocab_size, work_dir, store_dir,
                       code_version, keep_replaced_bytes)
    total, layers = int(run.manifest["samples"]), run.manifest["layers"]
    built = assemble(run.hidden_dir, run.manifest, run.target, run.store,
                     lambda path, s, shard: torch.save(specforge_sample(s, shard, run.dtype), path),
                     lambda i: specforge_path(i, total, group_size), lambda row: f"data_{row}.ckpt")
    return end_export(run, built, {
        "group_size": group_size,
        "layout": "rows_{g}-{g_end}/data_{sample}.ckpt: torch.save dict input_ids [T] int64, loss_mask [T] int64, "
                  f"hidden_state [1, T, H] (after the final norm), aux_hidden_state [1, T, {len(layers)} * H] "
                  f"({dtype})",
        "final_state": "after the final norm (derived from the stored pre-norm state with the stored RMSNorm)",
        "specforge_aux_hidden_states_layers": layers,
    }, lambda target, _counts, d2t, t2d: write_specforge_mapping(target, d2t, t2d))

"""Exports of extracted hidden states (``results/{dataset}/hidden``) into trainers' own layouts:
the registry :data:`EXPORTERS` (trainer name -> export function) the workflow's export rule uses.

* :mod:`eagledata.export.specforge`: SpecForge's offline ``rows_{g}-{g_end}/data_{i}.ckpt``
  (needs ``final_norm: after``);
* :mod:`eagledata.export.speculators`: vLLM speculators' ``hidden_states/hs_{i}.safetensors`` plus
  its dataset columns in ``mapping.parquet`` (needs ``final_norm: before``).

Both write ``mapping.parquet`` (``sample``, ``id``, ``file``, ``tokens``, ``shard``; speculators adds
its dataset columns) and ``export.json`` (source manifest sha256, layers in our and the trainer's
numbering, dtype, counts). Files are written to ``*.tmp-PID`` and renamed; with ``work_dir``
everything goes there first and is renamed onto ``out_dir`` at the end, and a rerun over the same
source keeps the files already written (:mod:`eagledata.export.common`).
"""

from __future__ import annotations

from eagledata.export.specforge import export_specforge
from eagledata.export.speculators import export_speculators

EXPORTERS = {"specforge": export_specforge, "speculators": export_speculators}

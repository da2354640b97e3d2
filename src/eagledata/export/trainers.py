"""Exports of extracted hidden states (``results/{dataset}/hidden``) into trainers' own layouts:
the registry :data:`EXPORTERS` (trainer name -> export function) the workflow's export rule uses.

* :mod:`eagledata.export.specforge`: SpecForge's offline ``rows_{g}-{g_end}/data_{i}.ckpt``
  (final state after the norm, derived from the stored pre-norm state) and ``vocab_mapping.pt``;
* :mod:`eagledata.export.speculators`: vLLM speculators' saved ``datasets`` directory with
  ``hidden_states/hs_{i}.safetensors`` (final state before the norm), ``d2t.npy``, ``t2d.npy``,
  ``token_freq.pt``.

Both read one extraction, write in their own dtype (``export.{trainer}_dtype``, bf16 by default),
write ``mapping.parquet`` (``sample``, ``id``, ``file``, ``tokens``, ``shard``) and ``export.json``
(source manifest sha256, layers in our and the trainer's numbering, dtype, counts, draft vocabulary).
Trainer files are written per hidden shard into ``{out}.store`` (a rerun rewrites only changed
shards) and hard-linked into the layout; with ``work_dir`` the layout is assembled there and renamed
onto ``out_dir`` at the end (:mod:`eagledata.export.common`).
"""

from __future__ import annotations

from eagledata.export.specforge import export_specforge
from eagledata.export.speculators import export_speculators

EXPORTERS = {"specforge": export_specforge, "speculators": export_speculators}

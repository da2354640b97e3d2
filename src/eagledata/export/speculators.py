"""vLLM speculators export (``hidden_states/hs_{i}.safetensors``, read with
``safetensors.torch.load_file``; its trainer takes ``hidden_states[:, :-1]`` flattened as the aux
input and ``hidden_states[:, -1]`` as the verifier's last hidden state):

* ``token_ids`` [T] int64 and ``hidden_states`` [T, n_layers + 1, H]: the aux layers in order, then
  the final state (so the final state IS one of the ``n_layers + 1`` entries);
* needs ``final_norm: before``: vLLM captures the final entry as aux id ``L`` = the last layer's
  output before the norm;
* the loss mask lives in speculators' dataset, not in the hs files: ``mapping.parquet`` carries
  ``input_ids``, ``loss_mask`` and ``seq_len`` per sample, so
  ``datasets.Dataset.from_parquet(".../mapping.parquet").save_to_disk(".../speculators")`` gives
  the dataset whose ``hidden_states/`` folder the files already sit in.
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
from eagledata.io import atomic_path

log = logging.getLogger("eagledata.export.speculators")


def speculators_path(sample: int) -> str:
    """``hidden_states/hs_{sample}.safetensors`` (relative)."""
    return f"hidden_states/hs_{sample}.safetensors"


def export_speculators(hidden_dir: str | Path, out_dir: str | Path, *, work_dir: str | Path | None = None) -> dict[str, Any]:
    """Write vLLM speculators' layout (module docstring). Returns the export metadata."""
    import torch
    from safetensors.torch import save_file

    hidden_dir, out_dir = Path(hidden_dir), Path(out_dir)
    manifest = read_hidden_manifest(hidden_dir)
    require_final_norm(manifest, hidden_dir, "before", "speculators",
                        "vLLM captures it as aux id L = the last layer's output", "speculators")
    target = prepare_target(out_dir, Path(work_dir) if work_dir else None, source_key(hidden_dir, "speculators", {}))
    rows: dict[str, list] = {"sample": [], "id": [], "file": [], "tokens": [], "shard": [],
                             "seq_len": [], "input_ids": [], "loss_mask": []}
    tokens = 0
    for s in iter_samples(hidden_dir):
        rel = speculators_path(s.sample)
        path = target / rel
        t = s.aux.shape[0]
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            hs = torch.cat([s.aux, s.final.unsqueeze(1)], dim=1).contiguous()
            with atomic_path(path) as tmp:
                save_file({"token_ids": s.input_ids.to(torch.int64).contiguous(), "hidden_states": hs}, str(tmp))
        rows["sample"].append(s.sample)
        rows["id"].append(s.id)
        rows["file"].append(rel)
        rows["tokens"].append(t)
        rows["shard"].append(s.shard)
        rows["seq_len"].append(t)
        rows["input_ids"].append(s.input_ids.tolist())
        rows["loss_mask"].append(s.loss_mask.tolist())
        tokens += t
    layers = manifest["layers"]
    meta = common_meta(manifest, hidden_dir, "speculators", len(rows["sample"]), tokens)
    meta.update({
        "layout": f"hidden_states/hs_{{sample}}.safetensors: token_ids [T] int64, hidden_states [T, {len(layers) + 1}, H] "
                  f"({manifest['dtype']}) = aux layers {layers} (output of layer i), then the final state before the norm",
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in layers] + [int(manifest["num_layers"])],
    })
    log.info("speculators export %s: %d samples, %d tokens", out_dir, meta["samples"], tokens)
    return finish(target, out_dir, Path(work_dir) if work_dir else None, rows, meta)

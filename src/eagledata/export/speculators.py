"""vLLM speculators export: a data directory its ``ArrowDataset`` and train script read as written.

* the directory itself is a Hugging Face ``datasets`` dataset (``Dataset.save_to_disk``, format
  ``torch``; ``load_from_disk(datapath)``): row ``i`` holds ``input_ids`` (int64), ``loss_mask``
  (int64, 1 on completion tokens) and ``seq_len`` of sample ``i`` (our global order, ``index.parquet``);
* ``hidden_states/hs_{i}.safetensors`` (its ``FileTransfer``; ``safetensors.torch.load_file``):
  ``token_ids`` [T] int64 (must equal row ``i``'s ``input_ids``) and ``hidden_states``
  [T, n_layers + 1, H] in the export dtype (bf16 by default): the aux layers in order, then the final
  state BEFORE the final norm (its trainer takes ``[:, :-1]`` flattened as the aux input and ``[:, -1]``
  as the verifier's last hidden state, and applies the verifier's norm itself);
* ``d2t.npy`` / ``t2d.npy``, the same as ``d2t-{D}.npy`` / ``t2d-{D}.npy``, and ``token_freq.pt``
  (:mod:`eagledata.export.vocab`), which its train script looks for in the data path (release 0.9.0:
  the ``-{D}`` names, with ``--draft-vocab-size D``);
* ``export.json`` lists ``eagle_aux_hidden_state_layer_ids``: the three auxiliary layers in vLLM's
  numbering (``i + 1``), which its trainer's fc layer is sized by (the final state is not one of them).

``hs_*`` files are written per hidden shard into ``{out}.store`` and hard-linked into the layout
(:mod:`eagledata.export.common`); the dataset and vocabulary files are rewritten on every run.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from eagledata.export.common import (
    UMASK,
    Sample,
    assemble,
    end_export,
    start_export,
)
from eagledata.export.vocab import write_speculators_mapping
from eagledata.extract.base import ExtractionError

log = logging.getLogger("eagledata.export.speculators")


def speculators_path(sample: int) -> str:
    """``hidden_states/hs_{sample}.safetensors`` (relative)."""
    return f"hidden_states/hs_{sample}.safetensors"


def speculators_tensors(s: Sample, dtype: Any) -> dict[str, Any]:
    """The ``hs_{i}.safetensors`` tensors of one sample (module docstring)."""
    import torch

    hs = torch.cat([s.aux.to(dtype), s.final.to(dtype).unsqueeze(1)], dim=1).contiguous()
    return {"token_ids": s.input_ids.to(torch.int64).contiguous(), "hidden_states": hs}


def save_dataset(target: Path, hidden_dir: Path, rows: dict[str, list]) -> None:
    """The ``datasets`` directory (``input_ids``, ``loss_mask``, ``seq_len``; torch format) in ``target``,
    row ``i`` = sample ``i``."""
    import datasets
    from safetensors import safe_open

    from eagledata.extract.storage import read_index

    index = read_index(hidden_dir).sort("sample")
    if index["sample"].to_list() != rows["sample"]:
        raise ExtractionError("speculators dataset rows are not in hs_{i} order")
    ids, masks = [], []
    for (shard,), part in index.group_by("shard", maintain_order=True):
        with safe_open(str(hidden_dir / shard), "pt") as f:
            all_ids, all_mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")
        for a, n in zip(part["offset"].to_list(), part["length"].to_list()):
            ids.append(all_ids[a : a + n].tolist())
            masks.append(all_mask[a : a + n].to(dtype=all_ids.dtype).tolist())
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    ds = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks, "seq_len": [len(x) for x in ids]},
                                    features=features)
    ds.set_format("torch")
    ds.save_to_disk(str(target), num_shards=1 if not ids else None)  # (0 rows: an empty shard, which loads)


def export_speculators(hidden_dir: str | Path, out_dir: str | Path, *, dtype: str = "bfloat16",
                       draft_vocab_size: int = 32000, work_dir: str | Path | None = None,
                       store_dir: str | Path | None = None,
                       code_version: str | None = None, keep_replaced_bytes: int = 0) -> dict[str, Any]:
    """Write vLLM speculators' data directory (module docstring). Returns the export metadata.
    ``code_version``, ``keep_replaced_bytes``: see :func:`~eagledata.export.common.start_export`."""
    from safetensors.torch import save_file

    run = start_export("speculators", hidden_dir, out_dir, dtype, "speculators_dtype", draft_vocab_size, work_dir,
                       store_dir, code_version, keep_replaced_bytes)
    def write_hs(path: Path, s: Sample, _shard: Any) -> None:
        save_file(speculators_tensors(s, run.dtype), str(path))
        os.chmod(path, 0o666 & ~UMASK)  # safetensors creates its files 0600: unreadable to a trainer of another user

    built = assemble(run.hidden_dir, run.manifest, run.target, run.store, write_hs,
                     speculators_path, lambda row: f"hs_{row}.safetensors")
    save_dataset(run.target, run.hidden_dir, built.rows)
    layers = run.manifest["layers"]
    return end_export(run, built, {
        "layout": f"datasets directory (input_ids, loss_mask, seq_len; torch format) + hidden_states/hs_{{sample}}"
                  f".safetensors: token_ids [T] int64, hidden_states [T, {len(layers) + 1}, H] ({dtype}) = aux "
                  f"layers {layers} (output of layer i), then the final state before the norm",
        "final_state": "before the final norm (hidden_states[:, -1]; the trainer applies the verifier's norm)",
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in layers],
    }, write_speculators_mapping)

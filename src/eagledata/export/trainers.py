"""Exports of extracted hidden states (``results/{dataset}/hidden``) into trainers' own layouts.

SpecForge (offline EAGLE-3 training; its trainer walks a directory for ``*.ckpt`` and
``torch.load``s each):

* ``rows_{g}-{g_end}/data_{i}.ckpt`` for sample ``i`` (our global sample order, ``index.parquet``),
  ``g = i // group_size * group_size``, ``g_end = g + min(group_size, S - g)`` (as SpecForge's
  ``prepare_hidden_states.py`` names them; group size 2000);
* each file a ``torch.save`` dict: ``input_ids`` [T] int64, ``loss_mask`` [T] int64,
  ``hidden_state`` [1, T, H] and ``aux_hidden_state`` [1, T, n_layers * H] (layers concatenated in
  order on the last dim) in the stored dtype;
* needs ``final_norm: after``: SpecForge computes target logits as ``lm_head(hidden_state)`` with no
  norm of its own.

vLLM speculators (``hidden_states/hs_{i}.safetensors``, read with ``safetensors.torch.load_file``;
its trainer takes ``hidden_states[:, :-1]`` flattened as the aux input and ``hidden_states[:, -1]``
as the verifier's last hidden state):

* ``token_ids`` [T] int64 and ``hidden_states`` [T, n_layers + 1, H]: the aux layers in order, then
  the final state (so the final state IS one of the ``n_layers + 1`` entries);
* needs ``final_norm: before``: vLLM captures the final entry as aux id ``L`` = the last layer's
  output before the norm;
* the loss mask lives in speculators' dataset, not in the hs files: ``mapping.parquet`` carries
  ``input_ids``, ``loss_mask`` and ``seq_len`` per sample, so
  ``datasets.Dataset.from_parquet(".../mapping.parquet").save_to_disk(".../speculators")`` gives
  the dataset whose ``hidden_states/`` folder the files already sit in.

Both write ``mapping.parquet`` (``sample``, ``id``, ``file``, ``tokens``, ``shard``; speculators adds
the columns above) and ``export.json`` (source manifest sha256, layers in our and the trainer's
numbering, dtype, counts). Files are written to ``*.tmp-PID`` and renamed; with ``work_dir``
everything goes there first and is renamed onto ``out_dir`` at the end, and a rerun over the same
source keeps the files already written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from eagledata.extract.core import ExtractionError, _atomic_write_text, publish_dir, read_index

log = logging.getLogger("eagledata.export.trainers")

SPECFORGE_GROUP_SIZE = 2000
EXPORT_FORMAT = "eagledata-export/1"


@dataclass
class Sample:
    """One sample read back from the hidden-state shards."""

    sample: int
    id: str
    shard: str
    input_ids: Any  # torch int64 [T]
    loss_mask: Any  # torch int8 [T]
    aux: Any  # [T, n_layers, H]
    final: Any  # [T, H]


def read_hidden_manifest(hidden_dir: str | Path) -> dict[str, Any]:
    path = Path(hidden_dir) / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExtractionError(f"hidden-state manifest not found: {path}") from None
    if not manifest.get("complete", True):
        raise ExtractionError(f"{path} describes an unfinished extraction (complete: false)")
    return manifest


def iter_samples(hidden_dir: str | Path) -> Iterator[Sample]:
    """Every sample of ``hidden_dir`` in ``index.parquet`` order, sliced from the shards without
    loading whole shards (safetensors slices)."""
    from safetensors import safe_open

    hidden_dir = Path(hidden_dir)
    index = read_index(hidden_dir)
    handles: dict[str, Any] = {}
    try:
        for row in index.iter_rows(named=True):
            f = handles.get(row["shard"])
            if f is None:
                for old in handles.values():
                    old.__exit__(None, None, None)
                handles.clear()
                f = safe_open(str(hidden_dir / row["shard"]), "pt")
                f.__enter__()
                handles[row["shard"]] = f
            a, b = row["offset"], row["offset"] + row["length"]
            yield Sample(
                sample=row["sample"], id=row["id"], shard=row["shard"],
                input_ids=f.get_slice("input_ids")[a:b], loss_mask=f.get_slice("loss_mask")[a:b],
                aux=f.get_slice("aux_hidden_states")[a:b], final=f.get_slice("hidden_state")[a:b],
            )
    finally:
        for f in handles.values():
            f.__exit__(None, None, None)


def specforge_path(sample: int, total: int, group_size: int = SPECFORGE_GROUP_SIZE) -> str:
    """``rows_{g}-{g_end}/data_{sample}.ckpt`` (relative)."""
    g = sample // group_size * group_size
    return f"rows_{g}-{g + min(group_size, total - g)}/data_{sample}.ckpt"


def speculators_path(sample: int) -> str:
    return f"hidden_states/hs_{sample}.safetensors"


def _source_key(hidden_dir: Path, kind: str, settings: dict[str, Any]) -> str:
    h = hashlib.sha256((hidden_dir / "manifest.json").read_bytes())
    h.update(json.dumps({"kind": kind, **settings}, sort_keys=True).encode())
    return h.hexdigest()


def _prepare_target(out_dir: Path, work_dir: Path | None, key: str) -> Path:
    """The directory to write into. A work dir left by an interrupted run over the same source
    (same key) is reused; otherwise it starts empty."""
    target = work_dir if work_dir is not None else out_dir
    stamp = target / ".source"
    if target.exists() and not (stamp.exists() and stamp.read_text() == key):
        shutil.rmtree(target)
    target.mkdir(parents=True, exist_ok=True)
    stamp.write_text(key)
    for stale in target.rglob("*.tmp-*"):
        stale.unlink()
    return target


def _finish(target: Path, out_dir: Path, work_dir: Path | None, rows: dict[str, list], meta: dict[str, Any]) -> dict[str, Any]:
    import polars as pl

    tmp = target / f"mapping.parquet.tmp-{os.getpid()}"
    pl.DataFrame(rows).write_parquet(tmp)
    os.replace(tmp, target / "mapping.parquet")
    _atomic_write_text(target / "export.json", json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    (target / ".source").unlink()
    if work_dir is not None:
        publish_dir(target, out_dir)
    return meta


def _common_meta(manifest: dict[str, Any], hidden_dir: Path, trainer: str, samples: int, tokens: int) -> dict[str, Any]:
    return {
        "format": EXPORT_FORMAT,
        "trainer": trainer,
        "source": str(hidden_dir),
        "source_manifest_sha256": hashlib.sha256((hidden_dir / "manifest.json").read_bytes()).hexdigest(),
        "model_path": manifest.get("model_path"),
        "model_fingerprint": manifest.get("model_fingerprint"),
        "tokenizer_fingerprint": manifest.get("tokenizer_fingerprint"),
        "layers": manifest["layers"],
        "layer_semantics": manifest.get("layer_semantics"),
        "final_norm": manifest["final_norm"],
        "dtype": manifest["dtype"],
        "hidden_size": manifest["hidden_size"],
        "num_layers": manifest["num_layers"],
        "samples": samples,
        "tokens": tokens,
        "mapping": "mapping.parquet",
    }


def _require_final_norm(manifest: Mapping[str, Any], hidden_dir: Path, want: str, target: str, why: str,
                        key: str) -> None:
    if manifest["final_norm"] != want:
        raise ExtractionError(
            f"{target} export needs the final hidden state {want.upper()} the final norm ({why}), but {hidden_dir} "
            f"was extracted with final_norm={manifest['final_norm']!r}; set extraction.final_norm: {want} "
            f"(or disable export.{key})")


def export_specforge(hidden_dir: str | Path, out_dir: str | Path, *, group_size: int = SPECFORGE_GROUP_SIZE,
                     work_dir: str | Path | None = None) -> dict[str, Any]:
    """Write SpecForge's offline layout (module docstring). Returns the export metadata."""
    import torch

    hidden_dir, out_dir = Path(hidden_dir), Path(out_dir)
    manifest = read_hidden_manifest(hidden_dir)
    _require_final_norm(manifest, hidden_dir, "after", "SpecForge", "its trainer applies only lm_head", "specforge")
    if group_size < 1:
        raise ExtractionError(f"export.specforge_group_size must be >= 1, got {group_size}")
    target = _prepare_target(out_dir, Path(work_dir) if work_dir else None,
                             _source_key(hidden_dir, "specforge", {"group_size": group_size}))
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
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            torch.save(data, tmp)
            os.replace(tmp, path)
        rows["sample"].append(s.sample)
        rows["id"].append(s.id)
        rows["file"].append(rel)
        rows["tokens"].append(t)
        rows["shard"].append(s.shard)
        tokens += t
    meta = _common_meta(manifest, hidden_dir, "specforge", len(rows["sample"]), tokens)
    meta.update({
        "group_size": group_size,
        "layout": "rows_{g}-{g_end}/data_{sample}.ckpt: torch.save dict input_ids [T] int64, loss_mask [T] int64, "
                  f"hidden_state [1, T, H], aux_hidden_state [1, T, {len(manifest['layers'])} * H] ({manifest['dtype']})",
        "specforge_aux_hidden_states_layers": manifest["layers"],
    })
    log.info("SpecForge export %s: %d samples, %d tokens", out_dir, meta["samples"], tokens)
    return _finish(target, out_dir, Path(work_dir) if work_dir else None, rows, meta)


def export_speculators(hidden_dir: str | Path, out_dir: str | Path, *, work_dir: str | Path | None = None) -> dict[str, Any]:
    """Write vLLM speculators' layout (module docstring). Returns the export metadata."""
    import torch
    from safetensors.torch import save_file

    hidden_dir, out_dir = Path(hidden_dir), Path(out_dir)
    manifest = read_hidden_manifest(hidden_dir)
    _require_final_norm(manifest, hidden_dir, "before", "speculators",
                        "vLLM captures it as aux id L = the last layer's output", "speculators")
    target = _prepare_target(out_dir, Path(work_dir) if work_dir else None, _source_key(hidden_dir, "speculators", {}))
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
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            save_file({"token_ids": s.input_ids.to(torch.int64).contiguous(), "hidden_states": hs}, str(tmp))
            os.replace(tmp, path)
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
    meta = _common_meta(manifest, hidden_dir, "speculators", len(rows["sample"]), tokens)
    meta.update({
        "layout": f"hidden_states/hs_{{sample}}.safetensors: token_ids [T] int64, hidden_states [T, {len(layers) + 1}, H] "
                  f"({manifest['dtype']}) = aux layers {layers} (output of layer i), then the final state before the norm",
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in layers] + [int(manifest["num_layers"])],
    })
    log.info("speculators export %s: %d samples, %d tokens", out_dir, meta["samples"], tokens)
    return _finish(target, out_dir, Path(work_dir) if work_dir else None, rows, meta)


EXPORTERS = {"specforge": export_specforge, "speculators": export_speculators}

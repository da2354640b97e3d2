"""What every trainer export shares: reading the hidden-state shards back sample by sample
(:func:`iter_samples`), the resumable work directory (:func:`prepare_target`, keyed by the source
manifest and settings), the metadata common to every ``export.json`` (:func:`common_meta`), and
publishing (:func:`finish`: ``mapping.parquet``, ``export.json``, rename onto the output).

Every file is written through :func:`eagledata.io.atomic_path` (``*.tmp-PID``, fsync'ed, renamed).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from eagledata.extract.base import ExtractionError
from eagledata.extract.storage import publish_dir, read_index
from eagledata.io import atomic_path, atomic_write_json

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
    """The hidden-state ``manifest.json`` of a finished extraction (else :class:`ExtractionError`)."""
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


def source_key(hidden_dir: Path, kind: str, settings: dict[str, Any]) -> str:
    """What an export's files depend on: the source manifest, the trainer and its settings."""
    h = hashlib.sha256((hidden_dir / "manifest.json").read_bytes())
    h.update(json.dumps({"kind": kind, **settings}, sort_keys=True).encode())
    return h.hexdigest()


def prepare_target(out_dir: Path, work_dir: Path | None, key: str) -> Path:
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


def finish(target: Path, out_dir: Path, work_dir: Path | None, rows: dict[str, list], meta: dict[str, Any]) -> dict[str, Any]:
    """Write ``mapping.parquet`` and ``export.json``, then publish ``target`` onto ``out_dir``."""
    import polars as pl

    with atomic_path(target / "mapping.parquet") as tmp:
        pl.DataFrame(rows).write_parquet(tmp)
    atomic_write_json(target / "export.json", meta, indent=2)
    (target / ".source").unlink()
    if work_dir is not None:
        publish_dir(target, out_dir)
    return meta


def common_meta(manifest: dict[str, Any], hidden_dir: Path, trainer: str, samples: int, tokens: int) -> dict[str, Any]:
    """The ``export.json`` fields every trainer's export has."""
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


def require_final_norm(manifest: Mapping[str, Any], hidden_dir: Path, want: str, target: str, why: str,
                        key: str) -> None:
    """Raise unless the extraction's ``final_norm`` is the one trainer ``target`` needs."""
    if manifest["final_norm"] != want:
        raise ExtractionError(
            f"{target} export needs the final hidden state {want.upper()} the final norm ({why}), but {hidden_dir} "
            f"was extracted with final_norm={manifest['final_norm']!r}; set extraction.final_norm: {want} "
            f"(or disable export.{key})")

"""What every trainer export shares: the hidden-state shards read back shard by shard and sample by
sample (:func:`hidden_shards`, :func:`iter_samples`), the per-shard store that makes an export
incremental (:class:`ShardStore`), the layout assembled from it by hard links (:func:`link`), the
draft-vocabulary token counts, the metadata common to every ``export.json`` (:func:`common_meta`),
and publishing (:func:`finish`: ``mapping.parquet``, ``export.json``, rename onto the output).

Per shard: each hidden shard's trainer files are written once into
``{out}.store/{shard stem}-{key}/`` (``key`` = sha256 of the shard's sha256, the trainer and its
settings; ``.done`` lists a complete entry's files and sizes), then hard-linked under their global names into the
export. A rerun rewrites only the shards whose content or settings changed; renumbering after an
insertion only relinks. Store entries no current shard uses are removed, or kept in ``replaced/`` up
to ``export.keep_replaced_gb`` and taken back when a change is reverted.

Every file is written through :func:`eagledata.io.atomic_path` (``*.tmp-PID``, fsync'ed, renamed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from eagledata.extract.base import ExtractionError
from eagledata.extract.fp8 import SCALES, dequantize
from eagledata.extract.norm import FinalNorm
from eagledata.extract.storage import FORMAT, REPLACED, kept_replaced, publish_dir, read_index
from eagledata.io import atomic_path, atomic_write_json, link_file

log = logging.getLogger("eagledata.export.common")

EXPORT_FORMAT = "eagledata-export/2"
EXPORT_DTYPES = ("bfloat16", "float16", "float32")


def _process_umask() -> int:
    """This process's umask (set back at once; read at import, before any writer thread starts)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: the mode bits a new file's creator takes away (files written by libraries that create them 0600 are
#: given ``0o666 & ~UMASK``, as ``open`` would)
UMASK = _process_umask()


@dataclass
class Sample:
    """One sample read back from the hidden-state shards (``final`` before the final norm)."""

    sample: int
    id: str
    shard: str
    row: int
    input_ids: Any  # torch int64 [T]
    loss_mask: Any  # torch int8 [T]
    aux: Any  # [T, n_layers, H]
    final: Any  # [T, H], before the final norm


@dataclass
class HiddenShard:
    """One hidden-state shard of a finished extraction, with its samples' rows of ``index.parquet``."""

    file: str
    sha256: str
    norm: FinalNorm
    rows: list[dict[str, Any]]


def read_hidden_manifest(hidden_dir: str | Path) -> dict[str, Any]:
    """The hidden-state ``manifest.json`` of a finished extraction in the current format (else
    :class:`ExtractionError`)."""
    path = Path(hidden_dir) / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExtractionError(f"hidden-state manifest not found: {path}") from None
    if not manifest.get("complete", True):
        raise ExtractionError(f"{path} describes an unfinished extraction (complete: false)")
    if manifest.get("format") != FORMAT:
        raise ExtractionError(f"{path} is format {manifest.get('format')!r}, exports read {FORMAT!r} (final state "
                              "before the norm, with the norm's weight): rerun the extraction")
    return manifest


def hidden_shards(hidden_dir: str | Path, manifest: dict[str, Any]) -> list[HiddenShard]:
    """The manifest's shards in order, each with its final norm (read from the shard) and index rows."""
    from safetensors import safe_open

    hidden_dir = Path(hidden_dir)
    by_shard: dict[str, list[dict[str, Any]]] = {}
    for row in read_index(hidden_dir).iter_rows(named=True):
        by_shard.setdefault(row["shard"], []).append(row)
    out = []
    for entry in manifest["shards"]:
        with safe_open(str(hidden_dir / entry["file"]), "pt") as f:
            norm = FinalNorm(f.get_tensor("final_norm_weight"), float(f.metadata()["final_norm_eps"]))
        out.append(HiddenShard(entry["file"], entry["sha256"], norm, by_shard.get(entry["file"], [])))
    return out


def iter_samples(hidden_dir: str | Path, shard: HiddenShard) -> Iterator[Sample]:
    """Every sample of ``shard`` in index order, sliced without loading the whole shard."""
    from safetensors import safe_open

    with safe_open(str(Path(hidden_dir) / shard.file), "pt") as f:
        fp8 = SCALES["hidden_state"] in f.keys()

        def hidden(name: str, a: int, b: int) -> Any:
            # FP8 shards (extraction.dtype float8_e4m3fn): dequantized to float32 here, the exports cast
            return dequantize(f.get_slice(name)[a:b], f.get_slice(SCALES[name])[a:b]) if fp8 else f.get_slice(name)[a:b]

        for row in shard.rows:
            a, b = row["offset"], row["offset"] + row["length"]
            yield Sample(
                sample=row["sample"], id=row["id"], shard=row["shard"], row=row["row"],
                input_ids=f.get_slice("input_ids")[a:b], loss_mask=f.get_slice("loss_mask")[a:b],
                aux=hidden("aux_hidden_states", a, b), final=hidden("hidden_state", a, b),
            )


def completion_token_counts(hidden_dir: str | Path, shard: HiddenShard, vocab_size: int) -> Any:
    """int64 [vocab_size]: how often each token id occurs at loss-masked (completion) positions."""
    import torch
    from safetensors import safe_open

    with safe_open(str(Path(hidden_dir) / shard.file), "pt") as f:
        ids = f.get_tensor("input_ids")[f.get_tensor("loss_mask").to(torch.bool)]
    return torch.bincount(ids, minlength=vocab_size)[:vocab_size]


class ShardStore:
    """Per-shard files of one export kind under ``root`` (module docstring). With
    ``keep_replaced_bytes``, entries no shard used any more are moved to ``root/replaced/`` and kept
    there, the most recently replaced first, up to that many bytes; an entry needed again (a change
    reverted) is taken back from there instead of written."""

    def __init__(self, root: Path, kind: str, settings: dict[str, Any], keep_replaced_bytes: int = 0):
        self.root, self.kind, self.settings = root, kind, settings
        self.keep_replaced_bytes = keep_replaced_bytes
        self.used: set[str] = set()

    @property
    def replaced(self) -> Path:
        return self.root / REPLACED

    def entry(self, shard: HiddenShard) -> Path:
        h = hashlib.sha256(json.dumps({"shard": shard.sha256, "kind": self.kind, **self.settings},
                                      sort_keys=True).encode()).hexdigest()
        return self.root / f"{Path(shard.file).stem}-{h[:16]}"

    def ensure(self, shard: HiddenShard, write: Callable[[Path], None]) -> tuple[Path, bool]:
        """The shard's entry, written by ``write(entry_dir)`` unless complete already (or taken back
        complete from :attr:`replaced`); returns ``(entry, written)``. Complete: its ``.done`` lists
        every file it wrote with its size, and they are there (a removal killed half-way is not)."""
        d = self.entry(shard)
        self.used.add(d.name)
        if _complete(d):
            return d, False
        _remove(d)
        if _complete(self.replaced / d.name):
            os.replace(self.replaced / d.name, d)
            log.info("store entry %s taken back from %s", d.name, self.replaced)
            return d, False
        d.mkdir(parents=True)
        write(d)
        files = {str(f.relative_to(d)): f.stat().st_size for f in sorted(d.rglob("*")) if f.is_file()}
        (d / ".done").write_text(json.dumps({"shard_sha256": shard.sha256, "files": files}))
        return d, True

    def prune(self) -> None:
        """Remove entries no shard of this export used (or keep them in :attr:`replaced`, see the class)."""
        if not self.root.exists():
            return
        for p in self.root.iterdir():
            if p.name in self.used or p.name == REPLACED:
                continue
            if self.keep_replaced_bytes and _complete(p):
                _remove(self.replaced / p.name)
                self.replaced.mkdir(exist_ok=True)
                os.replace(p, self.replaced / p.name)
                os.utime(self.replaced / p.name / ".done")  # when it was replaced
                log.info("store entry %s no shard uses: kept in %s", p.name, self.replaced)
                continue
            log.info("removing unused store entry %s", p)
            _remove(p)
        if self.replaced.is_dir():
            self._evict()

    def _evict(self) -> None:
        """Keep the most recently replaced entries up to :attr:`keep_replaced_bytes`; remove the rest."""
        entries = [((d / ".done").stat().st_mtime_ns, size, d.name)
                   for d in self.replaced.iterdir() if (size := _entry_bytes(d)) is not None]
        kept = set(kept_replaced(entries, self.keep_replaced_bytes))
        for p in self.replaced.iterdir():
            if p.name not in kept:
                log.info("removing replaced store entry %s (beyond export.keep_replaced_gb)", p)
                _remove(p)


def _entry_bytes(entry: Path) -> int | None:
    """The bytes of a complete store entry (its ``.done`` lists its files and sizes, all there); ``None``
    for an incomplete one."""
    try:
        files = json.loads((entry / ".done").read_text())["files"]
        if all((entry / name).stat().st_size == size for name, size in files.items()):
            return sum(files.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def _complete(entry: Path) -> bool:
    return _entry_bytes(entry) is not None


def _remove(path: Path) -> None:
    """Remove a store entry (or a stray file), its ``.done`` first: killed half-way, what is left
    is incomplete, never taken for whole."""
    if path.is_dir():
        (path / ".done").unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def fresh_target(out_dir: Path, work_dir: Path | None) -> Path:
    """The (emptied) directory an export's layout is assembled in."""
    target = work_dir if work_dir is not None else out_dir
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    return target


def check_export_dtype(dtype: str, key: str) -> Any:
    """The torch dtype of an export (:data:`EXPORT_DTYPES`), else :class:`ExtractionError` naming ``key``."""
    import torch

    if dtype not in EXPORT_DTYPES:
        raise ExtractionError(f"export.{key} must be one of {EXPORT_DTYPES}, got {dtype!r}")
    return getattr(torch, dtype)


def write_torch(path: Path, obj: Any) -> None:
    import torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def finish(target: Path, out_dir: Path, work_dir: Path | None, rows: dict[str, list], meta: dict[str, Any]) -> dict[str, Any]:
    """Write ``mapping.parquet`` and ``export.json``, then publish ``target`` onto ``out_dir``."""
    import polars as pl

    with atomic_path(target / "mapping.parquet") as tmp:
        pl.DataFrame(rows).write_parquet(tmp)
    atomic_write_json(target / "export.json", meta, indent=2)
    if work_dir is not None:
        publish_dir(target, out_dir)
    return meta


def common_meta(manifest: dict[str, Any], hidden_dir: Path, trainer: str, samples: int, tokens: int,
                dtype: str) -> dict[str, Any]:
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
        "source_final_norm": manifest["final_norm"],
        "source_dtype": manifest["dtype"],
        "dtype": dtype,
        "hidden_size": manifest["hidden_size"],
        "num_layers": manifest["num_layers"],
        "vocab_size": manifest["vocab_size"],
        "samples": samples,
        "tokens": tokens,
        # samples cut or left out at the dataset's max_seq_len (which ones: the hidden manifest's shards)
        "length_limit": manifest.get("length_limit"),
        "mapping": "mapping.parquet",
    }


@dataclass
class Assembled:
    """What :func:`assemble` built: ``mapping.parquet`` rows, token counts, shards (re)written."""

    rows: dict[str, list]
    counts: Any  # int64 [vocab_size], loss-masked tokens
    tokens: int
    written: int


def assemble(hidden_dir: Path, manifest: dict[str, Any], target: Path, store: ShardStore,
             write_sample: Callable[[Path, Sample, HiddenShard], None], global_name: Callable[[int], str],
             local_name: Callable[[int], str]) -> Assembled:
    """For every shard: its store entry (``write_sample(entry / local_name(row), sample, shard)``
    for each sample unless the entry is complete), then every sample's file hard-linked to
    ``target / global_name(sample)``; unused store entries are pruned at the end."""
    import torch

    vocab = int(manifest["vocab_size"])
    counts = torch.zeros(vocab, dtype=torch.int64)
    rows: dict[str, list] = {"sample": [], "id": [], "file": [], "tokens": [], "shard": []}
    written = tokens = 0

    for shard in hidden_shards(hidden_dir, manifest):
        def write(entry: Path, shard: HiddenShard = shard) -> None:
            for s in iter_samples(hidden_dir, shard):
                with atomic_path(entry / local_name(s.row)) as tmp:
                    write_sample(tmp, s, shard)

        entry, fresh = store.ensure(shard, write)
        written += fresh
        counts += completion_token_counts(hidden_dir, shard, vocab)
        for row in shard.rows:
            rel = global_name(row["sample"])
            link_file(entry / local_name(row["row"]), target / rel)
            for k, v in (("sample", row["sample"]), ("id", row["id"]), ("file", rel), ("tokens", row["length"]),
                         ("shard", shard.file)):
                rows[k].append(v)
            tokens += row["length"]
    store.prune()
    return Assembled(rows, counts, tokens, written)


@dataclass
class ExportRun:
    """What every trainer's export sets up the same way (:func:`start_export`)."""

    trainer: str
    hidden_dir: Path
    out_dir: Path
    manifest: dict[str, Any]
    dtype_name: str
    dtype: Any
    draft: int
    draft_requested: int
    work: Path | None
    store: ShardStore
    target: Path


def start_export(trainer: str, hidden_dir: str | Path, out_dir: str | Path, dtype: str, dtype_key: str,
                 draft_vocab_size: int, work_dir: str | Path | None, store_dir: str | Path | None,
                 code_version: str | None = None, keep_replaced_bytes: int = 0) -> ExportRun:
    """Read the hidden-state manifest, check the trainer dtype, size the draft vocabulary, open the
    per-shard store (``OUT.store`` beside ``out_dir`` by default) and a fresh target directory.
    ``code_version`` (the workflow passes its code stamp's digest) is part of every store entry's key,
    so files another version of the code wrote are written again, never reused. ``keep_replaced_bytes``:
    see :class:`ShardStore`."""
    from eagledata.export.vocab import effective_draft_vocab

    hidden_dir, out_dir = Path(hidden_dir), Path(out_dir)
    manifest = read_hidden_manifest(hidden_dir)
    tdtype = check_export_dtype(dtype, dtype_key)
    work = Path(work_dir) if work_dir else None
    store = ShardStore(Path(store_dir) if store_dir else out_dir.parent / f"{out_dir.name}.store", trainer,
                       {"dtype": dtype, **({"code": code_version} if code_version else {})}, keep_replaced_bytes)
    return ExportRun(trainer, hidden_dir, out_dir, manifest, dtype, tdtype,
                     effective_draft_vocab(draft_vocab_size, manifest["vocab_size"]), draft_vocab_size, work, store,
                     fresh_target(out_dir, work))


def end_export(run: ExportRun, built: Assembled, fields: dict[str, Any],
               write_mapping: Callable[[Path, Any, Any, Any], Any]) -> dict[str, Any]:
    """The export's ``export.json`` (common fields, the trainer's ``fields``, the draft vocabulary
    written by ``write_mapping(target, counts, d2t, t2d)``), logged, then published."""
    from eagledata.export.vocab import build_mapping, coverage

    d2t, t2d = build_mapping(built.counts, run.draft)
    meta = common_meta(run.manifest, run.hidden_dir, run.trainer, len(built.rows["sample"]), built.tokens, run.dtype_name)
    meta.update(fields)
    meta.update({
        "vocab_mapping": write_mapping(run.target, built.counts, d2t, t2d),
        "draft_vocab_size": run.draft,
        "draft_vocab_size_requested": run.draft_requested,
        "draft_vocab_coverage": coverage(built.counts, t2d),
        "shards_written": built.written,
    })
    logging.getLogger(f"eagledata.export.{run.trainer}").info(
        "%s export %s: %d samples, %d tokens, %d of %d shards written", run.trainer, run.out_dir, meta["samples"],
        built.tokens, built.written, len(run.manifest["shards"]))
    return finish(run.target, run.out_dir, run.work, built.rows, meta)


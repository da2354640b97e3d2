"""Extraction as one job per token shard (the Snakemake rules of rules/extract.smk).

Steps, each a job, files under ``results/{dataset}/``:

1. :func:`eagledata.extract.plan.write_plan` (checkpoint ``extract_plan``, after ``tokens`` and
   ``validate``: validation gates extraction): ``hidden.work/plan.json``, per stable shard key the
   content-named token shard in ``tokens.store/``.
2. :func:`extract_keyed_shard` (rule ``extract_shard``, one job per key, ``resources: gpu``): the hidden
   shard ``hidden.store/{token shard stem}.safetensors`` with a sidecar ``{stem}.json`` (the shard's
   record: stats, sanity checks, bytes, mtime, sha256), and the job's output
   ``hidden.work/shards/{key}.json`` (the record plus the job's devices and times). The job's inputs
   are its token shard (content-named: a new name exactly when its content changed), the weights and
   the code; its params are the settings that shape the shards. Nothing else, so another shard's change
   never reruns it. The store is no Snakemake output: a rerun job or a rerun gather never deletes a
   finished shard.
3. :func:`eagledata.extract.gather.gather_hidden` (rule ``extract``; its own module, which the shard
   jobs do not import): ``hidden/`` = ``manifest.json`` and ``index.parquet`` (the format
   :func:`eagledata.extract.core.extract_dataset` writes, which the exports read) and a hard link per
   shard into the store; store files of no current shard are removed, or kept in ``replaced/`` up to
   ``extraction.keep_replaced_gb``, where a shard job takes its shard back (:func:`replaced_record`).

Per shard, as in the one-process path: the token shard's sha256 is verified, the free disk space is
checked against the shard's exact size, the file is written to ``*.tmp-PID`` and renamed, the sanity
checks run (NaN/Inf, per-layer RMS, one sample re-run alone), and a job finding its shard already in
the store with the same source, settings, model and code (:data:`~eagledata.extract.storage.RESUME_KEYS`)
and an intact sidecar keeps it untouched (resume after lost metadata, a forced rerun, a retried job);
else it looks in another dataset's store (:func:`sibling_record`) and in its store's ``replaced/``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from eagledata.extract.base import ExtractionError
from eagledata.extract.core import (
    DatasetRun,
    LazyBackend,
    code_fingerprint,
    extract_shard,
    resolve_run,
    with_file_facts,
)
from eagledata.extract.plan import plan_entry, read_plan
from eagledata.extract.storage import (
    REPLACED,
    ResumeKeys,
    output_name,
    read_shard_metadata,
    resumable,
)
from eagledata.io import atomic_write_json, link_file, sha256_file

log = logging.getLogger("eagledata.extract.pershard")


@dataclass
class ExtractionSettings:
    """What one dataset's extraction jobs are run with (config ``extraction`` and the dataset's own
    ``extraction`` block), shared by the shard jobs and the gather."""

    weights: str
    layers: Sequence[int] | None = None
    dtype: str = "bfloat16"
    compute_dtype: str = "auto"
    backend: str = "hf"
    device: str = "auto"
    batch_tokens: int = 8192
    backend_options: dict[str, Any] = field(default_factory=dict)
    reserve_disk_bytes: int = 0
    keep_replaced_bytes: int = 0  # see prune_store
    max_seq_len: int | None = None
    on_long: str = "truncate"
    code_fingerprint: str = ""
    final_norm: Any = None

    @classmethod
    def from_config(cls, config: dict[str, Any], dataset: str, weights: str | Path,
                    code_files: Sequence[str | Path] = ()) -> "ExtractionSettings":
        """The settings of ``dataset`` in a workflow ``config``; ``code_files``: the rule's code inputs."""
        cfg = dict(config.get("extraction") or {})
        own = dict(config["datasets"][dataset].get("extraction") or {})
        backend = str(cfg.get("backend", "hf"))
        options = {}
        if backend == "sglang":
            options = {"mem_fraction_static": float(cfg.get("sglang_mem_fraction", 0.85)),
                       "server_args": dict(cfg.get("sglang_server_args") or {})}
        return cls(weights=str(weights), layers=cfg.get("layers"), dtype=str(cfg.get("dtype", "bfloat16")),
                   compute_dtype=str(cfg.get("compute_dtype", "auto")), backend=backend,
                   device=str(cfg.get("device", "auto")), batch_tokens=int(cfg.get("batch_tokens", 8192)),
                   backend_options=options, reserve_disk_bytes=int(cfg.get("reserve_disk_gb", 0) * (1 << 30)),
                   keep_replaced_bytes=int(cfg.get("keep_replaced_gb", 0) * (1 << 30)),
                   max_seq_len=own.get("max_seq_len"), on_long=str(own.get("on_long", "truncate")),
                   code_fingerprint=code_fingerprint(code_files) if code_files else "",
                   final_norm=cfg.get("final_norm"))

    def run(self, tokens_manifest: dict[str, Any], target: str | Path) -> DatasetRun:
        """The resolved run (settings checked, layers and sizes from the model's config)."""
        return resolve_run(target, target, self.weights, tokens_manifest, self.layers, self.dtype, self.compute_dtype,
                           self.backend, self.batch_tokens, final_norm=self.final_norm, max_seq_len=self.max_seq_len,
                           on_long=self.on_long, code_fingerprint=self.code_fingerprint,
                           backend_args=self.backend_args())

    def backend_args(self) -> str:
        """The backend's output-shaping arguments as one resume key: SGLang's server arguments
        (canonical JSON; its memory fraction shapes nothing), "" for none."""
        args = self.backend_options.get("server_args") if self.backend == "sglang" else None
        return json.dumps(args, sort_keys=True, separators=(",", ":")) if args else ""


def sidecar_of(shard: Path) -> Path:
    """The record file beside a stored hidden shard (``x.safetensors`` -> ``x.json``)."""
    return shard.with_suffix(".json")


def stored_record(run: DatasetRun, dst: Path, source_sha256: str, source: Path | None = None, *,
                  keys: ResumeKeys | None = None) -> dict[str, Any] | None:
    """The record of ``dst`` when the store holds a finished shard for exactly this source (the token
    shard ``source``) and these settings, model and code (header on :data:`RESUME_KEYS`, sidecar naming
    this very file: size and mtime), else ``None``. ``keys``: ``run.resume_keys(source_sha256, source)``
    when the caller has them (they may read the source)."""
    meta = read_shard_metadata(dst) if dst.is_file() else None
    if meta is None or not resumable(meta, keys or run.resume_keys(source_sha256, source)):
        return None
    try:
        record = json.loads(sidecar_of(dst).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    try:
        st = dst.stat()
    except FileNotFoundError:  # another dataset's gather took it out meanwhile (sibling_record)
        return None
    if record.get("file") != dst.name or record.get("bytes") != st.st_size or record.get("mtime_ns") != st.st_mtime_ns:
        return None
    return record


def sibling_record(run: DatasetRun, dst: Path, source_sha256: str, keys: ResumeKeys) -> dict[str, Any] | None:
    """The record of the same hidden shard found in another dataset's store (``results/*/hidden.store``:
    a renamed or copied dataset, shard names being content names) for exactly this source, settings,
    model and code (:func:`stored_record`), hard-linked with its sidecar into ``dst``'s store (copied,
    mtimes kept, across file systems); ``None`` when no store holds one. Safe to share: every write
    to a store replaces a file (write and rename), none writes into one, and a store's pruning only
    unlinks its own names. ``keys``: ``run.resume_keys`` of the shard's source."""
    for other in sorted(dst.parent.parent.parent.glob(f"*/{dst.parent.name}/{dst.name}")):
        if other.parent.resolve() == dst.parent.resolve() or stored_record(run, other, source_sha256, keys=keys) is None:
            continue
        try:
            link_file(sidecar_of(other), sidecar_of(dst))
            link_file(other, dst)
        except OSError as exc:  # pruned meanwhile by that dataset's gather
            log.info("%s: could not take %s (%s)", dst, other, exc)
            continue
        record = stored_record(run, dst, source_sha256, keys=keys)
        if record is not None:
            log.info("%s: taken from %s (same source sha256, settings, model and code)", dst, other.parent)
            return record
    return None


def _clear_tmp(dst: Path) -> None:
    for stale in dst.parent.glob(f"{dst.name}.tmp-*"):
        log.info("removing leftover %s of an interrupted job", stale)
        stale.unlink(missing_ok=True)


def extract_keyed_shard(plan_path: str | Path, key: str, source: str | Path, store_dir: str | Path,
                        record_path: str | Path, settings: ExtractionSettings, *, model: Any = None,
                        job: dict[str, Any] | None = None, verify: Callable[[], None] | None = None) -> dict[str, Any]:
    """Extract the token shard of ``key`` (``source``, the plan's file for it) into ``store_dir`` and
    write the job's record to ``record_path``; returns the record (``resumed``: kept from the store).

    ``model``: an already loaded model or backend (tests, benchmarks); else the backend is loaded
    (only when the shard is not in the store already). ``job``: facts of the running job recorded as
    they are (e.g. its claimed ``gpus``); ``started`` / ``finished`` wall times are added. ``verify``:
    called before a new shard is published (its sidecar written) and before the record: an exception
    from it removes the new shard (:func:`eagledata.codeinputs.verify_loaded_code`: the code that ran
    is the code the settings' fingerprint names)."""
    t_start = time.time()
    plan = read_plan(plan_path)
    entry = plan_entry(plan, key)
    src = Path(source)
    if src.name != entry["file"]:
        raise ExtractionError(f"shard {key}: the plan names {entry['file']}, the job was given {src}")
    got = sha256_file(src)
    if got != entry["sha256"]:
        raise ExtractionError(f"sha256 mismatch for token shard {src}: the plan says {entry['sha256']}, file is {got}")
    store = Path(store_dir)
    store.mkdir(parents=True, exist_ok=True)
    run = settings.run({"dataset": plan.get("dataset"), "tokenizer_fingerprint": plan.get("tokenizer_fingerprint")},
                       store)
    dst = store / output_name(entry["file"])
    _clear_tmp(dst)
    keys = run.resume_keys(entry["sha256"], src)  # read the source once (its lengths, with a length limit)
    record = stored_record(run, dst, entry["sha256"], keys=keys)
    if record is not None:
        log.info("%s: in the store already (same source sha256, settings, model and code): kept untouched", dst)
    else:
        record = sibling_record(run, dst, entry["sha256"], keys) or replaced_record(run, dst, entry["sha256"], keys)
    if record is not None:
        if verify is not None:
            verify()
        record = {**record, "resumed": True}
    else:
        runner = LazyBackend(run, model, settings.device, settings.backend_options)
        written: dict[str, Any] = {}

        def publish(tmp: Path, stats: dict[str, Any]) -> None:
            """The code check, then the sidecar, before the shard takes its name (a rename keeps the
            file's size and mtime, which the sidecar records): a job killed after the rename leaves
            its shard recorded, kept by the next run, never extracted again."""
            if verify is not None:
                verify()
            written.update(with_file_facts({**stats, "model_load_s": round(runner.load_s, 3)}, tmp, {}))
            atomic_write_json(sidecar_of(dst), written)

        try:
            extract_shard(
                runner.get(), src, dst, layers=run.layers, dtype=run.dtype, batch_tokens=settings.batch_tokens,
                source_sha256=entry["sha256"], tokenizer_fingerprint=run.tokenizer_fp, model_path=str(run.weights),
                model_fp=run.model_fp, compute_dtype=run.compute_dtype,
                reserve_disk_bytes=settings.reserve_disk_bytes, max_seq_len=run.max_seq_len, on_long=run.on_long,
                code_fingerprint=run.code_fp, backend_args=run.backend_args, before_publish=publish)
        finally:
            runner.close()
        record = {**written, "resumed": False}
    out = {**record, "key": key, "job": {**(job or {}), "host": socket.gethostname(), "pid": os.getpid(),
                                          "started": t_start, "finished": time.time()}}
    Path(record_path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(record_path, out)
    return out


def replaced_record(run: DatasetRun, dst: Path, source_sha256: str,
                    keys: ResumeKeys) -> dict[str, Any] | None:
    """The record of ``dst`` taken back from the store's :data:`REPLACED` shards (a change reverted)
    when one is there for exactly this source, settings, model and code (:func:`stored_record`),
    moved back with its sidecar (renames: bytes and mtime kept; a sidecar a killed job had moved
    already is found beside ``dst``); else ``None``, also when it vanishes meanwhile."""
    kept = dst.parent / REPLACED / dst.name
    if sidecar_of(dst).is_file() and not sidecar_of(kept).is_file() and kept.is_file():
        os.replace(sidecar_of(dst), sidecar_of(kept))  # half a pair: a job killed between its two renames
    if not kept.is_file() or stored_record(run, kept, source_sha256, keys=keys) is None:
        return None
    try:
        os.replace(sidecar_of(kept), sidecar_of(dst))
        os.replace(kept, dst)
    except FileNotFoundError:
        return None
    record = stored_record(run, dst, source_sha256, keys=keys)
    if record is not None:
        log.info("%s: taken back from %s (same source sha256, settings, model and code)", dst, kept.parent)
    return record


__all__ = ["REPLACED", "ExtractionSettings", "extract_keyed_shard", "replaced_record", "sibling_record", "sidecar_of",
           "stored_record"]

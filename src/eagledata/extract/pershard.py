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
3. :func:`gather_hidden` (rule ``extract``): ``hidden/`` = ``manifest.json`` and ``index.parquet`` (the
   format :func:`eagledata.extract.core.extract_dataset` writes, which the exports read) and a hard link
   per shard into the store; store files of no current shard are removed.

Per shard, as in the one-process path: the token shard's sha256 is verified, the free disk space is
checked against the shard's exact size, the file is written to ``*.tmp-PID`` and renamed, the sanity
checks run (NaN/Inf, per-layer RMS, one sample re-run alone), and a job finding its shard already in
the store with the same source, settings, model and code (:data:`~eagledata.extract.storage.RESUME_KEYS`)
and an intact sidecar keeps it untouched (resume after lost metadata, a forced rerun, a retried job).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from eagledata.extract.base import ExtractionError
from eagledata.extract.core import (
    DatasetRun,
    LazyBackend,
    code_fingerprint,
    extract_shard,
    norm_facts,
    resolve_run,
    warn_long_samples,
    with_file_facts,
)
from eagledata.extract.plan import plan_entry, read_plan
from eagledata.extract.storage import (
    output_name,
    read_shard_metadata,
    resumable,
    write_index,
    write_manifest,
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
                  keys: Mapping[str, str | frozenset[str]] | None = None) -> dict[str, Any] | None:
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
    st = dst.stat()
    if record.get("file") != dst.name or record.get("bytes") != st.st_size or record.get("mtime_ns") != st.st_mtime_ns:
        return None
    return record


def sibling_record(run: DatasetRun, dst: Path, source_sha256: str, source: Path | None = None, *,
                   keys: Mapping[str, str | frozenset[str]] | None = None) -> dict[str, Any] | None:
    """The record of the same hidden shard found in another dataset's store (``results/*/hidden.store``:
    a renamed or copied dataset, shard names being content names) for exactly this source, settings,
    model and code (:func:`stored_record`), hard-linked with its sidecar into ``dst``'s store (copied,
    mtimes kept, across file systems); ``None`` when no store holds one. Safe to share: every write
    to a store replaces a file (write and rename), none writes into one, and a store's pruning only
    unlinks its own names. ``keys``: as :func:`stored_record`'s."""
    keys = keys or run.resume_keys(source_sha256, source)
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
        record = sibling_record(run, dst, entry["sha256"], keys=keys) or replaced_record(run, dst, entry["sha256"], keys)
    if record is not None:
        if verify is not None:
            verify()
        record = {**record, "resumed": True}
    else:
        runner = LazyBackend(run, model, settings.device, settings.backend_options)
        try:
            stats = extract_shard(
                runner.get(), src, dst, layers=run.layers, dtype=run.dtype, batch_tokens=settings.batch_tokens,
                source_sha256=entry["sha256"], tokenizer_fingerprint=run.tokenizer_fp, model_path=str(run.weights),
                model_fp=run.model_fp, compute_dtype=run.compute_dtype,
                reserve_disk_bytes=settings.reserve_disk_bytes, max_seq_len=run.max_seq_len, on_long=run.on_long,
                code_fingerprint=run.code_fp, backend_args=run.backend_args)
        finally:
            runner.close()
        if verify is not None:
            try:
                verify()
            except Exception:
                dst.unlink(missing_ok=True)
                raise
        record = with_file_facts({**stats, "model_load_s": round(runner.load_s, 3)}, dst, {})
        atomic_write_json(sidecar_of(dst), record)
        record = {**record, "resumed": False}
    out = {**record, "key": key, "job": {**(job or {}), "host": socket.gethostname(), "pid": os.getpid(),
                                          "started": t_start, "finished": time.time()}}
    Path(record_path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(record_path, out)
    return out


def _checked_entry(record: dict[str, Any], key: str, store: Path) -> dict[str, Any]:
    """A record as a manifest shard entry, checked against the stored file (re-hashed when its size or
    mtime changed since the record was written)."""
    if record.get("key") != key:
        raise ExtractionError(f"the record of shard {key} names key {record.get('key')}")
    path = store / record["file"]
    if not path.is_file():
        raise ExtractionError(f"hidden shard {path} of key {key} is missing from the store")
    return with_file_facts(record, path, {record["file"]: record})


#: Where the gather keeps the shards it takes out of a store (``extraction.keep_replaced_gb``).
REPLACED = "replaced"


def replaced_record(run: DatasetRun, dst: Path, source_sha256: str,
                    keys: Mapping[str, str | frozenset[str]]) -> dict[str, Any] | None:
    """The record of ``dst`` taken back from the store's :data:`REPLACED` shards (a change reverted)
    when one is there for exactly this source, settings, model and code (:func:`stored_record`),
    moved back with its sidecar (renames: bytes and mtime kept); else ``None``."""
    kept = dst.parent / REPLACED / dst.name
    if not kept.is_file() or stored_record(run, kept, source_sha256, keys=keys) is None:
        return None
    os.replace(sidecar_of(kept), sidecar_of(dst))
    os.replace(kept, dst)
    record = stored_record(run, dst, source_sha256, keys=keys)
    if record is not None:
        log.info("%s: taken back from %s (same source sha256, settings, model and code)", dst, kept.parent)
    return record


def prune_store(store: Path, keep: Sequence[str], keep_replaced_bytes: int = 0) -> None:
    """Take out of the store every shard (and sidecar, and ``*.tmp-PID`` of a killed job) that is not
    one of ``keep`` (file names): removed, or with ``keep_replaced_bytes`` moved to :data:`REPLACED`,
    which then keeps the most recently replaced shards up to that many bytes (a shard moved there is
    renamed, so its inode's change time says when). Only run when no shard job of the dataset runs
    (the gather)."""
    names = set(keep) | {sidecar_of(Path(k)).name for k in keep}
    replaced = store / REPLACED
    gone = [p for p in store.iterdir()
            if p.is_file() and p.name not in names and (p.suffix in (".safetensors", ".json") or ".tmp-" in p.name)]
    for p in gone if keep_replaced_bytes else ():
        if p.suffix == ".safetensors" and sidecar_of(p).is_file():
            replaced.mkdir(exist_ok=True)
            os.replace(sidecar_of(p), sidecar_of(replaced / p.name))
            os.replace(p, replaced / p.name)
            log.info("%s: no current shard; kept in %s", p, replaced)
    for p in gone:
        if p.exists():
            log.info("removing %s (no current shard)", p)
            p.unlink()
    if replaced.is_dir():
        _evict_replaced(replaced, keep_replaced_bytes)


def _evict_replaced(replaced: Path, limit: int) -> None:
    """Keep the most recently replaced shards of ``replaced`` (with their sidecars) up to ``limit``
    bytes in all; remove the others and anything else there."""
    shards = sorted((p for p in replaced.glob("*.safetensors") if sidecar_of(p).is_file()),
                    key=lambda p: p.stat().st_ctime_ns, reverse=True)
    kept, total = set(), 0
    for p in shards:
        size = p.stat().st_size
        if total + size > limit:
            break
        kept |= {p.name, sidecar_of(p).name}
        total += size
    for p in replaced.iterdir():
        if p.name not in kept:
            log.info("removing %s (replaced shards beyond extraction.keep_replaced_gb)", p)
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()


def _prune_records(record_paths: Sequence[str | Path]) -> None:
    """Remove job records of keys the plan no longer has (beside the current ones)."""
    if not record_paths:
        return
    current = {Path(p).resolve() for p in record_paths}
    for p in Path(record_paths[0]).parent.glob("*.json"):
        if p.resolve() not in current:
            p.unlink()


def gather_hidden(plan_path: str | Path, record_paths: Sequence[str | Path], out_dir: str | Path,
                  store_dir: str | Path, settings: ExtractionSettings) -> dict[str, Any]:
    """``out_dir``: ``manifest.json`` and ``index.parquet`` of the plan's shards (in plan order, one
    record per key in ``record_paths``) and a hard link per shard into ``store_dir``; returns the manifest."""
    t0 = time.perf_counter()
    plan = read_plan(plan_path)
    records = [json.loads(Path(p).read_text(encoding="utf-8")) for p in record_paths]
    keys = [s["key"] for s in plan["shards"]]
    if len(records) != len(keys):
        raise ExtractionError(f"{len(records)} shard records for the {len(keys)} shards of {plan_path}")
    store, out = Path(store_dir), Path(out_dir)
    shards_out = [_checked_entry(r, k, store) for r, k in zip(records, keys)]
    out.mkdir(parents=True, exist_ok=True)
    run = replace(settings.run({"dataset": plan.get("dataset"), "tokenizer_fingerprint": plan.get("tokenizer_fingerprint")},
                               out), tokens_dir=Path(plan["token_store"]))
    norm: dict[str, Any] = {}
    for s in shards_out:
        link_file(store / s["file"], out / s["file"])
        norm = norm_facts(out / s["file"], norm)
    write_index(out / "index.parquet", shards_out, out)
    manifest = run.manifest(shards_out, True, **norm)
    manifest["job_time"] = job_time(shards_out)
    write_manifest(out / "manifest.json", manifest)
    warn_model_loads(manifest["job_time"])
    warn_long_samples(manifest)
    prune_store(store, [s["file"] for s in shards_out], settings.keep_replaced_bytes)
    _prune_records(record_paths)
    fresh = [s for s in shards_out if not s.get("resumed")]
    log.info("gathered %d shards (%d samples, %d tokens) in %.1f s; the records say %d were extracted by their job, "
             "%d kept from the store", len(shards_out), manifest["samples"], manifest["tokens"],
             time.perf_counter() - t0, len(fresh), len(shards_out) - len(fresh))
    return manifest


#: the gather warns when the shard jobs spent more than this share of their time loading the model...
LOAD_SHARE_WARNING = 0.25
#: ... and at least this many seconds in all (a model that loads in seconds is not worth a warning)
LOAD_SECONDS_WARNING = 60.0


def job_time(shards: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What the shard jobs that extracted ``shards`` spent, as their records say (shards a job found in
    the store, and records of an eagledata that did not time loads, are left out): seconds loading the
    model, extracting (forward included) and in the forward alone, and the loads' share of load +
    extraction."""
    timed = [s for s in shards if s.get("model_load_s") is not None and not s.get("resumed")]
    load = sum(float(s["model_load_s"]) for s in timed)
    work = sum(float(s.get("seconds") or 0.0) for s in timed)
    forward = sum(float(s.get("forward_seconds") or 0.0) for s in timed)
    return {"jobs": len(timed), "model_load_s": round(load, 3), "extract_s": round(work, 3),
            "forward_s": round(forward, 3), "load_share": round(load / (load + work), 4) if load + work > 0 else None}


def warn_model_loads(timing: Mapping[str, Any]) -> None:
    """Warn when loading the model took more than :data:`LOAD_SHARE_WARNING` of the shard jobs' time
    and :data:`LOAD_SECONDS_WARNING` in all: every ``extract_shard`` job loads the model, so its load is
    paid once per shard."""
    share = timing.get("load_share")
    if share is None or share <= LOAD_SHARE_WARNING or timing["jobs"] < 2 or timing["model_load_s"] < LOAD_SECONDS_WARNING:
        return
    log.warning("loading the model took %.0f%% of the extraction jobs' time (%d jobs: %.1f s loading, %.1f s "
                "extracting): each shard job loads the model once, so a larger tokens.shard_size spends less "
                "GPU time on loads (a new shard size cuts new shards: they are tokenized and extracted again)",
                100 * share, timing["jobs"], timing["model_load_s"], timing["extract_s"])


__all__ = ["ExtractionSettings", "extract_keyed_shard", "gather_hidden", "job_time", "prune_store", "sidecar_of",
           "sibling_record", "stored_record", "warn_model_loads"]

"""The gather of the per-shard extraction (rule ``extract``): ``hidden/`` = ``manifest.json``,
``index.parquet`` and a hard link per shard into the store (``hidden.store/``), then the store's
shards of no current shard taken out (:func:`prune_store`): removed, or kept up to
``extraction.keep_replaced_gb`` in ``hidden.store/replaced/`` for a shard job to take back
(:func:`eagledata.extract.pershard.replaced_record`).

Kept apart from :mod:`eagledata.extract.pershard`: the shard jobs do not import this module, so a
change here is not a change of the code that writes hidden shards (whose fingerprint is a resume key:
it would re-extract every shard).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from eagledata.extract.base import ExtractionError, text_config
from eagledata.extract.core import norm_facts, warn_long_samples, with_file_facts
from eagledata.extract.pershard import ExtractionSettings, sidecar_of
from eagledata.extract.plan import read_plan
from eagledata.extract.storage import REPLACED, kept_replaced, write_index, write_manifest
from eagledata.io import link_file

log = logging.getLogger("eagledata.extract.gather")


def _checked_entry(record: dict[str, Any], entry: dict[str, Any], store: Path) -> dict[str, Any]:
    """A record as a manifest shard entry, checked against the plan's ``entry`` (the token shard it was
    extracted from must be the plan's: a record of older tokens is stale) and against the stored file
    (re-hashed when its size or mtime changed since the record was written)."""
    key = entry["key"]
    if record.get("key") != key:
        raise ExtractionError(f"the record of shard {key} names key {record.get('key')}")
    if record.get("source_sha256") != entry["sha256"]:
        # Snakemake can leave a shard job that the plan's rewrite made out of date unrun in the run that
        # rewrote it (a tokens rerun that changed which rows train, e.g. validation.policy); gathering its
        # record would publish hidden states of rows the tokens stage no longer admits
        raise ExtractionError(
            f"the record of shard {key} is of token shard {record.get('source')} (sha256 "
            f"{str(record.get('source_sha256'))[:16]}), the plan's is {entry['file']} ({entry['sha256'][:16]}): its "
            "extract_shard job has not run since the tokens changed; run snakemake again (it reruns that job)")
    path = store / record["file"]
    if not path.is_file():
        raise ExtractionError(f"hidden shard {path} of key {key} is missing from the store")
    return with_file_facts(record, path, {record["file"]: record})


def prune_store(store: Path, keep: Sequence[str], keep_replaced_bytes: int = 0) -> None:
    """Take out of the store every shard (and sidecar, and ``*.tmp-PID`` of a killed job) that is not
    one of ``keep`` (file names): removed, or with ``keep_replaced_bytes`` moved to :data:`REPLACED`
    (a pair half moved by a killed gather or shard job is completed first), which then keeps the most
    recently replaced shards up to that many bytes (:func:`evict_replaced`). Only run when no shard
    job of the dataset runs (the gather)."""
    if not store.is_dir():  # (a dataset of no sample)
        return
    names = set(keep) | {sidecar_of(Path(k)).name for k in keep}
    replaced = store / REPLACED
    gone = [p for p in store.iterdir()
            if p.is_file() and p.name not in names and (p.suffix in (".safetensors", ".json") or ".tmp-" in p.name)]
    for p in gone if keep_replaced_bytes else ():
        shard = p.with_suffix(".safetensors")
        if p.suffix not in (".safetensors", ".json") or not p.exists():
            continue
        halves = [(shard, replaced / shard.name), (sidecar_of(shard), replaced / sidecar_of(shard).name)]
        if all(src.is_file() or dst.is_file() for src, dst in halves):
            replaced.mkdir(exist_ok=True)
            for src, dst in halves:
                if src.is_file():
                    os.replace(src, dst)
            os.utime(replaced / sidecar_of(shard).name)  # when it was replaced (the shard's mtime is its record's)
            log.info("%s: no current shard; kept in %s", shard, replaced)
    for p in gone:
        if p.exists():
            log.info("removing %s (no current shard)", p)
            p.unlink()
    if replaced.is_dir():
        evict_replaced(replaced, keep_replaced_bytes)


def evict_replaced(replaced: Path, limit: int) -> None:
    """Keep the most recently replaced shards of ``replaced`` with their sidecars (by the sidecar's
    mtime, set when the shard was moved there; the shard's own mtime is the one its sidecar records)
    up to ``limit`` bytes in all; remove the others and anything else there."""
    pairs = []
    for shard in replaced.glob("*.safetensors"):
        try:
            pairs.append((sidecar_of(shard).stat().st_mtime_ns, shard.stat().st_size, shard))
        except FileNotFoundError:  # half a pair
            continue
    kept = {name for shard in kept_replaced(pairs, limit) for name in (shard.name, sidecar_of(shard).name)}
    for p in replaced.iterdir():
        if p.name not in kept:
            log.info("removing %s (beyond extraction.keep_replaced_gb, or half a pair)", p)
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _prune_records(records_dir: Path, record_paths: Sequence[str | Path]) -> None:
    """Remove the job records in ``records_dir`` the plan no longer has: of keys it no longer has, and of
    a key's earlier token contents (beside the current ones: all of them for a dataset left with no shard). A record outliving its shard in the store
    would stand for it when the shard comes back: no job would run, and the gather would miss it."""
    if not records_dir.is_dir():
        return
    current = {Path(p).resolve() for p in record_paths}
    # {key}/{content}.json, and {key}.json as an eagledata before content-named records wrote them
    for p in [*records_dir.glob("*/*.json"), *records_dir.glob("*.json")]:
        if p.resolve() not in current:
            p.unlink()
    for d in records_dir.iterdir():
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()


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
    shards_out = [_checked_entry(r, e, store) for r, e in zip(records, plan["shards"])]
    out.mkdir(parents=True, exist_ok=True)
    run = replace(settings.run({"dataset": plan.get("dataset"), "tokenizer_fingerprint": plan.get("tokenizer_fingerprint")},
                               out), tokens_dir=Path(plan["token_store"]))
    norm: dict[str, Any] = {}
    for s in shards_out:
        link_file(store / s["file"], out / s["file"])
        norm = norm_facts(out / s["file"], norm)
    if not shards_out:  # a dataset of no sample (every prompt a duplicate, say): the vocabulary from the config
        log.warning("%s: no sample to extract", plan.get("dataset"))
        norm = {"vocab_size": int(text_config(settings.weights).vocab_size)}
    write_index(out / "index.parquet", shards_out, out)
    manifest = run.manifest(shards_out, True, **norm)
    manifest["job_time"] = job_time(shards_out)
    write_manifest(out / "manifest.json", manifest)
    warn_model_loads(manifest["job_time"])
    warn_long_samples(manifest)
    prune_store(store, [s["file"] for s in shards_out], settings.keep_replaced_bytes)
    _prune_records(Path(plan_path).parent / "shards", record_paths)  # hidden.work/shards/{key}/{content}.json
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


__all__ = ["LOAD_SECONDS_WARNING", "LOAD_SHARE_WARNING", "evict_replaced", "gather_hidden", "job_time", "prune_store",
           "warn_model_loads"]

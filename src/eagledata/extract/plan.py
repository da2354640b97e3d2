"""The extraction plan (``results/{dataset}/hidden.work/plan.json``, written by the checkpoint
``extract_plan``): per stable shard key, the content-named token shard it extracts. Read without
importing the stage (no torch): the workflow's input functions call :func:`plan_sources` per job.

A plan entry is ``{"key", "file", "sha256", "rows", "longest_train"}``: ``key`` is the tokens stage's
stable shard key (sha256 of the shard's first id, :func:`eagledata.tokens.pershard.shard_key`), ``file``
the token shard's content-named file in ``token_store`` (its name changes exactly when its content
does), ``longest_train`` its longest train sample (prompt + completion tokens, from the tokens
manifest; ``None`` from a manifest without it): a length limit at or above it acts on nothing
(:func:`shard_length_limit`, a param of each shard's job).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eagledata.extract.base import ExtractionError
from eagledata.extract.limits import length_limit
from eagledata.extract.storage import read_tokens_manifest
from eagledata.io import atomic_write_json

PLAN_FORMAT = "eagledata-extract-plan/1"

_CACHE: dict[str, tuple[tuple[int, int], dict[str, dict[str, Any]]]] = {}


def write_plan(tokens_dir: str | Path, plan_path: str | Path) -> dict[str, Any]:
    """The plan of the finished tokens stage in ``tokens_dir`` (its ``manifest.json``: shard keys,
    content-named files, ``sharding.store``), written atomically to ``plan_path``; returned."""
    tokens_dir = Path(tokens_dir)
    path = tokens_dir / "manifest.json"
    manifest = read_tokens_manifest(tokens_dir, verify=False)
    store_rel = (manifest.get("sharding") or {}).get("store")
    if not store_rel:
        raise ExtractionError(f"{path}: no sharding.store (tokens written by the one-job stage?): rerun the tokens stage")
    store = Path(os.path.normpath(tokens_dir / store_rel))
    shards = []
    for n, entry in enumerate(manifest.get("shards", [])):
        if not entry.get("key"):
            raise ExtractionError(f"{path}: shards[{n}] ({entry.get('file')}) has no stable shard key")
        if not (store / entry["file"]).is_file():
            raise ExtractionError(f"{path}: shards[{n}]: token shard {store / entry['file']} is missing")
        shards.append({"key": entry["key"], "file": entry["file"], "sha256": entry["sha256"], "rows": entry["rows"],
                       "longest_train": entry.get("longest_train")})
    keys = [s["key"] for s in shards]
    if len(set(keys)) != len(keys):
        raise ExtractionError(f"{path}: two shards share a key")
    plan = {"format": PLAN_FORMAT, "dataset": manifest.get("dataset"),
            "tokenizer_fingerprint": manifest.get("tokenizer_fingerprint", ""),
            "token_store": str(store), "shards": shards}
    atomic_write_json(plan_path, plan)
    return plan


def read_plan(plan_path: str | Path) -> dict[str, Any]:
    """The plan (raises :class:`ExtractionError` for another format)."""
    plan = json.loads(Path(plan_path).read_text(encoding="utf-8"))
    if plan.get("format") != PLAN_FORMAT:
        raise ExtractionError(f"{plan_path}: format {plan.get('format')!r}, expected {PLAN_FORMAT!r}")
    return plan


def _entries(plan_path: str | Path) -> dict[str, dict[str, Any]]:
    """Shard key -> its plan entry with ``source`` (the token shard's path, ``token_store/file``), in
    plan order; cached while the plan's mtime and size are unchanged (not to be modified)."""
    path = str(plan_path)
    st = os.stat(path)
    stamp = (st.st_mtime_ns, st.st_size)
    hit = _CACHE.get(path)
    if hit is None or hit[0] != stamp:
        plan = read_plan(path)
        hit = _CACHE[path] = (stamp, {s["key"]: {**s, "source": f"{plan['token_store']}/{s['file']}"}
                                      for s in plan["shards"]})
    return hit[1]


def plan_sources(plan_path: str | Path) -> dict[str, str]:
    """Shard key -> path of its token shard (``token_store/file``), in plan order."""
    return {key: entry["source"] for key, entry in _entries(plan_path).items()}


def shard_length_limit(plan_path: str | Path, key: str, limit: dict[str, Any]) -> dict[str, Any]:
    """The length ``limit`` (:func:`eagledata.extract.limits.length_limit`) as it acts on shard
    ``key``: no limit when the shard's longest train sample fits it, as the shard's resume key counts
    it (:func:`eagledata.extract.core.limit_key`); ``limit`` itself when it may act (or the plan
    does not say)."""
    longest = _entries(plan_path)[key].get("longest_train")
    if limit["max_seq_len"] is not None and longest is not None and longest <= limit["max_seq_len"]:
        return length_limit(None, limit["on_long"])
    return limit


def plan_entry(plan: dict[str, Any], key: str) -> dict[str, Any]:
    """The plan's entry of shard ``key`` (raises :class:`ExtractionError` when the plan has none)."""
    for entry in plan["shards"]:
        if entry["key"] == key:
            return entry
    raise ExtractionError(f"shard key {key} is not in the extraction plan of {plan.get('dataset')}")

"""Reading a tokens plan (``tokens.work/plan.json``, written by :func:`eagledata.tokens.plan.plan_shards`)
without importing the stage: the workflow's input functions call :func:`plan_keys` once per job, the
``token_shard`` jobs' priority is :func:`plan_shard_rows`, and ``token_plan``'s thread count is
:func:`plan_processes`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

PLAN_VERSION = 2  # 2: a slice holds each record's io.line_digest (1: its sha256)
#: plan path -> ((mtime_ns, size), its shards' rows by key, in the plan's order)
_CACHE: dict[str, tuple[tuple[int, int], dict[str, int]]] = {}
#: a process reading the responses for the plan reads at least this many bytes: spawning one costs a few
#: hundredths of a second (the plan imports no polars), and the main process reads every entry back and
#: merges them alone. Measured on 2 cores, the whole plan in one process and in two: 60 MB of recorded
#: samples (10k) 0.18-0.20 s and 0.20-0.22 s; 480 MB (80k) 1.44-1.53 s and 1.21-1.24 s; 1.2 GB (200k)
#: 3.72-3.79 s and 3.02 s
MIN_BYTES_PER_PROCESS = 64 << 20


def plan_processes(size: int, most: int) -> int:
    """How many processes the plan reads a responses file of ``size`` bytes in
    (:mod:`eagledata.tokens.planscan`): one per :data:`MIN_BYTES_PER_PROCESS`, 1 to ``most``."""
    return max(1, min(most, size // MIN_BYTES_PER_PROCESS))


def read_plan(plan_path: str | Path) -> dict[str, Any]:
    return json.loads(Path(plan_path).read_text(encoding="utf-8"))


def _shard_rows(plan_path: str | Path) -> dict[str, int]:
    """A plan's shards' rows by key, in the plan's order; read again only when the file's mtime or size changed."""
    path = str(plan_path)
    st = os.stat(path)
    stamp = (st.st_mtime_ns, st.st_size)
    hit = _CACHE.get(path)
    if hit is None or hit[0] != stamp:
        hit = _CACHE[path] = (stamp, {s["key"]: int(s["rows"]) for s in read_plan(path)["shards"]})
    return hit[1]


def plan_keys(plan_path: str | Path) -> list[str]:
    """The shard keys of a plan, in id order."""
    return list(_shard_rows(plan_path))


def plan_shard_rows(plan_path: str | Path, key: str) -> int:
    """The rows of shard ``key`` in the plan; 0 when there is no plan or no such shard in it."""
    try:
        return _shard_rows(plan_path).get(key, 0)
    except OSError:
        return 0

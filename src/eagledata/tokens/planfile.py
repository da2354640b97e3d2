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
#: a process reading the responses for the plan reads at least this many bytes: spawning one costs about
#: 0.35 s, and the main process reads every entry back and merges them alone. Measured on 2 cores: 480 MB
#: of recorded samples (80k) 1.46 s in one process, 1.55 s in two; 1.2 GB (200k) about the same either way;
#: 1.7 GB of drafter-sized ones (10k) 1.7 s in one, 1.4 s in two
MIN_BYTES_PER_PROCESS = 512 << 20


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

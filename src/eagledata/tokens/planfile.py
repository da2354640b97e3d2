"""Reading a tokens plan (``tokens.work/plan.json``, written by :func:`eagledata.tokens.pershard.plan_shards`)
without importing the stage: the workflow's input functions call :func:`plan_keys` once per job, and
``token_plan``'s thread count is :func:`plan_processes`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

_CACHE: dict[str, tuple[tuple[int, int], list[str]]] = {}
#: a process reading the responses for the plan reads at least this many bytes (spawning one costs
#: about a job's start: imports and the tokenizer, about a second)
MIN_BYTES_PER_PROCESS = 64 << 20


def plan_processes(size: int, most: int) -> int:
    """How many processes the plan reads a responses file of ``size`` bytes in
    (:mod:`eagledata.tokens.planscan`): one per :data:`MIN_BYTES_PER_PROCESS`, 1 to ``most``."""
    return max(1, min(most, size // MIN_BYTES_PER_PROCESS))


def read_plan(plan_path: str | Path) -> dict[str, Any]:
    return json.loads(Path(plan_path).read_text(encoding="utf-8"))


def plan_keys(plan_path: str | Path) -> list[str]:
    """The shard keys of a plan, in id order (cached while the file's mtime and size are unchanged)."""
    path = str(plan_path)
    st = os.stat(path)
    stamp = (st.st_mtime_ns, st.st_size)
    hit = _CACHE.get(path)
    if hit is None or hit[0] != stamp:
        hit = _CACHE[path] = (stamp, [s["key"] for s in read_plan(path)["shards"]])
    return list(hit[1])

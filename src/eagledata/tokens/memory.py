"""A job's memory: its peak (:func:`peak_memory_mb`, which every tokens job logs), and how polars'
allocator (jemalloc) returns freed memory in a job that holds one shard after another.

polars sets ``_RJEM_MALLOC_CONF`` when imported (``dirty_decay_ms:500,muzzy_decay_ms:1000``, followed by
whatever the variable held), so a job started by Snakemake, whose own process imported polars, inherits
polars' default as if it were a setting. :func:`return_freed_pages_at_once` must run before polars is
imported (it imports nothing): a job then gives freed pages back at once and its peak follows the shard
it holds, not what the shards before it left (the tokens job at 80k recorded samples: 168-174 -> 158 MB;
about 4% more of its time). A value the user set is left as it is.
"""
from __future__ import annotations

import os
import resource

#: what polars writes into the variable when it finds it unset (polars/__init__.py), and what it adds
#: with ``POLARS_THP=1``
POLARS_DEFAULT = "dirty_decay_ms:500,muzzy_decay_ms:1000"
POLARS_THP = ",thp:always,metadata_thp:always"
#: freed pages returned at once, none kept for reuse
AT_ONCE = "dirty_decay_ms:0,muzzy_decay_ms:0"


def peak_memory_mb() -> float:
    """This process's peak resident memory so far (MB): each job logs it, so a job's peak can be
    compared across dataset sizes (benchmarks/tokens_scale.py). Linux's ``VmHWM``: ``ru_maxrss``
    keeps the peak from before ``exec``, i.e. that of the Snakemake process the job was forked from."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def return_freed_pages_at_once() -> bool:
    """Set ``_RJEM_MALLOC_CONF`` to :data:`AT_ONCE` where it is unset, empty or polars' default
    (inherited; with its huge-page options, which polars adds again here where ``POLARS_THP=1``); True
    when set."""
    if os.environ.get("_RJEM_MALLOC_CONF") in (None, "", POLARS_DEFAULT, POLARS_DEFAULT + POLARS_THP):
        os.environ["_RJEM_MALLOC_CONF"] = AT_ONCE
        return True
    return False


__all__ = ["AT_ONCE", "POLARS_DEFAULT", "POLARS_THP", "peak_memory_mb", "return_freed_pages_at_once"]

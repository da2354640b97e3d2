"""Answers another dataset already paid for, carried over instead of requested again.

A request is known by its cache key (the canonical body sent, the sample index and the backend's
salt: :func:`~eagledata.generate.requests.cache_key`), not by the dataset asking, so when a dataset
is renamed, or its prompts move to a new dataset, the answers paid for under the old name are the
answers to the new dataset's requests. Before anything is requested, :func:`carry_over` looks every
key still to request up in the other datasets' caches under ``cache_dir``
(``{cache_dir}/*/responses.jsonl``, read only, without their locks: only complete lines are read,
as :meth:`~eagledata.generate.cache.ResponseCache.load` reads them). A successful answer found there
(HTTP status 200) is appended to this dataset's cache, as received, with ``carried_from`` naming
the dataset whose cache held it and without that dataset's budget reservation reference (the
reservation is that dataset's, counted in the ledger under its name); it is then not requested.
Answers an old name's job left in a rescue file (a full disk) are not carried: run that dataset once
to take them into its cache. Final HTTP errors
(a 400, a 403) are not carried: nothing was paid for them, and the new dataset asks again.

Only datasets with ``dedup`` on (the default) carry answers over: ``dedup: false`` asks for this
dataset's own answers to prompts that other datasets hold too.

Each sibling cache is scanned once for ``"cache_key": "<64 hex>"`` (a JSON writer escapes every
quote inside a string, so those bytes occur only as a key of some object); a line is parsed only
when one of its candidates is a key to request, and carried only when its own top-level
``cache_key`` is that key.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from eagledata.generate.cache import ResponseCache
from eagledata.io import open_lines

_KEY = re.compile(rb'"cache_key": ?"([0-9a-f]{64})"')


Warn = Callable[[str], None]


def sibling_caches(cache_dir: str | Path, dataset: str) -> list[tuple[str, Path]]:
    """(dataset, cache path) of every other dataset's cache under ``cache_dir``, by name."""
    root = Path(cache_dir)
    if not root.is_dir():
        return []
    return [(p.parent.name, p) for p in sorted(root.glob("*/responses.jsonl")) if p.parent.name != dataset and p.is_file()]


def carried_answers(path: Path, wanted: set[str]) -> Iterable[dict[str, Any]]:
    """The records of the cache at ``path`` whose ``cache_key`` is in ``wanted`` and whose status is
    200, each once (the first complete line of a key), in file order."""
    seen: set[str] = set()
    with open_lines(path) as fh:
        for line in fh:
            if not line.endswith(b"\n"):
                break  # a torn last line: not a record yet
            keys = {m.group(1).decode("ascii") for m in _KEY.finditer(line)} & wanted
            if not keys - seen:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            key = rec.get("cache_key") if isinstance(rec, dict) else None
            if key in keys and key not in seen and rec.get("status") == 200:
                seen.add(key)
                yield rec


def carried_records(wanted: Iterable[str], cache_dir: str | Path, dataset: str,
                    warn: Warn | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """(dataset, record) of every key of ``wanted`` that another dataset's cache answered with
    status 200, each key once (the first dataset by name that holds it); nothing is written. A
    cache that cannot be read (another user's, say, in a shared ``cache_dir``) is skipped, and
    ``warn`` told why."""
    left = set(wanted)
    for name, path in sibling_caches(cache_dir, dataset):
        if not left:
            return
        try:
            for rec in carried_answers(path, left):
                left.discard(rec["cache_key"])
                yield name, rec
        except OSError as exc:
            if warn is not None:
                warn(f"warning: {path}: not read for answers to carry over ({exc.strerror or exc})")


def carry_over(cache: ResponseCache, todo: Iterable[str], cache_dir: str | Path, dataset: str,
               warn: Warn | None = None) -> dict[str, int]:
    """Append to ``cache`` (this dataset's, its writer lock held) the answers :func:`carried_records`
    finds for the keys of ``todo`` it lacks; returns how many came from each dataset, each of them
    in ``cache.index`` afterwards. Stops at the first append the cache could not write
    (``cache.write_error`` is then set; that record and the others kept are in its rescue file)."""
    carried: dict[str, int] = {}
    for name, rec in carried_records([k for k in todo if k not in cache.index], cache_dir, dataset, warn):
        rec.pop("ledger_ref", None)
        rec["carried_from"] = name
        cache.append(rec)
        if cache.write_error is not None:  # else the append indexed it
            break
        carried[name] = carried.get(name, 0) + 1
    return carried


__all__ = ["carried_answers", "carried_records", "carry_over", "sibling_caches"]

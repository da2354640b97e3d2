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

Datasets generated at once (``snakemake --cores N``) cannot carry at job start what the other job
has not received yet, so each request of a ``dedup`` dataset is also *claimed* while it is sent
(:class:`RequestClaims`): an exclusive byte-range lock on ``{cache_dir}/requests.lock`` at an offset
taken from the cache key, held from before its reservation until its answer is in the cache. A job
that finds the request claimed waits (its reservation given back), then, as after every claim, reads
what the other datasets' caches gained since it last looked (their tails only); an answer found
there is carried over as above, and not requested. The kernel drops a dead process's locks
(``kill -9`` included), so a claim never outlives its job: the waiter then requests the sample
itself. An answer its job could not write to its cache (a full disk) is not seen, and is requested
again. A ``dedup: false`` dataset claims what it sends too (when no other job holds the claim), but
never waits nor carries: a dedup dataset generated at once waits for its answers instead of paying again.

Each sibling cache is scanned once for ``"cache_key": "<64 hex>"`` (a JSON writer escapes every
quote inside a string, so those bytes occur only as a key of some object); a line is parsed only
when one of its candidates is a key to request, and carried only when its own top-level
``cache_key`` is that key.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Iterator

from eagledata.generate.cache import ResponseCache, complete_lines_end
from eagledata.io import open_lines

_KEY = re.compile(rb'"cache_key": ?"([0-9a-f]{64})"')


Warn = Callable[[str], None]


def sibling_caches(cache_dir: str | Path, dataset: str) -> list[tuple[str, Path]]:
    """(dataset, cache path) of every other dataset's cache under ``cache_dir``, by name."""
    root = Path(cache_dir)
    if not root.is_dir():
        return []
    return [(p.parent.name, p) for p in sorted(root.glob("*/responses.jsonl")) if p.parent.name != dataset and p.is_file()]


def _answer(line: bytes, wanted: set[str], seen: Collection[str]) -> dict[str, Any] | None:
    """The record of a cache line when it is a status-200 answer to a ``wanted`` key not ``seen`` yet
    (parsed only when one of its ``"cache_key"`` candidates is such a key)."""
    keys = {m.group(1).decode("ascii") for m in _KEY.finditer(line)} & wanted
    if not any(k not in seen for k in keys):
        return None
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    key = rec.get("cache_key") if isinstance(rec, dict) else None
    return rec if key in keys and key not in seen and rec.get("status") == 200 else None


def carried_answers(path: Path, wanted: set[str]) -> Iterable[dict[str, Any]]:
    """The records of the cache at ``path`` whose ``cache_key`` is in ``wanted`` and whose status is
    200, each once (the first complete line of a key), in file order."""
    seen: set[str] = set()
    with open_lines(path) as fh:
        for line in fh:
            if not line.endswith(b"\n"):
                break  # a torn last line: not a record yet
            rec = _answer(line, wanted, seen)
            if rec is not None:
                seen.add(rec["cache_key"])
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


CLAIMS_NAME = "requests.lock"


class RequestClaims:
    """One job's claims on the requests it sends, and its view of what other datasets' caches gained
    since the job looked at them (see the module docstring). Claims are POSIX record locks, owned by
    the process: two jobs in one process do not exclude each other (a generate job is a process).

    :meth:`watch` is called before the start's carry-over scans (every sibling cache's size then is
    where its tail starts), :meth:`want` with the keys the job will request (``scanned``: the start
    looked for them already; else every sibling cache is scanned for them now)."""

    def __init__(self, cache_dir: str | Path, dataset: str, warn: Warn | None = None, waits: bool = True):
        self.cache_dir, self.dataset, self.warn = Path(cache_dir), dataset, warn
        #: False for a ``dedup: false`` dataset: it claims what it sends (so that a dedup dataset
        #: generated at once waits and carries its answers over) but never waits for nor carries another's
        self.waits = waits
        self.offsets: dict[Path, int] = {}  # sibling cache -> end of the complete lines looked at
        self.wanted: set[str] = set()
        self.found: dict[str, tuple[str, Path, int, int]] = {}  # key -> dataset, cache, line offset, length
        self.carried: dict[str, int] = {}  # answers carried while the job ran, per dataset
        self.waited = 0  # requests found claimed by another job
        self._fd: int | None = None
        self.disabled = False  # the lock file cannot be used (see try_claim)

    def watch(self) -> None:
        """Note where each sibling cache's tail starts: the end of its last complete line (a torn
        line is read once complete; cut off by its job's rerun, the answers written over it are in
        the tail)."""
        for _, path in sibling_caches(self.cache_dir, self.dataset):
            self.offsets[path] = _complete_end(path)

    def want(self, keys: Iterable[str], scanned: bool = False) -> None:
        if not self.waits:
            return
        new = set(keys) - self.wanted
        self.wanted |= new
        if scanned or not new:
            return
        for name, path in sibling_caches(self.cache_dir, self.dataset):
            self._look(name, path, 0, _size(path), new)

    def try_claim(self, key: str) -> bool:
        """Claim ``key`` (``True``), or ``False`` while another process holds it. Where the lock file
        cannot be opened or the filesystem has no record locks (``ENOLCK``, ``EOPNOTSUPP``: some network
        filesystems), claims are off for the job, said once: every claim succeeds, as before claims
        existed (a job never waits on a lock that cannot be taken)."""
        if self.disabled:
            return True
        try:
            if self._fd is None:
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.cache_dir / CLAIMS_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # EACCES here is a permission (another user's lock file), never a held claim
            return self._off(exc)
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _offset(key))
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):  # held by another process
                return False
            return self._off(exc)
        return True

    def _off(self, exc: OSError) -> bool:
        """Claims off for the job (said once); ``True``: the claim asked for counts as taken."""
        self.disabled = True
        if self.warn is not None:
            self.warn(f"warning: {self.cache_dir / CLAIMS_NAME}: requests are not claimed across datasets "
                      f"({exc.strerror or exc}): datasets generated at once may pay an identical request twice")
        return True

    def release(self, key: str) -> None:
        """Give the claim up (after the answer is in the cache, or the request given up)."""
        self.wanted.discard(key)
        if self._fd is not None:  # claims turned off since: those taken before are still given up
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, _offset(key))
            except OSError:
                pass  # a lock that cannot be dropped goes with the descriptor (close)

    def answer(self, key: str) -> tuple[str, dict[str, Any]] | None:
        """(dataset, record) of a status-200 answer to ``key`` that another dataset's cache holds,
        looking at what the caches gained since the last look; ``None`` when none does."""
        for name, path in sibling_caches(self.cache_dir, self.dataset):
            size, start = _size(path), self.offsets.get(path, 0)
            self.offsets[path] = self._look(name, path, start if start <= size else 0, size, self.wanted)
        where = self.found.pop(key, None)
        if where is None:
            return None
        name, path, offset, length = where
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                rec = json.loads(fh.read(length))
        except (OSError, ValueError):  # the cache replaced since: the request is sent
            return None
        return (name, rec) if isinstance(rec, dict) and rec.get("cache_key") == key and rec.get("status") == 200 else None

    def _look(self, name: str, path: Path, start: int, end: int, wanted: set[str]) -> int:
        """Note where ``wanted`` keys are answered (status 200) in ``path``'s complete lines between
        ``start`` and ``end`` (from the file's start when ``start`` is no longer a line's: the file
        was cut back or replaced since); returns the end of the last complete line."""
        if end <= start or not wanted:
            return start
        offset = start
        try:
            with open(path, "rb") as fh:
                if start > 0:
                    fh.seek(start - 1)
                    if fh.read(1) != b"\n":  # not a line's start: the file changed under it (cut back, replaced)
                        offset = 0
                fh.seek(offset)
                for line in fh:
                    if not line.endswith(b"\n") or offset + len(line) > end:
                        break  # a torn last line, or past what was asked
                    self._note(name, path, offset, line, wanted)
                    offset += len(line)
        except OSError as exc:
            if self.warn is not None:
                self.warn(f"warning: {path}: not read for answers to carry over ({exc.strerror or exc})")
        return offset

    def _note(self, name: str, path: Path, offset: int, line: bytes, wanted: set[str]) -> None:
        rec = _answer(line, wanted, self.found.keys())
        if rec is not None:
            self.found[rec["cache_key"]] = (name, path, offset, len(line))

    def close(self) -> None:
        """Drop every claim (closing the descriptor drops the process's locks on the file)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _complete_end(path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    try:
        return complete_lines_end(fd, os.fstat(fd).st_size)
    except OSError:
        return 0
    finally:
        os.close(fd)


def _offset(key: str) -> int:
    """The byte of ``requests.lock`` that stands for a request: 60 bits of its cache key."""
    return int(key[:15], 16)


__all__ = ["RequestClaims", "carried_answers", "carried_records", "carry_over", "sibling_caches"]

"""One writer per dataset cache: the generate job holds an exclusive lock on its dataset's cache.

The lock is an ``flock`` on ``{cache_dir}/{dataset}/writer.lock``, taken before the cache is read and
held until the job ends, so two jobs of one dataset (two work directories sharing one ``cache_dir``,
two Snakemake runs, a manual ``python -m eagledata.generate.job`` beside a rule) never append to one
cache at once, and the second one computes what to request only after the first has cached its
answers: each prompt is paid once. The kernel drops the lock when the holder's file descriptor
closes, ``kill -9`` included (the descriptor is not inherited by child processes). ``flock`` works
across processes of one host; over NFS, Linux maps it to NFS byte-range locks (the server must
support locking).

The holder writes who it is into the lock file (pid, host, work directory, dataset, start time):
a job that waits says every few seconds whom it waits for, and gives up after the bound
(``generation.job_timeout_s`` when set, else :data:`DEFAULT_WAIT_S`, or ``$EAGLEDATA_CACHE_LOCK_WAIT_S``)
with :class:`CacheLockTimeout` naming the holder. Readers (``eagledata plan``, the output writer)
take no lock: the cache is append-only and a torn last line is ignored by
:meth:`eagledata.generate.job.ResponseCache.load`.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

from eagledata.errors import EagledataError

LOCK_NAME = "writer.lock"
DEFAULT_WAIT_S = 3600.0
WAIT_ENV = "EAGLEDATA_CACHE_LOCK_WAIT_S"
POLL_S = 0.05
FIRST_NOTE_S = 0.2


class CacheLockTimeout(EagledataError, TimeoutError):
    """The dataset's cache stayed locked by another job for the whole wait; the message names it."""


def lock_path(cache_dir: str | Path, dataset: str) -> Path:
    """The writer lock file of a dataset cache: ``{cache_dir}/{dataset}/writer.lock``."""
    return Path(cache_dir) / dataset / LOCK_NAME


def lock_wait_s(generation: Mapping[str, Any]) -> float:
    """How long a job waits for the lock: ``$EAGLEDATA_CACHE_LOCK_WAIT_S``, else the job timeout
    when one is set, else :data:`DEFAULT_WAIT_S`."""
    env = os.environ.get(WAIT_ENV)
    if env:
        return float(env)
    job = generation.get("job_timeout_s")
    return float(job) if job is not None else DEFAULT_WAIT_S


def describe_holder(path: str | Path) -> str:
    """Who holds (or last held) the lock, from the identity its holder wrote."""
    try:
        who = json.loads(Path(path).read_text(encoding="utf-8") or "null")
    except (OSError, ValueError):
        who = None
    if not isinstance(who, dict):
        return "a process that has not written its identity yet"
    return (f"pid {who.get('pid')} on host {who.get('host')} (work directory {who.get('workdir')}, "
            f"since {who.get('started_at')})")


class CacheWriterLock:
    """The held lock; :meth:`release` (or process exit) frees it."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = -1

    def __enter__(self) -> "CacheWriterLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _write_identity(fd: int, dataset: str) -> None:
    """Best effort (a full disk must not stop the job here: the write is informational)."""
    who = {"pid": os.getpid(), "host": socket.gethostname(), "workdir": os.getcwd(), "dataset": dataset,
           "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(who).encode("utf-8") + b"\n", 0)
    except OSError:
        pass


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def try_writer_lock(cache_dir: str | Path, dataset: str) -> CacheWriterLock | None:
    """The dataset's cache lock when no job holds it now, else ``None`` (no wait): for a command that
    writes a cache beside the jobs (``eagledata retry``)."""
    path = lock_path(cache_dir, dataset)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    if not _try_lock(fd):
        os.close(fd)
        return None
    _write_identity(fd, dataset)  # a job waiting meanwhile names this process, not the last job
    return CacheWriterLock(path, fd)


async def acquire_writer_lock(cache_dir: str | Path, dataset: str, wait_s: float,
                              log: Callable[[str], None]) -> CacheWriterLock:
    """Take the dataset's cache lock, waiting up to ``wait_s`` while another job holds it (a
    message naming the holder after :data:`FIRST_NOTE_S`, then every 5 s for a minute, then every
    minute).
    Raises :class:`CacheLockTimeout` naming the holder when the wait runs out."""
    path = lock_path(cache_dir, dataset)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    t0 = time.monotonic()
    next_note = t0 + FIRST_NOTE_S  # by then the holder has written who it is
    try:
        while not _try_lock(fd):
            waited = time.monotonic() - t0
            if waited >= wait_s:
                raise CacheLockTimeout(
                    f"the cache of dataset {dataset!r} ({path.parent}) is still being written by another job after "
                    f"{waited:.0f} s: {describe_holder(path)}. Only one job writes a dataset's cache at a time; rerun "
                    f"when it has finished (its answers are then cached, not paid again), or raise the wait with "
                    f"{WAIT_ENV}.")
            if time.monotonic() >= next_note:
                log(f"waiting for the cache lock {path} ({waited:.0f} s of at most {wait_s:g} s): held by "
                    f"{describe_holder(path)}")
                next_note += 5.0 if waited < 60 else 60.0
            await asyncio.sleep(POLL_S)
    except BaseException:
        os.close(fd)
        raise
    _write_identity(fd, dataset)
    if time.monotonic() - t0 > POLL_S:
        log(f"cache lock {path} taken after {time.monotonic() - t0:.1f} s")
    return CacheWriterLock(path, fd)

"""The response cache: ``{cache_dir}/{dataset}/responses.jsonl``, one line per finished request
(success or final error; and a retry marker per final error ``eagledata retry`` forgot), appended at
once so that even ``kill -9`` loses no response received, and deliberately not a Snakemake output (so
the paid answers outlive any rerun of the rule).

Own code because no library gives these guarantees together: one ``write`` per record, ``fsync`` at
most every :data:`FSYNC_INTERVAL_S` off the event loop, a torn last line ignored and cut off, and a
full disk that loses no paid answer (the lines kept in memory and in a rescue file,
:mod:`eagledata.generate.rescue`, written back once space returns, or imported by the next run).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from eagledata.errors import EagledataError
from eagledata.generate.errors import GenerationError
from eagledata.generate.respell import Spellings, settings_spelling, settings_text
from eagledata.generate.rescue import RESCUE_ENV, RescueFile, find_rescue_files, free_space, read_rescue_lines
from eagledata.io import atomic_path

Log = Callable[[str], None]

FSYNC_INTERVAL_S = 0.5
#: A record's field naming the model path the SGLang server that answered it reported
#: (:mod:`eagledata.generate.servedmodel`).
SERVED_FIELD = "served_model"
#: The field of a retry marker: a line that forgets the final error cached before it for its key
#: (``eagledata retry``), so that the next job requests it again. The file stays append-only.
RETRY_FIELD = "retry"
#: The marker's key field. Not ``cache_key``: a reader that knows no markers (an older eagledata in
#: another work directory sharing the cache_dir) then skips the line as unreadable and keeps the final
#: error, instead of taking the marker for the key's record (and writing it out as a sample with no
#: status, request nor response). Markers with a ``cache_key`` are read too.
RETRY_KEY_FIELD = "retry_of"


class FsyncFailed(EagledataError, OSError):
    """An ``fsync`` of the cache failed: the records since the last successful one may be lost."""


class ResponseCache:
    """Append-only JSONL of finished requests, indexed by ``cache_key`` (byte offsets, so records
    are read back only when the output is written). ``refs``: the budget reservation behind each
    record (``ledger_ref`` -> cost, provider, generation id), for the ledger's crash recovery.

    One writer at a time (the generate job holding :mod:`eagledata.generate.cachelock`'s lock); any number
    of readers (:meth:`load` ignores a torn last line). A failed write or ``fsync`` (``OSError``,
    e.g. ENOSPC) never loses a line: the file is cut back to its last record known to be on disk,
    every line not known to be there is kept in :attr:`pending` (and appended to a
    :class:`~eagledata.generate.rescue.RescueFile` when ``dataset`` is given), :attr:`write_error` names the
    path, the error and the free space, ``on_write_error`` hears of it once (the job stops), and
    every later line goes to :attr:`pending` too; :meth:`write_pending` writes them once the disk
    takes them again."""

    def __init__(self, path: str | Path, dataset: str | None = None):
        self.path = Path(path)
        self.index: dict[str, tuple[int, int]] = {}
        self.refs: dict[str, dict[str, Any]] = {}
        # the settings spellings of the records with an integral float (eagledata.generate.respell)
        self.spellings: Spellings = {}
        self._settings_seen: set[bytes | str] = set()
        self.not_answered: set[str] = set()  # keys whose record is not known to be a status-200 answer
        self.aliases: dict[str, str] = {}  # key -> the key of its record, cached in another spelling (alias)
        # key -> the model path the SGLang server reported when it answered (records that name one)
        self.served: dict[str, str] = {}
        self._served_names: dict[str, str] = {}  # one string per model path
        self.urls: set[str] = set()  # the URLs (lower-cased) the cached requests were sent to
        self.forgotten: set[str] = set()  # keys whose final error a retry marker forgot (asked again on purpose)
        self.skipped_lines = 0
        self.pending: list[tuple[str, bytes]] = []  # received, not (known to be) in the file
        self.write_error: str | None = None
        self.on_write_error: Callable[[str], None] | None = None
        self.rescue = RescueFile(self.path, dataset) if dataset else None
        self._rescued = 0  # pending lines already in the rescue file
        self._fd: int | None = None
        self._size = 0  # end of the last record written
        self._durable = 0  # end of the last record covered by a successful fsync
        self._unsynced: list[tuple[str, bytes]] = []  # the records between the two
        self._sync_mark = (0, 0)  # (size, unsynced count) that the background fsync in progress covers
        self._synced = 0.0
        self._syncing: Future | None = None  # the background fsync in progress
        self._sync_thread: ThreadPoolExecutor | None = None

    def load(self) -> dict[str, tuple[int, int]]:
        self.index.clear()
        self.refs.clear()
        self.spellings.clear()
        self._settings_seen.clear()
        self.not_answered.clear()
        self.aliases.clear()
        self.forgotten.clear()
        self.served.clear()
        self.urls.clear()
        if not self.path.exists():
            return self.index
        offset = 0
        with open(self.path, "rb") as fh:
            for line in fh:
                if line.endswith(b"\n"):
                    try:
                        self._index_line(json.loads(line), offset, len(line))
                    except (ValueError, KeyError, TypeError):
                        self.skipped_lines += 1
                offset += len(line)  # a last line without newline is a torn write: ignored
        return self.index

    def _index_line(self, rec: Mapping[str, Any], offset: int, length: int) -> None:
        if RETRY_FIELD in rec:  # a final error forgotten (:meth:`forget`); an answer never is
            key = rec[RETRY_KEY_FIELD] if RETRY_KEY_FIELD in rec else rec["cache_key"]
            if key in self.not_answered:
                self.index.pop(key, None)
                self.not_answered.discard(key)
                self.forgotten.add(key)
            return
        key = rec["cache_key"]
        self.index[key] = (offset, length)
        if rec.get("status") == 200:
            self.not_answered.discard(key)
        else:
            self.not_answered.add(key)
        url = rec.get("url")
        if isinstance(url, str):
            self.urls.add(url.lower())
        served = rec.get(SERVED_FIELD)
        if isinstance(served, str):
            self.served[key] = self._served_names.setdefault(served, served)
        else:
            self.served.pop(key, None)
        self._keep_spelling(rec)
        if rec.get("ledger_ref"):
            self.refs[rec["ledger_ref"]] = {"cost": rec.get("cost"), "provider": rec.get("provider"),
                                            "generation_id": rec.get("generation_id")}

    def _keep_spelling(self, rec: Mapping[str, Any]) -> None:
        """Keep the settings spelling of ``rec``'s request (:mod:`eagledata.generate.respell`)."""
        request = rec.get("request")
        if isinstance(request, dict):  # each spelling looked at once
            seen = settings_text(request)
            if seen not in self._settings_seen:
                self._settings_seen.add(seen)
                spelling = settings_spelling(request)
                if spelling is not None:
                    self.spellings.setdefault(spelling[0], set()).add(spelling[1])

    def alias(self, key: str, cached: str) -> None:
        """Point ``key`` at the record of ``cached`` (the same request in another spelling of its
        settings: :mod:`eagledata.generate.respell`); in memory only."""
        self.index[key] = self.index[cached]
        self.aliases[key] = cached

    @property
    def records(self) -> int:
        """How many requests the cache holds answers to (its index without the aliases)."""
        return len(self.index) - len(self.aliases)

    def open(self) -> None:
        """Open for appending (once), first cutting off a torn last line (so the next record
        starts on a line of its own)."""
        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        size = os.lseek(fd, 0, os.SEEK_END)
        keep = complete_lines_end(fd, size)
        if keep != size:
            os.ftruncate(fd, keep)
            os.fsync(fd)
        self._fd, self._size, self._durable = fd, keep, keep

    # -- writing --------------------------------------------------------------------------------
    def _write_some(self, fd: int, data: memoryview) -> int:
        """One ``os.write`` (the seam where tests inject a full disk)."""
        return os.write(fd, data)

    def _fsync(self, fd: int) -> None:
        """``os.fsync`` (a seam for tests too)."""
        os.fsync(fd)

    def _write_all(self, data: bytes) -> None:
        """Write ``data`` at the end; on failure cut the file back to the last record and re-raise."""
        assert self._fd is not None
        view = memoryview(data)
        try:
            while view:
                view = view[self._write_some(self._fd, view):]
        except OSError:
            self._cut_back()
            raise

    def _cut_back(self) -> None:
        """Drop any bytes after the last record (a partly written line); best effort."""
        try:
            if self._fd is not None and os.lseek(self._fd, 0, os.SEEK_END) != self._size:
                os.ftruncate(self._fd, self._size)
        except OSError:
            pass

    def append_line(self, key: str, line: bytes) -> None:
        """Append one complete record line with a single ``write`` (crash-safe against a killed
        process: the kernel has the bytes once ``write`` returns); ``fsync`` (against power loss)
        at most every :data:`FSYNC_INTERVAL_S`, on a background thread so that a slow disk never
        stalls the requests in flight. Never raises ``OSError``: after a failed write or fsync the
        line is kept (see the class docstring)."""
        if self.write_error is None:
            try:
                self._append(key, line)
                return
            except OSError as exc:
                self._write_failed(exc, isinstance(exc, FsyncFailed))
        self._keep([(key, line)])

    def _append(self, key: str, line: bytes) -> None:
        if self._fd is None:
            self.open()
        if self._syncing is not None and self._syncing.done():
            self._check_sync()
        self._write_all(line)
        self.index[key] = (self._size, len(line))
        self.not_answered.add(key)  # until append() says it is an answer
        self._size += len(line)
        self._unsynced.append((key, line))
        if time.monotonic() - self._synced >= FSYNC_INTERVAL_S and self._syncing is None:
            self._synced = time.monotonic()
            if self._sync_thread is None:
                self._sync_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-fsync")
            self._sync_mark = (self._size, len(self._unsynced))
            self._syncing = self._sync_thread.submit(self._fsync, self._fd)

    def append(self, record: Mapping[str, Any]) -> None:
        key = record["cache_key"]
        self.append_line(key, (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        if key in self.index and record.get("status") == 200:
            self.not_answered.discard(key)
            self._keep_spelling(record)

    def forget(self, key: str, note: Mapping[str, Any]) -> None:
        """Append a retry marker for ``key`` (``{"retry_of": key, "retry": note}``) and drop ``key``
        from the index, so that the next job requests it again. Only a final error is forgotten: a key
        whose record is an answer (status 200), or not in this cache, raises ``ValueError``. Raises
        ``OSError`` when the marker cannot be written (the record stays as it was)."""
        if key not in self.index or key not in self.not_answered or key in self.aliases:
            raise ValueError(f"{self.path}: {key} is not a final error of this cache")
        self._append(key, (json.dumps({RETRY_KEY_FIELD: key, RETRY_FIELD: dict(note)}) + "\n").encode("utf-8"))
        self.index.pop(key)
        self.not_answered.discard(key)
        self.forgotten.add(key)

    def _check_sync(self) -> None:
        """Account for the finished (else: wait for the) background ``fsync``: the records it
        covered are durable; raises :class:`FsyncFailed` if it failed."""
        fut, self._syncing = self._syncing, None
        if fut is None:
            return
        exc = fut.exception()
        if exc is not None:
            raise FsyncFailed(getattr(exc, "errno", None), getattr(exc, "strerror", None) or str(exc))
        size, n = self._sync_mark
        self._durable = max(self._durable, size)
        del self._unsynced[:n]

    def _sync_now(self) -> OSError | None:
        """``fsync`` now, after any background one; the error when the records are not all durable."""
        try:
            self._check_sync()
            if self._fd is not None and self._unsynced:
                try:
                    self._fsync(self._fd)
                except OSError as exc:
                    raise FsyncFailed(exc.errno, exc.strerror or str(exc)) from exc
                self._durable, self._unsynced = self._size, []
        except OSError as exc:
            return exc
        self._synced = time.monotonic()
        return None

    def sync(self) -> None:
        """``fsync`` now, on the caller's thread. Never raises ``OSError``: records a failed fsync
        cannot vouch for are kept as after a failed write."""
        exc = self._sync_now()
        if exc is not None:
            self._write_failed(exc, True)

    def _write_failed(self, exc: OSError, fsync_failed: bool) -> None:
        """A failed write or fsync. The records written since the last successful fsync are
        durable only if an fsync succeeds now, never after a failed one (the kernel may have
        dropped their pages and reports that once): then they are kept and cut off the file."""
        first = self.write_error is None
        if first:
            self.write_error = (f"{self.path}: {'fsync' if fsync_failed else 'write'} failed: "
                                f"{exc.strerror or exc} ({free_space(self.path)})")
        if not fsync_failed and self._sync_now() is not None:
            fsync_failed = True
        if fsync_failed and self._unsynced:
            lost, self._unsynced = self._unsynced, []
            for key, _ in lost:
                self.index.pop(key, None)
            self._size = self._durable
            self._cut_back()
            self._keep(lost)
        if first and self.on_write_error is not None:
            self.on_write_error(self.write_error)

    def _keep(self, lines: list[tuple[str, bytes]]) -> None:
        """Hold lines the file did not take, and append them to the rescue file (best effort now;
        :meth:`rescue_all` tries again)."""
        self.pending.extend(lines)
        if self.rescue is not None:
            try:
                self.rescue.append(line for _, line in self.pending[self._rescued:])
                self._rescued = len(self.pending)
            except OSError:
                pass

    def write_pending(self) -> int:
        """Write the kept lines at the end of the cache and ``fsync``; returns how many. Raises
        ``OSError`` while the disk still refuses them (the file cut back, nothing lost). Then the
        rescue file, no longer needed, is deleted."""
        if not self.pending:
            return 0
        self.open()
        self._cut_back()
        self._write_all(b"".join(line for _, line in self.pending))
        try:
            self._fsync(self._fd)
        except OSError:
            self._cut_back()
            raise
        offset = self._size
        for key, line in self.pending:
            self.index[key] = (offset, len(line))
            offset += len(line)
        self._size = self._durable = offset
        n, self.pending, self._rescued = len(self.pending), [], 0
        if self.rescue is not None:
            self.rescue.discard()
        return n

    def rescue_all(self) -> Path:
        """Make sure every kept line is in the rescue file; returns its path. Raises
        :class:`GenerationError` naming every place tried (and its free space) when none takes them."""
        if self.rescue is None:
            self.rescue = RescueFile(self.path, self.path.parent.name)
        try:
            self.rescue.append(line for _, line in self.pending[self._rescued:])
        except OSError:
            raise GenerationError(
                f"{len(self.pending)} paid answer(s) could be written neither to the cache ({self.write_error}) nor "
                f"to a rescue file ({'; '.join(self.rescue.errors)}); they are lost when this process ends. Free space, "
                f"or point ${RESCUE_ENV} at a disk with room, before the next run") from None
        self._rescued = len(self.pending)
        assert self.rescue.path is not None
        return self.rescue.path

    def import_rescued(self, files: Iterable[Path]) -> int:
        """Before anything is sent: the records of rescue files (:mod:`eagledata.generate.rescue`) that are
        not cached yet are written to the cache and fsync'ed, then the files are deleted. Returns
        how many were imported. Raises ``OSError`` while the cache refuses them (files kept)."""
        files = list(files)
        found: dict[str, tuple[dict[str, Any], bytes]] = {}
        for f in files:
            for line in read_rescue_lines(f):
                try:
                    rec = json.loads(line)
                    if rec["cache_key"] not in self.index:
                        found[rec["cache_key"]] = (rec, line)
                except (ValueError, KeyError, TypeError):
                    continue
        self.pending = [(key, line) for key, (_, line) in found.items()]
        n = self.write_pending()
        for key, (rec, _) in found.items():
            self._index_line(rec, *self.index[key])
        for f in files:
            f.unlink(missing_ok=True)
        return n

    # -- reading --------------------------------------------------------------------------------
    def get(self, key: str, fh: Any = None) -> dict[str, Any]:
        """The record of ``key``; pass an open binary ``fh`` of the cache to read many."""
        offset, length = self.index[key]
        if fh is None:
            with open(self.path, "rb") as own:
                return self.get(key, own)
        fh.seek(offset)
        return json.loads(fh.read(length))

    def close(self) -> None:
        """``fsync`` and close; a failed fsync keeps its records in :attr:`pending` (and the
        rescue file) as after a failed write."""
        if self._fd is not None:
            self.sync()
            os.close(self._fd)
            self._fd = None
        if self._sync_thread is not None:
            self._sync_thread.shutdown(wait=True)
            self._sync_thread = None
        if self.rescue is not None:
            self.rescue.close()


def complete_lines_end(fd: int, size: int) -> int:
    """The end of the last complete line of the file open as ``fd`` whose first ``size`` bytes are
    looked at (0 without one): a torn last line (a writer killed mid-write) starts there."""
    keep = size
    while keep > 0:  # scan back to the last newline
        start = max(0, keep - 65536)
        block = os.pread(fd, keep - start, start)
        nl = block.rfind(b"\n")
        if nl >= 0:
            return start + nl + 1
        keep = start
    return 0


def write_jsonl_atomic(path: str | Path, records: Iterable[Mapping[str, Any]]) -> int:
    """Write records to ``path`` atomically (:func:`eagledata.io.atomic_path`); returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as fh:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n += 1
    return n


def import_rescued_answers(cache: ResponseCache, dataset: str, log: Log) -> int:
    """Answers an earlier job saved in rescue files (its cache disk was full) go into the cache
    before anything is sent; raises :class:`GenerationError` (nothing sent) while the cache
    refuses them."""
    files = find_rescue_files(cache.path, dataset)
    if not files:
        return 0
    try:
        n = cache.import_rescued(files)
    except OSError as exc:
        cache.close()
        raise GenerationError(
            f"generate {dataset}: paid answers saved in {', '.join(map(str, files))} could not be imported into the "
            f"cache {cache.path} ({exc.strerror or exc}; {free_space(cache.path)}); nothing was sent: free space on "
            "the cache's disk and rerun") from None
    log(f"imported {n} paid answer(s) from {', '.join(map(str, files))} into {cache.path} before any request "
        "(the rescue files are deleted)")
    return n


async def keep_paid_answers(cache: ResponseCache, wait_s: float, log: Log) -> str:
    """After the requests: make every answer received durable. Answers that a failed write left
    in memory are written to the cache as soon as it takes them (retried with backoff for
    ``wait_s``), else stay in the rescue file, which the next run imports before it sends
    anything. Returns what happened to them, for the stop message ("" when nothing failed);
    raises :class:`GenerationError` when neither the cache nor a rescue directory takes them."""
    cache.sync()
    if not cache.pending:
        return ""
    n, deadline, delay, noted = len(cache.pending), time.monotonic() + wait_s, 0.25, 0.0
    while True:
        try:
            cache.write_pending()
        except OSError as exc:
            now = time.monotonic()
            if now + delay > deadline:
                break
            if now - noted >= 5.0:
                noted = now
                log(f"{n} paid answer(s) kept in memory: {cache.path} refuses them ({exc.strerror or exc}; "
                    f"{free_space(cache.path)}); retrying for {deadline - now:.0f} s more")
            await asyncio.sleep(delay)
            delay = min(2 * delay, 5.0)
            continue
        log(f"{n} paid answer(s) kept in memory are now written to {cache.path} (space came back)")
        return f"the {n} answer(s) kept in memory were written to the cache once space came back"
    where = cache.rescue_all()
    log(f"{n} paid answer(s) saved in {where}: the next run imports them into the cache before sending anything")
    return (f"{n} paid answer(s) received are saved in {where}, not in the cache; the next run imports them "
            "before it sends anything: free space on the cache's disk, then rerun")



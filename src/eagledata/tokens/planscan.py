"""The plan's one read of a responses file, in parallel byte ranges when it is large.

The plan (:func:`eagledata.tokens.plan.plan_shards`) checks every record as the one-job stage
checks it and needs, of each, its id, line number, byte offset, length and the digest of its line
(:func:`~eagledata.io.line_digest`), and a digest of the file's records (``plan.json``'s
``source_lines_xxh3_128``: the XXH3-128 of each record line's ``offset TAB length TAB digest``, in file
order: a check of change, which any record changed, moved or added changes, computed from what the
read gives anyway, where a digest of the whole file's bytes cost a second read of it). :class:`RecordScan`
gives those:

- in one pass in this process for a small file (or ``workers=1``);
- else in up to ``workers`` processes (one per 64 MB: :func:`~eagledata.tokens.planfile.plan_processes`):
  this one and spawned helpers, each reading byte ranges of the file (cut at line starts, a few per
  process, shared out as the processes come to them: :func:`~eagledata.tokens.sharedwork.shared_map`)
  and writing those fields to a scratch file per range. The scratch files are then read in file
  order with their line numbers made global. At drafter-training size (hundreds of GB of streamed bodies) the
  one-process read was the stage's longest sequential step.

The results are the same either way: a record without an id gets ``{dataset}-{line:06d}`` from its
global line, and the first bad record in file order is refused with the message the one-process
read gives (the same text, the same global line). Processes are spawned, not forked
(:func:`~eagledata.tokens.sharedwork.spawned_pool`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import orjson
import xxhash

from eagledata.codeinputs import verify_inherited_code
from eagledata.io import (BLANK_LINE, ResponsesFileError, iter_lines_at, json_line_value, line_digest, loads_json,
                          open_lines)
from eagledata.tokens.planfile import plan_processes
from eagledata.tokens.sharedwork import shared_map, spawned_pool
from eagledata.tokens.sharding import checked_record, record_id

#: byte ranges per process: the ranges are shared out as the processes come to them, and a helper holds
#: up to two more than the one it reads (the pool queues them ahead), so smaller ones even out the
#: processes' ends (at 200k recorded samples on 2 cores, 4 a process left this one idle a third of the scan)
RANGES_PER_PROCESS = 16

#: (id, line number, byte offset, length without the line break, digest of the line: io.line_digest)
Entry = tuple[str, int, int, int, str]


def entry_line(entry: Entry) -> str:
    """An entry as a line of a scratch file (the range readers' and the plan's sorted runs):
    ``json(id or null) TAB line TAB offset TAB length TAB digest``; :func:`read_entry` reads it back."""
    sid, lineno, offset, length, sha = entry
    return f"{orjson.dumps(sid).decode('utf-8')}\t{lineno}\t{offset}\t{length}\t{sha}\n"


def read_entry(line: str) -> Entry:
    sid, lineno, offset, length, sha = line.rstrip("\n").split("\t")
    return loads_json(sid), int(lineno), int(offset), int(length), sha


class RecordScan:
    """Iterate :meth:`entries` once (file order); then :attr:`digest` is the digest of the file's records
    (``source_lines_xxh3_128``, hex) and :attr:`processes` says how many processes read it."""

    def __init__(self, path: str | Path, dataset: str, scratch: str | Path, workers: int = 1) -> None:
        self.path, self.dataset, self.scratch = Path(path), dataset, Path(scratch)
        try:
            size = self.path.stat().st_size
        except OSError as exc:
            raise ResponsesFileError(f"{self.path}: cannot read responses file: {exc.strerror or exc}") from None
        self.processes = plan_processes(size, workers)
        self.digest: str | None = None

    def entries(self) -> Iterator[Entry]:
        digest = xxhash.xxh3_128()
        for entry in self._one_process() if self.processes == 1 else self._in_ranges():
            digest.update(f"{entry[2]}\t{entry[3]}\t{entry[4]}\n".encode("ascii"))
            yield entry
        self.digest = digest.hexdigest()

    def _one_process(self) -> Iterator[Entry]:
        with open_lines(self.path) as fh:
            for lineno, offset, raw in iter_lines_at(fh):
                entry = _entry(self.path, lineno, offset, raw)
                if entry is not None:
                    yield self._with_id(entry, entry[1])

    def _in_ranges(self) -> Iterator[Entry]:
        cuts = _line_starts(self.path, self.processes * RANGES_PER_PROCESS)
        outs = [self.scratch / f"scan-{i:04d}.tsv" for i in range(len(cuts) - 1)]
        ranges = [(str(self.path), a, b, str(out)) for a, b, out in zip(cuts, cuts[1:], outs)]
        with spawned_pool(self.processes - 1) as pool:
            results = shared_map(pool, _scan_range_of, _scan_range_of, ranges)
        bases, base = [], 0
        for lines, error in results:
            if error is not None:
                line, message = error
                local = f"{self.path}:{line}"
                raise ResponsesFileError(f"{self.path}:{base + line}{message[len(local):]}")
            bases.append(base)
            base += lines
        for out, base in zip(outs, bases):
            with open(out, encoding="utf-8") as fh:
                for row in fh:
                    sid, lineno, offset, length, sha = read_entry(row)
                    yield self._with_id((sid, base + lineno, offset, length, sha), base + lineno)
            out.unlink()

    def _with_id(self, entry: tuple, line: int) -> Entry:
        sid = entry[0] if entry[0] is not None else f"{self.dataset}-{line:06d}"
        return (sid, line, *entry[2:])


def _scan_range_of(args: tuple[str, int, int, str]) -> tuple[int, tuple[int, str] | None]:
    return scan_range(*args)


def scan_range(path: str, start: int, end: int, out: str) -> tuple[int, tuple[int, str] | None]:
    """One worker's range of ``path`` (the lines starting in ``[start, end)``) -> ``out``, a row per
    record (:func:`entry_line`, its line numbered in the range). Returns the
    number of lines read and, for a bad record, ``(its line in the range, the error's message)``
    (the range is not read further)."""
    verify_inherited_code()  # a spawned reader imports the code on disk now: the job's stamps' code?
    lines, source = 0, Path(path)
    with open_lines(path) as src, open(out, "w", encoding="utf-8") as fh:
        for lines, offset, raw in iter_lines_at(src, start, end):
            try:
                entry = _entry(source, lines, offset, raw)
            except ResponsesFileError as exc:
                return lines, (lines, str(exc))
            if entry is not None:
                fh.write(entry_line(entry))
    return lines, None


def _entry(path: Path, lineno: int, offset: int, raw: bytes) -> tuple | None:
    """A record line's entry (its id None when it has none); None for a blank line. Raises
    :class:`ResponsesFileError` for a bad record, as the one-job stage does."""
    where = f"{path}:{lineno}"
    rec = json_line_value(raw, where, ResponsesFileError)
    if rec is BLANK_LINE:
        return None
    sid = record_id(checked_record(rec, where), None)  # named after its global line later
    line = raw.rstrip(b"\r\n")
    return sid, lineno, offset, len(line), line_digest(line)


def _line_starts(path: Path, parts: int) -> list[int]:
    """``parts`` + 1 byte offsets from 0 to the file's size, each inner one at a line's start (ranges
    that would be empty are dropped)."""
    size = path.stat().st_size
    cuts = [0]
    with open(path, "rb") as fh:
        for i in range(1, parts):
            fh.seek(max(cuts[-1], size * i // parts))
            if fh.tell() > 0:
                fh.seek(fh.tell() - 1)
                fh.readline()  # to the end of the line the guess falls in (or of the previous one)
            pos = fh.tell()
            if cuts[-1] < pos < size:
                cuts.append(pos)
    return cuts + [size]


__all__ = ["Entry", "RecordScan", "entry_line", "read_entry", "scan_range"]

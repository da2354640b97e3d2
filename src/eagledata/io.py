"""Shared file helpers: JSON-lines reading with errors that name the file, line and field; atomic
writes (a temporary file in the same directory, fsync'ed, then ``os.replace`` and a directory
fsync, so a reader sees the old file or the new one, never a torn one); sha256 of files and text.

Every JSONL input of the pipeline (prompts, responses, imported recordings) goes through
:func:`iter_json_lines`, so a bad line always fails the same way: ``FILE:LINE:(json): invalid JSON
... at column N`` (the 1-based character column of the error in that line), ``FILE:LINE:(line): not valid UTF-8 ...`` or ``FILE:LINE: a line must be a JSON object``.

JSON is parsed by :func:`loads_json`: orjson (faster than the standard library on the large response
bodies the tokens stage reads), and the standard library wherever orjson refuses,
so a value is always what ``json.loads`` gives and an error is always ``json.loads``'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, NoReturn

import orjson
import xxhash

from eagledata.errors import InputError


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def line_digest(line: bytes) -> str:
    """A record line's content digest (hex XXH3-128, from the xxhash library): what the tokens
    plan keeps of each record to see it change and a shard job checks the record it reads against.
    A check of change, not of trust: a 128-bit digest that no edit is likely to collide with, about
    sixty times faster than sha256 on a streamed drafter record of 300 KB (sha256 was a tenth of
    the stage's time, paid twice). Files keep sha256 (``sha256_file``)."""
    return xxhash.xxh3_128_hexdigest(line)


def quick_exit(code: int = 0) -> NoReturn:
    """End this process now with exit status ``code``, without the interpreter's teardown: the log
    handlers are flushed and closed and the standard streams flushed first. For the entry script of a
    per-shard job once its outputs are written and closed: freeing what a job built (a 160k-entry
    rank table, polars) costs it about 0.15 s at exit, and nothing the job needs runs then."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def sha256_text(text: str) -> str:
    """Hex sha256 of ``text`` encoded as UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fsync_dir(path: str | Path) -> None:
    """Make a rename or creation inside directory ``path`` durable (best effort where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``, its own to this writer (process id and a random part:
    writers on several hosts may share a directory); when the block succeeds the file written there
    is fsync'ed and replaces ``path`` atomically; when it fails the temporary file is removed."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        yield tmp
        if tmp.is_file():
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            if tmp.is_file():
                tmp.unlink()


def replace_unless_same(tmp: str | Path, dest: str | Path, sha256: str | None = None) -> bool:
    """Move the finished file ``tmp`` to ``dest`` atomically (:func:`atomic_path`), unless ``dest``
    holds the same bytes already: then ``dest`` is left untouched (bytes and mtime) and ``tmp`` is
    removed. ``sha256``: of ``tmp``, when the caller has it. Returns True when ``dest`` was kept."""
    tmp, dest = Path(tmp), Path(dest)
    if dest.is_file() and dest.stat().st_size == tmp.stat().st_size and sha256_file(dest) == (sha256 or sha256_file(tmp)):
        tmp.unlink()
        return True
    with atomic_path(dest) as t:
        os.replace(tmp, t)
    return False


def link_file(src: str | Path, dst: str | Path) -> None:
    """Make ``dst`` the file ``src``: a hard link, or an atomic copy keeping the mtime where linking is
    impossible (another filesystem). An existing ``dst`` is replaced; its directory is created."""
    src, dst = Path(src), Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        with atomic_path(dst) as tmp:
            shutil.copy2(src, tmp)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, value: Any, indent: int | None = 2) -> None:
    atomic_write_text(path, json.dumps(value, indent=indent, ensure_ascii=False) + "\n")


class ResponsesFileError(InputError):
    """A responses file (generated, imported or recorded) has a bad line; names file:line:field."""


def loads_json(data: str | bytes) -> Any:
    """``json.loads(data)``, faster: orjson first; the standard library when orjson refuses (a lone
    surrogate escape, NaN, invalid JSON), which gives its value or raises its own error. One
    difference remains: orjson reads an integer beyond 64 bits as a float (the standard library keeps
    it exact); none occurs in API traffic, and a prompt rendered from one would miss its billed count.
    A value nested too deeply for either (about 1,000 levels) is refused as invalid JSON (a
    ``json.JSONDecodeError``, at position 0), not with the standard library's ``RecursionError``: the
    callers that report bad input as a value catch ``ValueError``."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        try:
            return json.loads(data)
        except RecursionError:
            raise json.JSONDecodeError("nested too deeply to read (more than about 1,000 levels)", "", 0) from None


def iter_json_lines(path: str | Path, error: type[Exception], what: str = "file",
                    objects_only: bool = True) -> Iterator[tuple[int, str, Any]]:
    """Yield ``(line number, "FILE:LINE", value)`` for every non-blank line of ``path``.

    Raises ``error`` for an unreadable file, a line that is not UTF-8 or not JSON, and (with
    ``objects_only``) a line whose value is not a JSON object."""
    for lineno, _, where, value in iter_json_lines_at(path, error, what, objects_only):
        yield lineno, where, value


def iter_json_lines_at(path: str | Path, error: type[Exception], what: str = "file", objects_only: bool = True,
                       on_bytes: Callable[[bytes], Any] | None = None) -> Iterator[tuple[int, int, str, Any]]:
    """:func:`iter_json_lines` with each line's byte offset: ``(line number, offset, "FILE:LINE",
    value)``, in one read of the file; ``on_bytes`` (e.g. a hash's ``update``) sees every line's bytes."""
    path = Path(path)
    try:
        fh = open_lines(path)
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    with fh:
        for lineno, offset, raw in iter_lines_at(fh):
            if on_bytes is not None:
                on_bytes(raw)
            where = f"{path}:{lineno}"
            value = json_line_value(raw, where, error, objects_only)
            if value is not BLANK_LINE:
                yield lineno, offset, where, value


#: The read buffer of files read line by line (:func:`open_lines`). A streamed response is a line of
#: hundreds of KB; through the default 8 KB buffer, reading such lines costs about three times as much.
LINE_BUFFER = 1 << 20


def open_lines(path: str | Path) -> BinaryIO:
    """``path`` opened to be read line by line (binary, a :data:`LINE_BUFFER` buffer)."""
    return open(path, "rb", buffering=LINE_BUFFER)


def iter_lines_at(fh: BinaryIO, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int, bytes]]:
    """(line number counted from ``start``, byte offset, bytes) of each line of the binary file ``fh``
    that starts in ``[start, end)`` (``start`` at a line's start)."""
    fh.seek(start)
    pos = start
    for lineno, raw in enumerate(fh, 1):
        if end is not None and pos >= end:
            return
        yield lineno, pos, raw
        pos += len(raw)


#: what :func:`json_line_value` returns for a blank line
BLANK_LINE = object()
_BLANK = re.compile(rb"\s*")


def json_line_value(raw: bytes, where: str, error: type[Exception], objects_only: bool = True) -> Any:
    """The value of one line's bytes (``where`` is its "FILE:LINE"); :data:`BLANK_LINE` for a blank line. Raises
    ``error`` for a line that is not UTF-8 or not JSON, or (with ``objects_only``) not an object."""
    if not _BLANK.fullmatch(raw):
        try:  # the common case, parsed from the bytes (orjson checks the UTF-8); a refusal is read again
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
        else:
            if objects_only and not isinstance(value, dict):
                raise error(f"{where}: a line must be a JSON object, got {type(value).__name__}")
            return value
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{where}:(line): not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not line.strip():
        return BLANK_LINE
    text = line.rstrip("\r\n")
    try:
        value = loads_json(text)
    except json.JSONDecodeError as exc:
        raise error(f"{where}:(json): invalid JSON: {exc.msg} at {error_column(text, exc.pos)}") from None
    if objects_only and not isinstance(value, dict):
        raise error(f"{where}: a line must be a JSON object, got {type(value).__name__}")
    return value


def error_column(text: str, pos: int) -> str:
    """Where a JSON error at character offset ``pos`` of one line is: the 1-based character column
    (as an editor counts it) and the text around it. The line is decoded without its line ending,
    so an error at the end of the line is reported there, not as "line 2, column 1"."""
    pos = max(0, min(pos, len(text)))
    near = text[max(0, pos - 20): pos + 20]
    where = "end of line" if pos == len(text) else f"near {near!r}"
    return f"column {pos + 1} ({where})"


def normalize_response_line(rec: dict[str, Any]) -> dict[str, Any]:
    """A responses-file line in any accepted shape, as a recorded-format record.

    Accepted: the recorded format (``request``, ``status``, ``response_raw``); a plain OpenRouter
    response log line (``request`` beside ``response``, the parsed response object); or a response
    object itself with its ``request`` beside its own fields. A parsed response can only be
    re-serialized, not recovered byte for byte: such records get ``response_raw_reserialized``."""
    if "response_raw" in rec or not isinstance(rec.get("request"), dict):
        return rec
    if isinstance(rec.get("response"), dict):
        body, rest = rec["response"], {k: v for k, v in rec.items() if k != "response"}
    elif "choices" in rec or "error" in rec:
        keep = ("request", "status", "id_", "source", "recorded")
        body = {k: v for k, v in rec.items() if k not in keep}
        rest = {k: v for k, v in rec.items() if k in keep}
    else:
        return rec
    status = rest.get("status")
    if status is None:
        err = body.get("error") if isinstance(body.get("error"), dict) else None
        code = err.get("code") if err else None
        status = code if isinstance(code, int) and 400 <= code <= 599 else 200
    return {**rest, "status": status, "response_raw": json.dumps(body, ensure_ascii=False),
            "response_raw_reserialized": True}

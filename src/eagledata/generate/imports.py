"""Imports of existing response logs (``responses:`` datasets): a recorded responses file is
validated line by line (errors name ``file:line:field``) and written as the dataset's responses,
with the same record fields and cache keys as generated ones."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

from eagledata.generate.cache import write_jsonl_atomic
from eagledata.generate.progress import Log, stderr_log
from eagledata.generate.requests import cache_key
from eagledata.io import ResponsesFileError, iter_json_lines, normalize_response_line


def read_response_records(path: str | Path, dataset: str, check_text: bool = False) -> Iterator[dict[str, Any]]:
    """Validate a responses file in the recorded format (``request``, ``status``,
    ``response_raw``; ``id`` optional, default ``<dataset>-<line:06d>``) and yield output records.
    Extra fields (``source``, ``recorded``, ...) are kept. ``check_text``: refuse a string holding a
    lone surrogate, naming it (a scan of every string: :func:`import_responses` asks for it only
    after encoding failed)."""
    path = Path(path)
    seen: dict[str, int] = {}
    for lineno, where, rec in iter_json_lines(path, ResponsesFileError, "responses file"):
        rec = normalize_response_line(rec)
        bad = _lone_surrogate(rec, []) if check_text else None
        if bad is not None:
            raise ResponsesFileError(f"{where}:{'.'.join(map(str, bad))}: a lone surrogate escape (\\ud800-\\udfff "
                                     "unpaired) is no Unicode text: it can be neither stored as UTF-8 nor encoded")
        req = rec.get("request")
        if not isinstance(req, dict):
            raise ResponsesFileError(f"{where}:request: missing or not an object")
        if not isinstance(req.get("messages"), list) or not req["messages"]:
            raise ResponsesFileError(f"{where}:request.messages: missing or not a non-empty list")
        status = rec.get("status")
        if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
            raise ResponsesFileError(f"{where}:status: must be an HTTP status code, got {status!r}")
        if not isinstance(rec.get("response_raw"), str):
            raise ResponsesFileError(f"{where}:response_raw: missing or not a string (the exact body received)")
        rid = rec.get("id")
        if rid is None:
            rid = f"{dataset}-{lineno:06d}"
        elif isinstance(rid, bool) or not isinstance(rid, (str, int)) or not str(rid):
            raise ResponsesFileError(f"{where}:id: must be a non-empty string")
        rid = str(rid)
        if rid in seen:
            raise ResponsesFileError(f"{where}:id: duplicate id {rid!r}, first at line {seen[rid]}")
        seen[rid] = lineno
        out = {"id": rid, "prompt_id": rec.get("prompt_id", rid), "sample_index": rec.get("sample_index", 0),
               "request": req, "status": status, "response_raw": rec["response_raw"], "url": rec.get("url"),
               "cache_key": cache_key(req), "backend": rec.get("backend", "import"),
               "started_at": rec.get("started_at", rec.get("recorded")), "elapsed_s": rec.get("elapsed_s"),
               "attempts": rec.get("attempts")}
        out.update({k: v for k, v in rec.items() if k not in out})
        yield out


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value: Any, path: list[Any]) -> list[Any] | None:
    """The key path of the first string (or key) in ``value`` holding a lone surrogate (JSON's
    ``"\\ud800"`` unpaired reads as one), else None."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, sub in items:
        found = _lone_surrogate(key, path + [key]) if isinstance(key, str) else None
        found = found if found is not None else _lone_surrogate(sub, path + [key])
        if found is not None:
            return found
    return None


def import_responses(source: str | Path, dataset: str, output_path: str | Path, log: Log = stderr_log) -> dict[str, Any]:
    """Validate ``source`` and write it atomically to ``output_path`` as the dataset's responses."""
    try:
        n = write_jsonl_atomic(output_path, read_response_records(source, dataset))
    except UnicodeEncodeError:  # a lone surrogate escape somewhere: read again to name it
        for _ in read_response_records(source, dataset, check_text=True):
            pass
        raise
    if n == 0:
        Path(output_path).unlink(missing_ok=True)
        raise ResponsesFileError(f"{source}: no responses (file is empty or blank)")
    log(f"import {dataset}: {n} responses from {source} -> {output_path}")
    return {"dataset": dataset, "samples": n, "source": str(source), "output": str(output_path)}


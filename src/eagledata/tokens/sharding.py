"""A responses file's records as the sharded tokens stage takes them, and the rule that cuts their ids into
shards (the rule itself is explained in :mod:`eagledata.tokens.shards`): the check every record passes
(:func:`checked_record`), its id (:func:`record_id`), whether a shard starts at an id
(:func:`is_boundary_id`), the cap on a shard's rows and a shard's key. Nothing here imports polars: the
plan (``token_plan``) needs only this, and its job starts faster without it.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

from eagledata.io import ResponsesFileError, normalize_response_line

#: A shard is cut at ``MAX_SHARD_FACTOR * shard_size`` rows even without a boundary id.
MAX_SHARD_FACTOR = 4
SHARDING_RULE = "ids sorted; a shard starts at each id with int(sha256(id), 16) % shard_size == 0"


def is_boundary_id(sample_id: str, shard_size: int) -> bool:
    """Does a new shard start at ``sample_id``? ``int(sha256(id), 16) % shard_size == 0``."""
    return int.from_bytes(hashlib.sha256(sample_id.encode("utf-8")).digest(), "big") % shard_size == 0


def shard_key(first_id: str) -> str:
    """A shard's key: the first 16 hex of the sha256 of its first id."""
    return hashlib.sha256(first_id.encode("utf-8")).hexdigest()[:16]


def record_id(record: Mapping[str, Any], fallback: str | None) -> str | None:
    rid = record.get("id")
    return str(rid) if rid is not None else fallback


def checked_record(rec: dict[str, Any], where: str) -> dict[str, Any]:
    """``rec`` in the recorded shape (:func:`~eagledata.io.normalize_response_line`), refused naming
    ``where`` (file:line) and the field unless it has a request object and a body, and an id that is
    Unicode text where it has one (its shard follows from the id's UTF-8 bytes)."""
    rec = normalize_response_line(rec)
    for key in ("request", "response_raw"):
        if key not in rec:
            raise ResponsesFileError(f"{where}:{key}: missing")
    if not isinstance(rec["request"], dict):
        raise ResponsesFileError(f"{where}:request: must be an object")
    rid = rec.get("id")
    if isinstance(rid, str) and not rid.isascii():
        try:
            rid.encode("utf-8")
        except UnicodeEncodeError:  # (only a lone surrogate has no UTF-8 bytes)
            raise ResponsesFileError(f"{where}:id: a lone surrogate escape (\\ud800-\\udfff unpaired) is no "
                                     "Unicode text: an id must be (its shard follows from its UTF-8 bytes)") from None
    return rec


__all__ = ["MAX_SHARD_FACTOR", "SHARDING_RULE", "checked_record", "is_boundary_id", "record_id", "shard_key"]

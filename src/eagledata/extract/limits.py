"""Sequence length limits of a dataset's extraction (issue 12 point 7), applied to a token shard
before any forward.

* ``max_seq_len`` (``None`` = no limit) and ``on_long`` (:data:`ON_LONG`): ``truncate`` keeps the
  prompt and cuts the completion to ``max_seq_len`` tokens in all; a sample whose prompt alone
  reaches ``max_seq_len`` (no completion token would remain, so nothing to train on) is skipped.
  ``skip`` leaves out every sample longer than ``max_seq_len``.
* Every affected sample is flagged (:func:`apply_length_limit` returns ``{"id", "tokens", "kept",
  "action"}`` records, ``action`` ``truncated`` or ``skipped``), recorded in the hidden-state
  manifest per shard and counted in the dataset's totals.
* A limit acts on a shard only when one of its samples exceeds it: a stored shard's resume key
  (:func:`eagledata.extract.core.limit_key`) counts a limit none of its samples reaches as no limit,
  so adding, raising or removing such a limit re-extracts nothing.
* :data:`TRAINER_MAX_LEN`: the trainers' default maximum lengths; samples stored longer than them
  are counted (:func:`over_trainer_max`) and warned about in the extract log, since the trainer cuts
  them again at load time unless its setting is raised.
"""

from __future__ import annotations

from typing import Any

from eagledata.extract.base import ExtractionError
from eagledata.extract.storage import TokenShard

ON_LONG = ("truncate", "skip")

#: Default maximum sequence length of each trainer: SpecForge ``data.max_length`` (2048; its offline
#: loader cuts samples there) and vLLM speculators ``scripts/train.py --total-seq-len`` (8192; its
#: ``ArrowDataset`` ``max_len``), as read in their code (vllm-project/speculators 02a40fe).
TRAINER_MAX_LEN = {"specforge": 2048, "speculators": 8192}


def length_limit(max_seq_len: int | None, on_long: str) -> dict[str, Any]:
    """A dataset's length limit as it decides anything (the shards' resume key, the manifest, the
    extraction rules' param): without a ``max_seq_len``, ``on_long`` decides nothing and reads as the
    default. Light to import (numpy is imported inside functions): the Snakefile calls it."""
    return {"max_seq_len": max_seq_len, "on_long": on_long if max_seq_len is not None else "truncate"}


def check_limit(max_seq_len: int | None, on_long: str) -> None:
    """Raise :class:`ExtractionError` for a limit no extraction can run with."""
    if on_long not in ON_LONG:
        raise ExtractionError(f"extraction.on_long must be one of {ON_LONG}, got {on_long!r}")
    if max_seq_len is not None and (isinstance(max_seq_len, bool) or int(max_seq_len) < 1):
        raise ExtractionError(f"extraction.max_seq_len must be null or >= 1, got {max_seq_len!r}")


def apply_length_limit(shard: TokenShard, max_seq_len: int | None, on_long: str) -> tuple[TokenShard, list[dict[str, Any]]]:
    """``shard`` with the limit applied (samples cut or left out, order kept) and the flag records."""
    import numpy as np

    check_limit(max_seq_len, on_long)
    if max_seq_len is None:
        return shard, []
    limit = int(max_seq_len)
    lengths = shard.lengths
    keep: list[tuple[int, int]] = []  # (sample index, kept length)
    flags: list[dict[str, Any]] = []
    for k, n in enumerate(lengths):
        if n <= limit:
            keep.append((k, n))
            continue
        prompt = int(shard.prompt_lens[k])
        if on_long == "skip" or prompt >= limit:
            flags.append({"id": shard.ids[k], "tokens": n, "kept": 0, "action": "skipped",
                          **({"reason": "prompt alone reaches max_seq_len"} if on_long == "truncate" else {})})
        else:
            keep.append((k, limit))
            flags.append({"id": shard.ids[k], "tokens": n, "kept": limit, "action": "truncated"})
    if not flags:
        return shard, []
    parts = [shard.input_ids[int(shard.offsets[k]) : int(shard.offsets[k]) + m] for k, m in keep]
    flat = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum([m for _, m in keep])]).astype(np.int64)
    prompt_lens = np.asarray([int(shard.prompt_lens[k]) for k, _ in keep], dtype=np.int64)
    return TokenShard([shard.ids[k] for k, _ in keep], flat, offsets, prompt_lens), flags


def over_trainer_max(lengths: list[int]) -> dict[str, int]:
    """Per trainer, how many of ``lengths`` (stored sample lengths) exceed its default maximum."""
    return {name: sum(1 for n in lengths if n > cap) for name, cap in TRAINER_MAX_LEN.items()}


def limit_summary(shards: list[dict[str, Any]], max_seq_len: int | None, on_long: str) -> dict[str, Any]:
    """The manifest's ``length_limit`` block: the setting (:func:`length_limit`) and the counts summed
    over ``shards``."""
    flagged = [f for s in shards for f in (s.get("length_limit") or {}).get("flagged", [])]
    over = {name: sum((s.get("length_limit") or {}).get("over_trainer_max", {}).get(name, 0) for s in shards)
            for name in TRAINER_MAX_LEN}
    return {**length_limit(max_seq_len, on_long),
            "truncated": sum(1 for f in flagged if f["action"] == "truncated"),
            "skipped": sum(1 for f in flagged if f["action"] == "skipped"),
            "trainer_max_len": dict(TRAINER_MAX_LEN), "over_trainer_max": over}

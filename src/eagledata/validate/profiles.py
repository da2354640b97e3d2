"""Provider fidelity profiles, accumulated across runs.

Each validated dataset contributes one entry per provider to a history file (JSON lines at
``{cache_dir}/fidelity_history.jsonl``; like the response cache it is not a Snakemake output, so it
survives reruns and ``--delete-all-output``). A dataset's entries are replaced, never counted twice,
when the dataset is validated again with the same responses (the same sha256, of the file or of its
records in id order, under any tokenizer) or
the same responses file (its absolute path: a dataset that grew, shrank, even to no sample, or was
retokenized): all of them, so a provider no longer in it stops counting; another dataset, or the same
name in another workflow, adds its own. Validate jobs of several datasets write it under a file lock
(``fidelity_history.jsonl.lock``). :func:`accumulated_profiles` sums the history into one profile per provider:
counts per verdict (joint and per side), exact share, count-convention votes, the transformations
seen, the distribution of completion count differences, the prompt rendering variants seen, and the
reasoning count reliability learned in each run (with its evidence: samples and spread).
"""

from __future__ import annotations

import fcntl
import json
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

from eagledata.io import atomic_write_text
from eagledata.tokens.checks import VERDICTS

HISTORY_NAME = "fidelity_history.jsonl"


def _replaces(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    """Whether ``new`` (a dataset's measurement: ``dataset``, ``source_sha256``,
    ``source_records_sha256``, ``source``) measures what ``old`` did, whatever its provider (see the
    module docstring): the same file's sha256 (the one-job stage's manifest), the same records (the
    per-shard manifest's digest of the records in id order), or the same file; an entry written
    before entries named their file matches by sha256 only. A digest neither side has matches nothing."""
    return new["dataset"] == old.get("dataset") and any(
        new.get(k) is not None and new.get(k) == old.get(k) for k in ("source_sha256", "source_records_sha256", "source"))


def history_path(cache_dir: str | Path) -> Path:
    return Path(cache_dir) / HISTORY_NAME


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line from a crash
    return entries


def record_validation(path: str | Path, report: Mapping[str, Any], manifest: Mapping[str, Any]) -> int:
    """Add (or replace) this dataset's per-provider entries; returns the number written."""
    path = Path(path)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    measured = {"dataset": report["dataset"], "source_sha256": manifest.get("source_sha256"),
                "source_records_sha256": manifest.get("source_records_sha256"),
                "source": str(Path(manifest["source"]).resolve()) if manifest.get("source") else None}
    new = []
    for provider, p in report["providers"].items():
        new.append({
            **measured,
            "tokenizer_fingerprint": report.get("tokenizer_fingerprint"), "provider": provider,
            "family": manifest.get("family"), "recorded_at": now,
            **{k: p.get(k, 0) for k in ("total", *VERDICTS, "completion_verified")},
            "convention": p.get("convention"), "convention_by_finish": p.get("convention_by_finish", {}),
            "transformations_seen": p.get("transformations_seen", {}), "completion_diff": p.get("completion_diff", {}),
            "completion": p.get("completion", {}), "prompt": p.get("prompt", {}), "prompt_variant": p.get("prompt_variant"),
            "reasoning_count": p.get("reasoning_count", {}),
        })
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:  # validate jobs of several datasets at once
        fcntl.flock(lock, fcntl.LOCK_EX)
        kept = [e for e in _read(path) if not _replaces(measured, e)]
        atomic_write_text(path, "".join(json.dumps(e) + "\n" for e in kept + new))
    return len(new)


def accumulated_profiles(path: str | Path) -> dict[str, dict[str, Any]]:
    """One profile per provider over every recorded run."""
    out: dict[str, dict[str, Any]] = {}
    for e in _read(Path(path)):
        p = out.setdefault(e["provider"], {"total": 0, **{k: 0 for k in VERDICTS}, "completion_verified": 0,
                                           "datasets": [], "convention_votes": Counter(),
                                           "transformations_seen": Counter(), "completion_diff": Counter(),
                                           "prompt": Counter(), "prompt_variants": Counter(), "reasoning_count": []})
        for k in ("total", *VERDICTS, "completion_verified"):
            p[k] += int(e.get(k) or 0)
        p["datasets"].append(e["dataset"])
        if e.get("convention"):
            p["convention_votes"][e["convention"]] += int(e.get("total") or 0)
        p["transformations_seen"].update(e.get("transformations_seen") or {})
        p["completion_diff"].update({d: int(n) for d, n in (e.get("completion_diff") or {}).items()})
        p["prompt"].update(e.get("prompt") or {})
        if e.get("prompt_variant"):
            p["prompt_variants"][e["prompt_variant"]] += int(e.get("total") or 0)
        if (e.get("reasoning_count") or {}).get("samples"):
            p["reasoning_count"].append({"dataset": e["dataset"], **e["reasoning_count"]})
    for p in out.values():
        p["exact_share"] = round(p["exact"] / p["total"], 4) if p["total"] else 0.0
        p["good_share"] = round((p["exact"] + p["repaired"]) / p["total"], 4) if p["total"] else 0.0
        votes = p.pop("convention_votes")
        p["convention"] = votes.most_common(1)[0][0] if votes else "unknown"
        p["convention_votes"] = dict(votes)
        p["transformations_seen"] = dict(p["transformations_seen"])
        p["prompt"], p["prompt_variants"] = dict(p["prompt"]), dict(p["prompt_variants"])
        p["prompt_exact_share"] = round(p["prompt"].get("exact", 0) / p["total"], 4) if p["total"] else 0.0
        p["reasoning_checksum"] = all(r.get("checksum", True) for r in p["reasoning_count"])
        p["completion_diff"] = dict(sorted(p["completion_diff"].items(), key=lambda kv: int(kv[0])))
        p["datasets"] = sorted(set(p["datasets"]))
    return dict(sorted(out.items()))

"""Validation stage: aggregate a dataset's per-sample verdicts into ``validation.json`` and a
readable summary, and decide whether the dataset may go on to extraction.

``validation.json`` (schema version 1)::

    {"schema": 1, "dataset", "tokenizer_fingerprint", "policy", "passed", "bad_fraction",
     "max_bad_fraction",
     "counts": {"total", "exact", "repaired", "mismatch", "error", "excluded", "included"},
     "providers": {NAME: {"total", "exact", "repaired", "mismatch", "error", "exact_share",
                          "convention", "convention_support", "completion_diff": {DIFF: N},
                          "prompt_diff": {DIFF: N}}},
     "reasons": {CODE: {"severity", "message", "count", "ids": [...]}},
     "excluded_ids": [...]}

``total`` is the number of records in the responses file; ``excluded`` the samples the policy keeps
out of training (they stay listed under their reasons); bad = mismatch + error.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from .checks import REASONS, VERDICTS, completion_verified
from .tokens import read_shards

SCHEMA_VERSION = 1
_COLUMNS = ["id", "provider", "verdict", "reasons", "train", "completion_diff", "prompt_diff"]


class ValidationFailed(RuntimeError):
    pass


def summarize(tokens_dir: str | Path, max_bad_fraction: float) -> dict[str, Any]:
    manifest = json.loads((Path(tokens_dir) / "manifest.json").read_text(encoding="utf-8"))
    df = read_shards(tokens_dir, columns=_COLUMNS)
    counts = Counter({v: 0 for v in VERDICTS})
    providers: dict[str, dict[str, Any]] = {}
    reasons: dict[str, dict[str, Any]] = {}
    excluded: list[str] = []
    cdiff: dict[str, Counter] = defaultdict(Counter)
    pdiff: dict[str, Counter] = defaultdict(Counter)
    for row in df.iter_rows(named=True):
        v, prov = row["verdict"], row["provider"]
        counts[v] += 1
        p = providers.setdefault(prov, {"total": 0, **{k: 0 for k in VERDICTS}, "completion_verified": 0})
        p["total"] += 1
        p[v] += 1
        p["completion_verified"] += completion_verified(row["reasons"])
        if row["completion_diff"] is not None:
            cdiff[prov][str(row["completion_diff"])] += 1
        if row["prompt_diff"] is not None:
            pdiff[prov][str(row["prompt_diff"])] += 1
        for code in row["reasons"]:
            r = reasons.setdefault(code, {"severity": REASONS[code][0], "message": REASONS[code][1], "count": 0, "ids": []})
            r["count"] += 1
            r["ids"].append(row["id"])
        if not row["train"]:
            excluded.append(row["id"])
    total = df.height
    for prov, p in providers.items():
        p["exact_share"] = round(p["exact"] / p["total"], 4) if p["total"] else 0.0
        p["completion_verified_share"] = round(p["completion_verified"] / p["total"], 4) if p["total"] else 0.0
        conv = manifest.get("conventions", {}).get(prov, {})
        p["convention"] = conv.get("convention", "unknown")
        p["convention_by_finish"] = {f: g["convention"] for f, g in sorted((conv.get("by_finish") or {}).items())}
        p["convention_support"] = conv.get("support", {})
        p["transformations_seen"] = conv.get("transformations_seen", {})
        p["completion_diff"] = dict(sorted(cdiff[prov].items(), key=lambda kv: int(kv[0])))
        p["prompt_diff"] = dict(sorted(pdiff[prov].items(), key=lambda kv: int(kv[0])))
    bad = counts["mismatch"] + counts["error"]
    bad_fraction = bad / total if total else 0.0
    return {
        "schema": SCHEMA_VERSION,
        "dataset": manifest.get("dataset"),
        "tokenizer_fingerprint": manifest.get("tokenizer_fingerprint"),
        "policy": manifest.get("policy"),
        "passed": bad_fraction <= max_bad_fraction,
        "bad_fraction": round(bad_fraction, 6),
        "max_bad_fraction": max_bad_fraction,
        "counts": {"total": total, **{k: counts[k] for k in VERDICTS},
                   "excluded": len(excluded), "included": total - len(excluded)},
        "providers": dict(sorted(providers.items())),
        "reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1]["count"])),
        "excluded_ids": excluded,
    }


def render_summary(report: dict[str, Any]) -> str:
    c = report["counts"]
    lines = [
        f"dataset {report['dataset']}: {c['total']} responses -> {c['exact']} exact, {c['repaired']} repaired, "
        f"{c['mismatch']} mismatch, {c['error']} error; {c['included']} included, {c['excluded']} excluded "
        f"(policy {report['policy']})",
        f"bad fraction {report['bad_fraction']:.4f} (limit {report['max_bad_fraction']}): "
        + ("PASSED" if report["passed"] else "FAILED"),
        "",
        f"{'provider':<16}{'total':>7}{'exact':>7}{'repair':>7}{'mism':>7}{'error':>7}{'compl.ok':>9}  convention   completion diff (ours-billed: n)",
    ]
    for name, p in report["providers"].items():
        diffs = ", ".join(f"{d}: {n}" for d, n in p["completion_diff"].items())
        by_finish = p.get("convention_by_finish", {})
        if len(set(by_finish.values())) > 1:
            diffs += "  [" + ", ".join(f"{f}: {c}" for f, c in by_finish.items()) + "]"
        lines.append(f"{name:<16}{p['total']:>7}{p['exact']:>7}{p['repaired']:>7}{p['mismatch']:>7}{p['error']:>7}"
                     f"{p['completion_verified']:>9}  "
                     f"{p['convention']:<12} {diffs}")
    if report["reasons"]:
        lines += ["", "reasons:"]
        for code, r in report["reasons"].items():
            ids = ", ".join(r["ids"][:5]) + (" ..." if len(r["ids"]) > 5 else "")
            lines.append(f"  {code} [{r['severity']}] x{r['count']}: {r['message']} (e.g. {ids})")
    return "\n".join(lines) + "\n"


def write_validation(tokens_dir: str | Path, json_path: str | Path, summary_path: str | Path,
                     max_bad_fraction: float) -> dict[str, Any]:
    """Write both files atomically; raise :class:`ValidationFailed` (after writing) when the bad
    fraction exceeds the limit."""
    report = summarize(tokens_dir, max_bad_fraction)
    for path, text in ((Path(json_path), json.dumps(report, indent=2) + "\n"), (Path(summary_path), render_summary(report))):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    if not report["passed"]:
        raise ValidationFailed(
            f"dataset {report['dataset']}: {report['bad_fraction']:.2%} of samples are mismatch/error, above the "
            f"limit {report['max_bad_fraction']:.2%} (validation.max_bad_fraction); see {summary_path}"
        )
    return report

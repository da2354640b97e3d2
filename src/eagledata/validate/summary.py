"""Validation stage: aggregate a dataset's per-sample verdicts into ``validation.json`` and a
readable summary, and decide whether the dataset may go on to extraction.

``validation.json`` (schema version 2; the version-1 keys keep their meaning)::

    {"schema": 2, "dataset", "tokenizer_fingerprint", "policy", "policy_sets", "passed",
     "bad_fraction", "max_bad_fraction", "bad_counts",
     "counts": {"total", "exact", "repaired", "mismatch", "error", "excluded", "included",
                "completion": {"exact", "repaired", "mismatch", "error"},
                "prompt": {"exact", "unproven", "differs", "unbilled", "error"},
                "admitted_with_prompt_differs", "admitted_with_prompt_unproven"},
     "providers": {NAME: {"total", "exact", "repaired", "mismatch", "error", "exact_share",
                          "completion": {VERDICT: N}, "completion_verified", "completion_verified_share",
                          "prompt": {VERDICT: N}, "prompt_exact_share", "prompt_variant", "prompt_variant_samples",
                          "prompt_rendering": {...}, "reasoning_count": {"checksum", "samples", ...},
                          "admitted", "admitted_share", "convention", "convention_by_finish",
                          "convention_support", "transformations_seen",
                          "completion_diff": {DIFF: N}, "prompt_diff": {DIFF: N}}},
     "reasons": {CODE: {"severity", "message", "count", "ids": [...]}},
     "excluded_ids": [...]}

``exact``/``repaired``/``mismatch``/``error`` are the verdicts of both sides together (``exact``:
completion exact and prompt exact or unbilled; a differing or unproven prompt makes a sample
``mismatch``); ``admitted_with_prompt_unproven`` counts the samples admitted with a prompt the billed
count cannot prove (the tools' key order, ``prompt_order_unproven``);
``counts.completion`` and ``counts.prompt`` are the per-side breakdowns. ``excluded`` are the
samples the policy keeps out of training (listed under their reasons). The gate's bad fraction is
``bad_counts: completion`` (default): completion mismatch + error over total; ``both``: the joint
verdicts' mismatch + error.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from eagledata.tokens.checks import PROMPT_CODES, PROMPT_VERDICTS, REASONS, VERDICTS, convention_for
from eagledata.tokens.shards import read_shards
from eagledata.errors import StageError
from eagledata.io import atomic_write_text

SCHEMA_VERSION = 2
BAD_COUNTS = ("completion", "both")
_COLUMNS = ["id", "provider", "verdict", "completion_verdict", "prompt_verdict", "prompt_variant", "reasons",
            "train", "completion_diff", "prompt_diff"]


class ValidationFailed(StageError):
    """The gate failed; ``verdict`` says by how much, ``summary_path`` where the summary was written."""

    def __init__(self, verdict: str, summary_path: str | Path):
        super().__init__(f"{verdict}; see {summary_path}")
        self.verdict, self.summary_path = verdict, summary_path


def _variant_label(rendering: dict[str, Any]) -> str | None:
    """The provider's learned rendering variant: one name, or one per prompt group
    (``offset-1 without tools``) when no single variant explains all its prompts."""
    if rendering.get("variant"):
        return rendering["variant"]
    groups = [f"{g['variant']} {name.replace('_', ' ')}" for name, g in (rendering.get("groups") or {}).items()
              if g.get("variant")]
    return "; ".join(groups) or None


def _share(n: int, total: int) -> float:
    return round(n / total, 4) if total else 0.0


def _new_provider() -> dict[str, Any]:
    return {"total": 0, **{k: 0 for k in VERDICTS}, "completion": Counter({k: 0 for k in VERDICTS}),
            "prompt": Counter({k: 0 for k in PROMPT_VERDICTS}), "variants": Counter(), "admitted": 0,
            "cdiff": Counter(), "pdiff": Counter()}


def _count_row(p: dict[str, Any], row: dict[str, Any]) -> None:
    p["total"] += 1
    p[row["verdict"]] += 1
    p["completion"][row["completion_verdict"]] += 1
    p["prompt"][row["prompt_verdict"]] += 1
    p["admitted"] += bool(row["train"])
    if row["prompt_variant"]:
        p["variants"][row["prompt_variant"]] += 1
    if row["completion_diff"] is not None:
        p["cdiff"][str(row["completion_diff"])] += 1
    if row["prompt_diff"] is not None:
        p["pdiff"][str(row["prompt_diff"])] += 1


def _finish_provider(p: dict[str, Any], learned: dict[str, Any]) -> dict[str, Any]:
    total, c, pr = p["total"], p.pop("completion"), p.pop("prompt")
    verified = c["exact"] + c["repaired"]
    variants = p.pop("variants")
    rendering = learned.get("prompt_rendering") or {}
    return {
        **{k: p[k] for k in ("total", *VERDICTS)}, "exact_share": _share(p["exact"], total),
        "completion": dict(c), "completion_verified": verified, "completion_verified_share": _share(verified, total),
        "prompt": dict(pr), "prompt_exact_share": _share(pr["exact"], total),
        "prompt_variant": _variant_label(rendering),
        "prompt_variant_samples": {k: n for k, n in sorted(variants.items()) if k},
        "prompt_rendering": rendering, "reasoning_count": learned.get("reasoning_count") or {"checksum": True, "samples": 0},
        "admitted": p["admitted"], "admitted_share": _share(p["admitted"], total),
        "convention": standing_convention(learned),
        "convention_by_finish": {f: g["convention"] for f, g in sorted((learned.get("by_finish") or {}).items())},
        "convention_support": learned.get("support", {}),
        "transformations_seen": learned.get("transformations_seen", {}),
        "completion_diff": dict(sorted(p["cdiff"].items(), key=lambda kv: int(kv[0]))),
        "prompt_diff": dict(sorted(p["pdiff"].items(), key=lambda kv: int(kv[0]))),
    }


def standing_convention(learned: dict[str, Any]) -> str:
    """The convention a provider's samples are judged under, as the summary shows it: the learned one,
    or ``unknown`` where a sample that voted for it would be judged under none (its only support is
    that sample: see :func:`~eagledata.tokens.checks.convention_for`)."""
    convention = learned.get("convention", "unknown")
    if convention == "unknown" or convention_for({"p": learned}, "p", None, own_vote=convention) == "unknown":
        return "unknown"
    return convention


def _top_reason(report: dict[str, Any]) -> str:
    """The most frequent reason of the samples the gate counts as bad, for the failure message."""
    completion_only = report.get("bad_counts") == "completion"
    bad = {c: r for c, r in report["reasons"].items()
           if r["severity"] in ("block", "error") and not (completion_only and c in PROMPT_CODES)}
    if not bad:
        return ""
    code, r = max(bad.items(), key=lambda kv: kv[1]["count"])
    return f"; most often {code} (x{r['count']}): {r['message']}"


def summarize(tokens_dir: str | Path, max_bad_fraction: float, bad_counts: str = "completion") -> dict[str, Any]:
    if bad_counts not in BAD_COUNTS:
        raise ValueError(f"validation.bad_counts must be one of {BAD_COUNTS}, got {bad_counts!r}")
    manifest = json.loads((Path(tokens_dir) / "manifest.json").read_text(encoding="utf-8"))
    df = read_shards(tokens_dir, columns=_COLUMNS)
    providers: dict[str, dict[str, Any]] = defaultdict(_new_provider)
    reasons: dict[str, dict[str, Any]] = {}
    excluded: list[str] = []
    for row in df.iter_rows(named=True):
        _count_row(providers[row["provider"]], row)
        for code in row["reasons"]:
            r = reasons.setdefault(code, {"severity": REASONS[code][0], "message": REASONS[code][1], "count": 0, "ids": []})
            r["count"] += 1
            r["ids"].append(row["id"])
        if not row["train"]:
            excluded.append(row["id"])
    total = df.height
    learned = manifest.get("conventions", {})
    rows = {prov: _finish_provider(p, learned.get(prov, {})) for prov, p in sorted(providers.items())}
    counts = _counts(rows, total, len(excluded), df)
    if bad_counts == "completion":
        bad = counts["completion"]["mismatch"] + counts["completion"]["error"]
    else:
        bad = counts["mismatch"] + counts["error"]
    bad_fraction = bad / total if total else 0.0
    return {
        "schema": SCHEMA_VERSION,
        "dataset": manifest.get("dataset"),
        "tokenizer_fingerprint": manifest.get("tokenizer_fingerprint"),
        "policy": manifest.get("policy"),
        "policy_sets": manifest.get("policy_sets"),
        "passed": bad_fraction <= max_bad_fraction,
        "bad_fraction": round(bad_fraction, 6),
        "max_bad_fraction": max_bad_fraction,
        "bad_counts": bad_counts,
        "counts": counts,
        "providers": rows,
        "reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1]["count"])),
        "excluded_ids": excluded,
    }


def _counts(rows: dict[str, dict[str, Any]], total: int, n_excluded: int, df) -> dict[str, Any]:
    joint = {k: sum(p[k] for p in rows.values()) for k in VERDICTS}
    completion = {k: sum(p["completion"].get(k, 0) for p in rows.values()) for k in VERDICTS}
    prompt = {k: sum(p["prompt"].get(k, 0) for p in rows.values()) for k in PROMPT_VERDICTS}
    admitted = {v: int(df.filter(df["train"] & (df["prompt_verdict"] == v)).height) if total else 0
                for v in ("differs", "unproven")}
    return {"total": total, **joint, "excluded": n_excluded, "included": total - n_excluded,
            "completion": completion, "prompt": prompt, "admitted_with_prompt_differs": admitted["differs"],
            "admitted_with_prompt_unproven": admitted["unproven"]}


#: Fewest billed prompts, all differing, before :func:`prompt_warnings` blames our rendering.
TEMPLATE_SUSPECT_MIN = 3


def prompt_warnings(report: dict[str, Any]) -> list[str]:
    """Warnings about the prompt side that the gate does not count (``bad_counts: completion``): no
    billed prompt of any provider has our rendering's count and no provider's rendering variant
    explains it (at least :data:`TEMPLATE_SUSPECT_MIN` of them). A provider rendering its own way is
    reported per provider; every provider differing at once points at our chat template or tokenizer
    (a wrong ``models.NAME.tokenizer``, ``chat_template`` or ``family``), and under the default policy
    every such sample is admitted with prompt ids the model never saw."""
    pc = report["counts"].get("prompt", {})
    billed = pc.get("exact", 0) + pc.get("differs", 0) + pc.get("unproven", 0)
    explained = any(p.get("prompt_variant") for p in report["providers"].values())
    if billed < TEMPLATE_SUSPECT_MIN or pc.get("differs", 0) != billed or explained:
        return []
    return [f"warning: none of the {billed} billed prompts has our rendering's token count, over every provider, and "
            "no provider rendering variant explains it: check the model's tokenizer, chat_template and family "
            f"(models.NAME in the config); {report['counts'].get('admitted_with_prompt_differs', 0)} sample(s) are "
            "admitted with these prompt ids (policy " + str(report.get("policy")) + ")"]


def render_summary(report: dict[str, Any]) -> str:
    c = report["counts"]
    cc, pc = c.get("completion", {}), c.get("prompt", {})
    lines = [
        f"dataset {report['dataset']}: {c['total']} responses -> {c['exact']} exact on both sides, {c['repaired']} repaired, "
        f"{c['mismatch']} mismatch, {c['error']} error; {c['included']} included, {c['excluded']} excluded "
        f"(policy {report['policy']})",
        f"completions: {cc.get('exact', 0)} exact, {cc.get('repaired', 0)} repaired, {cc.get('mismatch', 0)} mismatch, "
        f"{cc.get('error', 0)} error; prompts: {pc.get('exact', 0)} exact, {pc.get('differs', 0)} differ, "
        f"{pc.get('unproven', 0)} unproven (tool key order), {pc.get('unbilled', 0)} unbilled, "
        f"{pc.get('error', 0)} unrenderable",
        f"bad fraction ({report.get('bad_counts', 'both')}) {report['bad_fraction']:.4f} (limit {report['max_bad_fraction']}): "
        + ("PASSED" if report["passed"] else "FAILED"),
        *prompt_warnings(report),
        "",
        f"{'provider':<16}{'total':>7}{'c.exact':>8}{'c.rep':>7}{'c.bad':>7}{'p.exact':>8}{'admit':>7}  convention   "
        "completion diff (ours-billed: n); prompt variant; reasoning count",
    ]
    for name, p in report["providers"].items():
        pcomp = p.get("completion", {})
        diffs = ", ".join(f"{d}: {n}" for d, n in p["completion_diff"].items())
        by_finish = p.get("convention_by_finish", {})
        if len(set(by_finish.values())) > 1:
            diffs += "  [" + ", ".join(f"{f}: {c}" for f, c in by_finish.items()) + "]"
        extra = [f"prompt variant {p['prompt_variant']}"] if p.get("prompt_variant") else []
        if p.get("prompt", {}).get("unproven"):
            extra.append(f"{p['prompt']['unproven']} prompts' tool key order unproven (not shown to sort keys)")
        rc = p.get("reasoning_count") or {}
        if rc.get("checksum") is False:
            extra.append(f"reasoning count not a checksum (spread {rc.get('spread')} over {rc.get('samples')})")
        lines.append(f"{name:<16}{p['total']:>7}{pcomp.get('exact', 0):>8}{pcomp.get('repaired', 0):>7}"
                     f"{pcomp.get('mismatch', 0) + pcomp.get('error', 0):>7}{p.get('prompt', {}).get('exact', 0):>8}"
                     f"{p.get('admitted', 0):>7}  {p['convention']:<12} {diffs}" + ("; " + "; ".join(extra) if extra else ""))
    if report["reasons"]:
        lines += ["", "reasons:"]
        for code, r in report["reasons"].items():
            ids = ", ".join(r["ids"][:5]) + (" ..." if len(r["ids"]) > 5 else "")
            lines.append(f"  {code} [{r['severity']}] x{r['count']}: {r['message']} (e.g. {ids})")
    return "\n".join(lines) + "\n"


def write_validation(tokens_dir: str | Path, json_path: str | Path, summary_path: str | Path,
                     max_bad_fraction: float, bad_counts: str = "completion") -> dict[str, Any]:
    """Write both files atomically; raise :class:`ValidationFailed` (after writing) when the bad
    fraction exceeds the limit."""
    report = summarize(tokens_dir, max_bad_fraction, bad_counts)
    for path, text in ((Path(json_path), json.dumps(report, indent=2) + "\n"), (Path(summary_path), render_summary(report))):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    if not report["passed"]:
        what = "completions" if bad_counts == "completion" else "samples"
        raise ValidationFailed(
            f"dataset {report['dataset']}: {report['bad_fraction']:.2%} of {what} are mismatch/error, above the "
            f"limit {report['max_bad_fraction']:.2%} (validation.max_bad_fraction){_top_reason(report)}", summary_path)
    return report

"""HTML rendering: the report template (``data/templates/report.html.jinja``) and the table and chart
rows it is given (providers, reasons, count differences, lengths)."""

from __future__ import annotations

from collections import Counter
from importlib import resources
from typing import Any, Mapping

import polars as pl

from eagledata.report.charts import diff_bars, length_bars, summary_stats, svg_bars, verdict_stack
from eagledata.report.highlight import IMPLICATED
from eagledata.report.routing import provider_slug
from eagledata.tokens.checks import VERDICTS

def diff_counter(providers: Mapping[str, Mapping[str, Any]], key: str) -> Counter:
    c: Counter = Counter()
    for p in providers.values():
        c.update({int(d): int(n) for d, n in (p.get(key) or {}).items()})
    return c


def _diff_summary(dist: Mapping[str, int], top: int = 4) -> dict[str, Any]:
    """The ``top`` most frequent differences (shown in value order), the rest summarised."""
    pairs = [(int(d), int(n)) for d, n in dist.items()]
    shown = sorted(sorted(pairs, key=lambda x: (-x[1], abs(x[0])))[:top])
    rest = [x for x in pairs if x not in shown]
    values = [d for d, _ in pairs]
    return {"shown": shown, "more_values": len(rest), "more_samples": sum(n for _, n in rest),
            "range": (min(values), max(values)) if values else None,
            "all": ", ".join(f"{d:+d}: {n}" if d else f"0: {n}" for d, n in sorted(pairs))}


def provider_rows(providers: Mapping[str, Mapping[str, Any]], advice: Mapping[str, Any]) -> list[dict[str, Any]]:
    decisions = {r["name"]: r for r in advice["providers"]}
    rows = []
    for name, p in providers.items():
        total = p.get("total", 0)
        good = p.get("exact", 0) + p.get("repaired", 0)
        diffs = _diff_summary(p.get("completion_diff") or {})
        pdiffs = _diff_summary(p.get("prompt_diff") or {})
        support = p.get("convention_support") or {}
        by_finish = p.get("convention_by_finish") or {}
        verified = p.get("completion_verified")
        rows.append({
            "name": name, "slug": provider_slug(name), "total": total,
            **{v: p.get(v, 0) for v in VERDICTS},
            "exact_share": p.get("exact", 0) / total if total else 0.0,
            "good_share": good / total if total else 0.0,
            "convention": p.get("convention", "unknown"),
            "conventions": p.get("conventions") or {},
            "support": sorted(support.items(), key=lambda kv: -kv[1]),
            "by_finish": ", ".join(f"{f or 'none'} {c}" for f, c in by_finish.items()
                                   if c != p.get("convention")),
            "verified_share": (verified / total if total else 0.0) if verified is not None else None,
            "prompt_exact_share": p.get("prompt_exact_share"),
            "prompt_variant": p.get("prompt_variant"),
            "reasoning_note": _reasoning_note(p.get("reasoning_count")),
            "transformations": ", ".join(f"{k} {v}" for k, v in (p.get("transformations_seen") or {}).items()),
            "diffs": diffs, "pdiffs": pdiffs,
            "stack": verdict_stack(p, width=100, height=10, labels=False),
            "decision": decisions.get(name, {}).get("decision", ""),
        })
    rows.sort(key=lambda r: (-(r["verified_share"] or 0.0), -r["good_share"], -r["total"], r["name"]))
    return rows


def _reasoning_note(reasoning: Mapping[str, Any] | None) -> str:
    """'not a checksum (spread [-6, 9] over 40)' where a provider's reasoning count is learned unreliable."""
    if not reasoning:
        return ""
    entries = reasoning.values() if "checksum" not in reasoning else [reasoning]
    bad = [e for e in entries if isinstance(e, Mapping) and e.get("checksum") is False]
    if not bad:
        return ""
    spreads = [e.get("spread") or [0, 0] for e in bad]
    lo, hi = min(x[0] for x in spreads), max(x[1] for x in spreads)
    return f"reasoning count not a checksum (billed - ours in [{lo}, {hi}] over {sum(e.get('samples', 0) for e in bad)})"


def reason_rows(reasons: Mapping[str, Mapping[str, Any]], link) -> list[dict[str, Any]]:
    rows = []
    for code, r in reasons.items():
        ids = r.get("ids") or []
        pairs = [(ds, i) for ds, lst in ids.items() for i in lst] if isinstance(ids, dict) else [(None, i) for i in ids]
        rows.append({"code": code, "severity": r.get("severity"), "message": r.get("message"), "count": r.get("count"),
                     "implicated": IMPLICATED.get(code, (None, ""))[1],
                     "examples": [(i if ds is None else f"{ds}/{i}", link(ds, i)) for ds, i in pairs[:6]],
                     "more": max(0, len(pairs) - 6)})
    return rows


# --------------------------------------------------------------------------------------------------
# Building


def _env():
    from jinja2 import Environment, StrictUndefined

    env = Environment(autoescape=True, undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["pct"] = lambda x: f"{x:.1%}"
    env.filters["num"] = lambda x: f"{x:,}" if isinstance(x, int) else x
    env.filters["signed"] = lambda x: "–" if x is None else (f"{x:+d}" if x else "0")
    return env


def template():
    text = resources.files("eagledata").joinpath("data/templates/report.html.jinja").read_text(encoding="utf-8")
    return _env().from_string(text)


def length_charts(df: pl.DataFrame) -> list[dict[str, Any]]:
    out = []
    for col, label in (("prompt_len", "prompt tokens (ours)"), ("completion_len", "completion tokens (ours)")):
        vals = [v for v in df[col].to_list() if v] if df.height else []
        out.append({"title": label, "stats": summary_stats(vals),
                    "svg": svg_bars(length_bars(vals), x_title=label, width=600)})
    return out


def diff_charts(providers: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for key, label in (("completion_diff", "completion: ours - billed (provider's convention)"),
                       ("prompt_diff", "prompt: ours - billed")):
        c = diff_counter(providers, key)
        n = sum(c.values())
        out.append({"title": label, "n": n, "zero": c.get(0, 0),
                    "svg": svg_bars(diff_bars(c), x_title="tokens (ours - billed)", width=600)})
    return out

"""Routing advice: which providers to put in OpenRouter's ``provider.order`` and which to
``ignore``, from verified-completion and exact-prompt shares (rules in :mod:`eagledata.report.build`),
and the YAML block to paste under ``generation:``."""

from __future__ import annotations

import re
import textwrap
from typing import Any, Mapping

import yaml

def provider_slug(name: str) -> str:
    """Best-effort OpenRouter provider slug of a display name: lowercase, spaces dropped
    (``"Moonshot AI"`` -> ``"moonshotai"``). Check the result against OpenRouter's provider list."""
    return re.sub(r"\s+", "", name).lower()


def _advice_row(name: str, p: Mapping[str, Any]) -> dict[str, Any]:
    total = int(p.get("total", 0))
    verified = p.get("completion_verified")
    if verified is None:  # a version-1 validation.json: exact + repaired is what it proved
        verified = int(p.get("exact", 0)) + int(p.get("repaired", 0))
    prompt = p.get("prompt")
    prompt_exact = int(prompt.get("exact", 0)) if isinstance(prompt, Mapping) else None
    return {"name": name, "slug": provider_slug(name) if name else "", "total": total,
            "verified": int(verified), "completion_verified_share": round(int(verified) / total, 4) if total else 0.0,
            "prompt_exact": prompt_exact,
            "prompt_exact_share": round(prompt_exact / total, 4) if total and prompt_exact is not None else None,
            "prompt_variant": p.get("prompt_variant"), "decision": "", "why": ""}


def _decide(r: dict[str, Any], min_samples: int, threshold: float) -> None:
    share = f"{r['verified']}/{r['total']} completions verified ({r['completion_verified_share']:.0%})"
    prompt = ("" if r["prompt_exact_share"] is None else f", prompts exact {r['prompt_exact_share']:.0%}"
              + (f" (variant {r['prompt_variant']})" if r.get("prompt_variant") else ""))
    if not r["name"] or r["name"] == "unknown":
        r["decision"], r["why"] = "not_routable", "no provider name in the responses"
    elif r["total"] < min_samples:
        r["decision"], r["why"] = "too_few_samples", f"{r['total']} samples, fewer than {min_samples}"
    elif not r["verified"]:
        r["decision"], r["why"] = "no_verified_completion", f"{share}: never advised"
    elif r["completion_verified_share"] >= threshold:
        r["decision"], r["why"] = "order", share + prompt
    else:
        r["decision"], r["why"] = "ignore", f"{share}, below {threshold:.0%}" + prompt


def routing_advice(providers: Mapping[str, Mapping[str, Any]], min_samples: int = 5,
                   ignore_below: float = 0.5) -> dict[str, Any]:
    """A ``provider: {order, ignore}`` recommendation from both verdicts (see module doc): ranked by
    completion-verified share, then prompt-exact share; a provider without one verified completion
    is never in ``order``; each row says why."""
    rows = [_advice_row(name, p) for name, p in providers.items()]
    rows.sort(key=lambda r: (-r["completion_verified_share"], -(r["prompt_exact_share"] or 0.0), -r["total"], r["name"]))
    for r in rows:
        _decide(r, min_samples, ignore_below)
    notes = []
    decided = [r for r in rows if r["decision"] in ("order", "ignore", "no_verified_completion")]
    if not any(r["decision"] == "order" for r in rows) and any(r["decision"] == "ignore" for r in rows):
        # ignoring every provider would fail every request: keep those with any verified completion
        for r in rows:
            if r["decision"] == "ignore":
                r["decision"], r["why"] = "order", r["why"] + "; kept: every provider is below the threshold"
        notes.append(f"every provider with at least {min_samples} samples is below {ignore_below:.0%} verified "
                     "completions; those with at least one are kept in order: read the reasons first")
    order = [r["slug"] for r in rows if r["decision"] == "order"]
    ignore = [r["slug"] for r in rows if r["decision"] in ("ignore", "no_verified_completion")] if order else []
    if not order and any(r["decision"] == "no_verified_completion" for r in rows):
        notes.append("no provider has a verified completion: none is advised, none ignored (that would fail every "
                     "request); read the reasons first")
    if not decided:
        notes.append(f"no provider has {min_samples} or more samples: no advice")
    return {"min_samples": min_samples, "ignore_below": ignore_below, "order": order, "ignore": ignore,
            "providers": rows, "notes": notes,
            "rule": "rank by completion-verified share, then prompt-exact share; order: >= min_samples samples, "
                    "verified share >= ignore_below and at least one verified completion",
            "slug_rule": "the provider's display name, lowercased, spaces dropped"}


def routing_advice_yaml(advice: Mapping[str, Any], source: str = "") -> str:
    """The advice as YAML: a commented ``provider:`` block to paste under ``generation:``."""
    lines = ["# Routing advice from the eagledata report" + (f" ({source})" if source else "") + ".",
             "# Paste the provider block under `generation:` (or a dataset's `generation:`) of the next run's",
             "# config, indented by two spaces. Slugs are a best effort (display name lowercased, spaces",
             "# dropped): check them against OpenRouter's provider list.",
             f"# order: >= {advice['min_samples']} samples and a verified-completion share >= {advice['ignore_below']:.0%},",
             "# best first (then by prompt-exact share); ignore: below that share or no verified completion.",
             "# Providers with fewer samples are left to OpenRouter's fallbacks."]
    for r in advice["providers"]:
        lines.append(f"#   {r['slug'] or '(none)':<20} {r['name']!r}: {r['decision']}: {r['why']}")
    for n in advice.get("notes") or []:
        lines += textwrap.wrap(f"NOTE: {n}", 96, initial_indent="# ", subsequent_indent="#   ")
    block = {"provider": {"order": list(advice["order"]), "ignore": list(advice["ignore"])}}
    return "\n".join(lines) + "\n" + yaml.safe_dump(block, sort_keys=False, default_flow_style=False)

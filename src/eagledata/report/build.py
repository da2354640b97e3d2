"""Reports a person reads: self-contained HTML (inline CSS and SVG, no JavaScript, no network) per
dataset and for the whole run, a run-wide ``validation.json`` and routing advice.

Inputs are what the pipeline already wrote: each dataset's ``validation.json`` (see
:mod:`eagledata.validate.summary`) and token shards (see :mod:`eagledata.tokens.shards`). The per-dataset report
also needs the dataset's tokenizer, to decode each completion token on its own.

Outputs (paths chosen by the caller; the workflow uses these)::

    {results}/{dataset}/report.html   one dataset: totals, providers, count differences, lengths,
                                      reasons, the worst samples token by token, routing advice
    {results}/report.html             the whole run: the same, summed over datasets, with links
    {results}/validation.json         the whole run, summed (schema below)
    {results}/routing_advice.yaml     a ``provider:`` block to paste under ``generation:``

Run-wide ``validation.json`` (schema 2; counts are sums of the datasets' counts; the per-side
fields are those of :mod:`eagledata.validate.summary`)::

    {"schema": 2, "scope": "run", "passed", "bad_fraction",
     "counts": {"total", "exact", "repaired", "mismatch", "error", "excluded", "included",
                "completion": {VERDICT: N}, "prompt": {VERDICT: N}},
     "datasets": {NAME: {"counts", "passed", "bad_fraction", "max_bad_fraction", "policy",
                         "tokenizer_fingerprint"}},
     "providers": {NAME: {"total", "exact", "repaired", "mismatch", "error", "exact_share",
                          "good_share", "completion": {..}, "completion_verified", "completion_verified_share",
                          "prompt": {..}, "prompt_exact_share", "prompt_variant" (one, "mixed" or null),
                          "prompt_variants": {DATASET: variant}, "reasoning_count": {DATASET: {...}}, "admitted",
                          "convention" (one value, or "mixed"), "conventions": {DATASET: convention},
                          "convention_support", "convention_by_finish", "transformations_seen",
                          "completion_diff": {DIFF: N}, "prompt_diff": {DIFF: N}, "datasets": [...]}},
     "reasons": {CODE: {"severity", "message", "count", "ids": {DATASET: [...]}}},
     "excluded_ids": {DATASET: [...]},
     "routing_advice": {...}}

Worst samples: mismatch and error first, then repaired (exact samples are never listed), each tier
by largest ``|completion_diff|`` then ``|prompt_diff|``; while the limit allows, every reason code
and every provider that occurs gets at least one example. Each completion token is decoded on its own (a run of tokens
that only together form a UTF-8 character is shown as one unit); token boundaries are alternating
shades, special tokens are labelled chips, and the tokens a sample's reasons implicate are outlined
as described by :data:`IMPLICATED`.

Routing advice (:func:`routing_advice`): providers ranked by the share of verified completions
(completion verdict exact or repaired), then by the share of exact prompts. With at least
``min_samples`` samples, a provider whose verified share is at least ``ignore_below`` goes into
``order``; one below it, or with no verified completion at all, into ``ignore``; providers with fewer
samples are left out of both (OpenRouter may still fall back to them). A provider without a single
verified completion is never in ``order``. If no provider qualifies for ``order``, those with any
verified completion are kept in it, and nothing is ignored when none has one (a config ignoring every
provider fails every request); the advice says so. Every row says why. Provider names are turned into
OpenRouter slugs by lowercasing and dropping spaces (``"Moonshot AI"`` -> ``moonshotai``): a best
effort, check them against OpenRouter's provider list.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import textwrap
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import polars as pl
import yaml
from markupsafe import Markup

from eagledata import __version__
from eagledata.tokens.checks import REASONS, VERDICTS
from eagledata.tokens.reconstruct import TEXT_KINDS
from eagledata.tokens.shards import read_shards

SCHEMA_VERSION = 2
COUNT_KEYS = ("total", "exact", "repaired", "mismatch", "error", "excluded", "included")

#: Settings of the reports (config key ``report``; every key optional).
REPORT_DEFAULTS: dict[str, Any] = {
    "worst_samples": 20,       # samples shown token by token in a dataset report
    "max_tokens_shown": 600,   # longer completions are elided around the implicated tokens
    "prompt_tail_tokens": 80,  # prompt tokens shown (collapsed) under each worst sample
    "min_samples": 5,          # routing advice: fewer samples are not evidence enough
    "ignore_below": 0.5,       # routing advice: exact+repaired share under which a provider is ignored
}

_LIGHT_COLUMNS = ["id", "provider", "finish_reason", "verdict", "reasons", "completion_diff", "prompt_diff",
                  "prompt_len", "completion_len", "reasoning_len"]
_VERDICT_COLOURS = {"exact": "#2e9d57", "repaired": "#3b7dd8", "mismatch": "#e0892b", "error": "#c93c3c"}


def report_settings(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``REPORT_DEFAULTS`` overlaid with the config's ``report`` block (unknown keys are an error)."""
    own = dict((config or {}).get("report") or {})
    unknown = sorted(set(own) - set(REPORT_DEFAULTS))
    if unknown:
        raise ValueError(f"config: report: unknown key(s) {unknown}; known: {sorted(REPORT_DEFAULTS)}")
    return {**REPORT_DEFAULTS, **own}


# --------------------------------------------------------------------------------------------------
# Run-wide validation.json


def aggregate_validations(validations: Mapping[str, Mapping[str, Any]], min_samples: int = 5,
                          ignore_below: float = 0.5) -> dict[str, Any]:
    """Sum datasets' ``validation.json`` (name -> parsed file) into the run-wide document."""
    counts = {k: 0 for k in COUNT_KEYS}
    providers: dict[str, dict[str, Any]] = {}
    reasons: dict[str, dict[str, Any]] = {}
    datasets: dict[str, Any] = {}
    excluded: dict[str, list[str]] = {}
    for name, v in validations.items():
        c = v["counts"]
        for k in COUNT_KEYS:
            counts[k] += int(c.get(k, 0))
        for side in ("completion", "prompt"):
            for k, n in (c.get(side) or {}).items():
                counts.setdefault(side, {}).setdefault(k, 0)
                counts[side][k] += int(n)
        datasets[name] = {"counts": dict(c), "passed": v.get("passed"), "bad_fraction": v.get("bad_fraction"),
                          "max_bad_fraction": v.get("max_bad_fraction"), "policy": v.get("policy"),
                          "tokenizer_fingerprint": v.get("tokenizer_fingerprint")}
        excluded[name] = list(v.get("excluded_ids") or [])
        for prov, p in (v.get("providers") or {}).items():
            agg = providers.setdefault(prov, {"total": 0, **{k: 0 for k in VERDICTS}, "completion_verified": 0,
                                              "conventions": {}, "convention_support": Counter(),
                                              "convention_by_finish": {}, "transformations_seen": Counter(),
                                              "completion_diff": Counter(), "prompt_diff": Counter(), "datasets": [],
                                              "completion": Counter(), "prompt": Counter(), "admitted": 0,
                                              "prompt_variants": {}, "reasoning_count": {}})
            for k in ("total", *VERDICTS):
                agg[k] += int(p.get(k, 0))
            _add_sides(agg, name, p)
            # completion_verified: every completion-side check passes (older validation.json: exact + repaired)
            agg["completion_verified"] += int(p.get("completion_verified", int(p.get("exact", 0)) + int(p.get("repaired", 0))))
            agg["conventions"][name] = p.get("convention", "unknown")
            agg["convention_support"].update(p.get("convention_support") or {})
            for finish, conv in (p.get("convention_by_finish") or {}).items():
                agg["convention_by_finish"].setdefault(finish, set()).add(conv)
            agg["transformations_seen"].update(p.get("transformations_seen") or {})
            agg["completion_diff"].update({int(d): n for d, n in (p.get("completion_diff") or {}).items()})
            agg["prompt_diff"].update({int(d): n for d, n in (p.get("prompt_diff") or {}).items()})
            agg["datasets"].append(name)
        for code, r in (v.get("reasons") or {}).items():
            agg = reasons.setdefault(code, {"severity": r.get("severity"), "message": r.get("message"), "count": 0, "ids": {}})
            agg["count"] += int(r.get("count", 0))
            agg["ids"][name] = list(r.get("ids") or [])
    for p in providers.values():
        p["completion"], p["prompt"] = dict(p["completion"]), dict(p["prompt"])
        p["prompt_exact_share"] = round(p["prompt"].get("exact", 0) / p["total"], 4) if p["total"] else 0.0
        variants = {v for v in p["prompt_variants"].values() if v}
        p["prompt_variant"] = variants.pop() if len(variants) == 1 else ("mixed" if variants else None)
        p["exact_share"] = round(p["exact"] / p["total"], 4) if p["total"] else 0.0
        p["good_share"] = round((p["exact"] + p["repaired"]) / p["total"], 4) if p["total"] else 0.0
        p["completion_verified_share"] = round(p["completion_verified"] / p["total"], 4) if p["total"] else 0.0
        p["transformations_seen"] = dict(sorted(p["transformations_seen"].items()))
        p["convention_support"] = dict(sorted(p["convention_support"].items()))
        p["convention_by_finish"] = {f: (cs.pop() if len(cs) == 1 else "mixed")
                                     for f, cs in sorted(p["convention_by_finish"].items())}
        convs = set(p["conventions"].values())
        p["convention"] = convs.pop() if len(convs) == 1 else "mixed"
        p["completion_diff"] = {str(d): n for d, n in sorted(p["completion_diff"].items())}
        p["prompt_diff"] = {str(d): n for d, n in sorted(p["prompt_diff"].items())}
    bad = sum(_dataset_bad(v) for v in validations.values())
    providers = dict(sorted(providers.items()))
    return {
        "schema": SCHEMA_VERSION,
        "scope": "run",
        "passed": all(d["passed"] for d in datasets.values()) if datasets else True,
        "bad_fraction": round(bad / counts["total"], 6) if counts["total"] else 0.0,
        "counts": counts,
        "datasets": datasets,
        "providers": {k: _order_provider_keys(p) for k, p in providers.items()},
        "reasons": dict(sorted(reasons.items(), key=lambda kv: (-kv[1]["count"], kv[0]))),
        "excluded_ids": excluded,
        "routing_advice": routing_advice(providers, min_samples, ignore_below),
    }


def _dataset_bad(v: Mapping[str, Any]) -> int:
    """The dataset's bad samples as its gate counted them (``bad_counts``; version 1: joint verdicts)."""
    c = v["counts"]
    side = c.get("completion") if v.get("bad_counts") == "completion" else None
    src = side if side is not None else c
    return int(src.get("mismatch", 0)) + int(src.get("error", 0))


def _add_sides(agg: dict[str, Any], dataset: str, p: Mapping[str, Any]) -> None:
    """Sum one dataset's per-side verdicts, admissions and learned prompt/reasoning facts."""
    agg["completion"].update(p.get("completion") or {})
    agg["prompt"].update(p.get("prompt") or {})
    agg["admitted"] += int(p.get("admitted", 0))
    agg["prompt_variants"][dataset] = p.get("prompt_variant")
    if p.get("reasoning_count"):
        agg["reasoning_count"][dataset] = p["reasoning_count"]


def _order_provider_keys(p: dict[str, Any]) -> dict[str, Any]:
    keys = ["total", *VERDICTS, "exact_share", "good_share", "completion", "completion_verified", "completion_verified_share",
            "prompt", "prompt_exact_share", "prompt_variant", "prompt_variants", "reasoning_count", "admitted",
            "convention", "conventions", "convention_support", "convention_by_finish", "transformations_seen",
            "completion_diff", "prompt_diff", "datasets"]
    return {k: p[k] for k in keys if k in p}


# --------------------------------------------------------------------------------------------------
# Routing advice


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


# --------------------------------------------------------------------------------------------------
# Which tokens a reason implicates

#: reason code -> (highlight level, which completion tokens it marks). Levels: ``offending`` (the
#: tokens the reason is about), ``suspect`` (a count differs: the places where providers are known
#: to deviate), ``repair`` (tokens a known repair rebuilt), ``None`` (no completion token: the note
#: says why).
IMPLICATED: dict[str, tuple[str | None, str]] = {
    "truncated": ("offending", "the last token: generation was cut here at max_tokens, no end-of-turn follows"),
    "error_mid_stream": ("offending", "the last token that arrived before the stream broke"),
    "finish_error": ("offending", "the last token that arrived before generation failed"),
    "lossy_text": ("offending", "tokens whose decoded text contains U+FFFD (bytes lost before we saw them)"),
    "end_of_turn_misplaced": ("offending", "every end-of-turn token (the last token if there is none)"),
    "special_in_text": ("offending", "special-token ids inside text segments (the segment if none is found)"),
    "decode_mismatch": ("offending", "the text segments whose ids do not decode back to the provider's text"),
    "think_close_count": ("offending", "every </think> (none: the completion has no </think>)"),
    "tool_section_malformed": ("offending", "the tool-section special tokens"),
    "tool_call_malformed": ("offending", "the tool-call ids (a call has no function name)"),
    "text_after_tool_section": ("suspect", "the end of the tool section: text returned after it is not in the ids"),
    "reasoning_missing": ("suspect", "</think>: no reasoning precedes it"),
    "completion_count_mismatch": ("suspect", "boundary tokens where providers are known to deviate: the first token "
                                             "of reasoning and of content (stripped or added whitespace), the first and "
                                             "last token of tool arguments (re-serialized JSON), tool-call ids; and the "
                                             "end-of-turn when the difference is 1 (count convention)"),
    "reasoning_count_mismatch": ("suspect", "the first and last reasoning tokens and </think>"),
    "tool_id_rebuilt": ("repair", "the rebuilt tool-call id (the provider's own id is listed above the text)"),
    "tool_markup_in_content": ("repair", "the tool-call section, rebuilt from markup found in content"),
    "tool_markup_in_reasoning": ("repair", "the tool-call section, rebuilt from markup found in reasoning"),
    "reasoning_in_content": ("repair", "the reasoning split out of content, and its </think>"),
    "whitespace_restored": ("repair", "the first token of each reasoning/content segment whose stripped leading "
                                      "whitespace was restored"),
    "tool_arguments_respaced": ("repair", "the tool arguments, re-spaced as the model writes them"),
    "repair_ambiguous": ("suspect", "where the competing repair candidates differ: the first token of reasoning and "
                                    "of content, the tool arguments"),
    "whitespace_ambiguous": ("suspect", "the first token of reasoning and of content (a stripped space may or may not "
                                        "belong there)"),
    "tool_id_index_unexpected": ("suspect", "the tool-call ids (a native id's index differs from the conversation count)"),
    "prompt_count_mismatch": (None, "no completion token: the difference is in the prompt"),
    "prompt_unrenderable": (None, "no completion token: the prompt could not be rendered"),
    "http_error": (None, "no completion token: the provider answered with an error"),
    "error_in_body": (None, "no completion token: the provider answered with an error"),
    "malformed_body": (None, "no completion token: the body could not be parsed"),
    "empty_response": (None, "no completion token: the response is empty"),
    "completion_count_missing": (None, "no single token: the provider reported no completion count"),
    "unknown_count_convention": (None, "no single token: the provider's counts follow neither known convention"),
    "reasoning_unexpected": (None, "no token: the reasoning text returned without thinking is not in the ids"),
    "reasoning_count_unreported": (None, "no token: the provider reports 0 reasoning tokens"),
    "reasoning_count_unchecked": (None, "no token: this provider's reasoning count is not a checksum; the total was checked"),
    "ground_truth_ids": (None, "no token: the serving engine returned these ids itself"),
    "text_path_differs": (None, "no token marked: the engine's ids are used; the text path would have differed"),
    "prompt_path_differs": (None, "no token: the engine's prompt ids differ from our template rendering"),
}

_LEVEL_RANK = {"offending": 3, "suspect": 2, "repair": 1}
_TOOL_SECTION_KINDS = ("tool_section_begin", "tool_call_begin", "tool_argument_begin", "tool_call_end", "tool_section_end")


@dataclass
class Implication:
    code: str
    level: str | None
    positions: list[int]
    note: str


def implicated_tokens(code: str, ids: Sequence[int], segments: Sequence[Mapping[str, Any]], *,
                      unit_texts: Mapping[int, str] | None = None, is_special=None, decode=None,
                      completion_diff: int | None = None, prompt_diff: int | None = None,
                      tool_id_rewrites: Sequence[Mapping[str, Any]] = (),
                      repair: Mapping[str, Any] | None = None) -> Implication:
    """Completion positions implicated by one reason code (see :data:`IMPLICATED`).

    ``unit_texts``: position -> decoded text of the display unit holding it (for ``lossy_text``);
    ``is_special`` / ``decode``: the tokenizer's (for ``special_in_text`` / ``decode_mismatch``);
    ``repair``: the token row's repair evidence (``{"status", "transforms", "candidates"}``)."""
    level, note = IMPLICATED.get(code, (None, "no completion token is implicated"))
    n = len(ids)
    by_kind: dict[str, list[Mapping[str, Any]]] = {}
    for s in segments:
        by_kind.setdefault(s["kind"], []).append(s)

    def span(kinds: Iterable[str], pred=lambda s: True) -> list[int]:
        return [i for k in kinds for s in by_kind.get(k, []) if pred(s) for i in range(s["start"], s["end"])]

    pos: list[int] = []
    if code in ("truncated", "error_mid_stream", "finish_error"):
        pos = [n - 1] if n else []
    elif code == "lossy_text":
        pos = [i for i, t in (unit_texts or {}).items() if "\ufffd" in t]
    elif code == "end_of_turn_misplaced":
        pos = span(["end_of_turn"]) or ([n - 1] if n else [])
    elif code == "special_in_text":
        text_pos = span(TEXT_KINDS)
        pos = [i for i in text_pos if is_special is not None and is_special(ids[i])] or text_pos
    elif code == "decode_mismatch":
        pos = span(TEXT_KINDS, lambda s: decode is None or "text" not in s
                   or decode(list(ids[s["start"]:s["end"]])) != s["text"])
    elif code == "think_close_count":
        pos = span(["think_close"])
    elif code == "tool_section_malformed":
        pos = span(_TOOL_SECTION_KINDS)
    elif code in ("tool_call_malformed", "tool_id_index_unexpected"):
        pos = span(["tool_id"])
    elif code == "text_after_tool_section":
        pos = span(["tool_section_end"])
    elif code == "reasoning_missing":
        pos = span(["think_close"])
    elif code == "completion_count_mismatch":
        for s in by_kind.get("reasoning", []) + by_kind.get("content", []):
            pos.append(s["start"])
        for s in by_kind.get("tool_arguments", []):
            pos += [s["start"], s["end"] - 1]
        pos += span(["tool_id"])
        if completion_diff is not None and abs(completion_diff) == 1:
            pos += span(["end_of_turn"])
    elif code == "reasoning_count_mismatch":
        for s in by_kind.get("reasoning", []):
            pos += [s["start"], s["end"] - 1]
        pos += span(["think_close"])
    elif code == "tool_id_rebuilt":
        calls = {r.get("call") for r in tool_id_rewrites}
        pos = span(["tool_id"], lambda s: not calls or s.get("call") in calls)
    elif code in ("tool_markup_in_content", "tool_markup_in_reasoning"):
        spans = by_kind.get("tool_section_begin", []) + by_kind.get("tool_section_end", [])
        if spans:
            pos = list(range(min(s["start"] for s in spans), max(s["end"] for s in spans)))
    elif code == "reasoning_in_content":
        pos = span(["reasoning", "think_close"])
    elif code == "whitespace_restored":
        applied = " ".join((repair or {}).get("transforms") or [])
        kinds = [k for k in ("reasoning", "content") if f"whitespace_restored:{k}" in applied] or ["reasoning", "content"]
        pos = [s["start"] for k in kinds for s in by_kind.get(k, [])[:1]]
    elif code == "tool_arguments_respaced":
        pos = span(["tool_arguments"])
    elif code in ("repair_ambiguous", "whitespace_ambiguous"):
        pos = [s["start"] for k in ("reasoning", "content") for s in by_kind.get(k, [])[:1]]
        if code == "repair_ambiguous":
            pos += span(["tool_arguments"])
    elif code == "prompt_count_mismatch" and prompt_diff is not None:
        note = f"{note} (ours minus billed: {prompt_diff:+d})"
    pos = sorted({p for p in pos if 0 <= p < n})
    if level is not None and not pos:
        note = f"{note}; no such token in this completion"
    return Implication(code, level if pos else None, pos, note)


# --------------------------------------------------------------------------------------------------
# Token rendering


@dataclass
class Unit:
    """One displayed unit: ``ids[start:end]`` (one token, or a run forming one UTF-8 character)."""

    start: int
    end: int
    text: str
    special: str | None = None   # the special token's name
    raw: bool = False            # bytes that are not valid UTF-8 (shown escaped)


def token_units(ids: Sequence[int], tokenizer) -> list[Unit]:
    """Decode each token on its own; tokens that are only parts of a UTF-8 character are joined."""
    names = {i: n for n, i in tokenizer.special_names().items()}
    decode_bytes = getattr(tokenizer, "decode_bytes", None)

    def special(t: int) -> str | None:
        if t in names:
            return names[t]
        return f"<special {t}>" if tokenizer.is_special_id(t) else None

    def raw_bytes(t: int) -> bytes:
        return decode_bytes([t]) if decode_bytes else tokenizer.decode([t]).encode("utf-8")

    units: list[Unit] = []
    i, n = 0, len(ids)
    while i < n:
        name = special(ids[i])
        if name is not None:
            units.append(Unit(i, i + 1, name, special=name))
            i += 1
            continue
        buf, j = raw_bytes(ids[i]), i + 1
        text = _utf8(buf)
        while text is None and j < n and j - i < 8 and special(ids[j]) is None:
            buf += raw_bytes(ids[j])
            j += 1
            text = _utf8(buf)
        if text is None:
            b = raw_bytes(ids[i])
            units.append(Unit(i, i + 1, b.decode("utf-8", "backslashreplace"), raw=True))
            i += 1
        else:
            units.append(Unit(i, j, text))
            i = j
    return units


def _utf8(b: bytes) -> str | None:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return None


_CONTROL = {c: chr(0x2400 + c) for c in range(32) if c not in (9, 10)}


def _visible(text: str) -> str:
    out = html.escape(text, quote=True)
    out = out.translate(_CONTROL)
    return out.replace("\n", '<span class="nl">\u21b5</span>\n')


def render_tokens(ids: Sequence[int], units: Sequence[Unit], kinds: Sequence[str],
                  marks: Mapping[int, tuple[str, list[str]]] | None = None, max_tokens: int = 600,
                  head: int = 120, tail: int = 60, context: int = 30) -> Markup:
    """HTML of a token sequence: alternating shades at token boundaries, special tokens as chips,
    marked positions outlined by level; elided around the marks when longer than ``max_tokens``."""
    marks = marks or {}
    n = len(ids)
    keep: set[int] | None = None
    if n > max_tokens:
        keep = set(range(min(head, n))) | set(range(max(0, n - tail), n))
        for p in marks:
            keep.update(range(max(0, p - context), min(n, p + context + 1)))
    parts: list[str] = []
    skipped = 0
    for k, u in enumerate(units):
        if keep is not None and not any(p in keep for p in range(u.start, u.end)):
            skipped += u.end - u.start
            continue
        if skipped:
            parts.append(f'<span class="gap">\u2026 {skipped} tokens \u2026</span>')
            skipped = 0
        level, codes = None, []
        for p in range(u.start, u.end):
            if p in marks:
                lv, cs = marks[p]
                codes += [c for c in cs if c not in codes]
                if level is None or _LEVEL_RANK[lv] > _LEVEL_RANK[level]:
                    level = lv
        kind = kinds[u.start] if u.start < len(kinds) else ""
        cls = ["t", f"t{k % 2}", f"k-{kind}"]
        if u.special:
            cls.append("sp")
        if u.raw:
            cls.append("raw")
        if level:
            cls.append(f"m-{level}")
        ids_s = " ".join(str(t) for t in ids[u.start:u.end])
        where = f"#{u.start}" if u.end - u.start == 1 else f"#{u.start}\u2013{u.end - 1}"
        title = f"{where} id {ids_s} \u00b7 {kind}" + (f" \u00b7 {level}: {', '.join(codes)}" if level else "")
        parts.append(f'<span class="{" ".join(cls)}" title="{html.escape(title, quote=True)}">{_visible(u.text)}</span>')
    if skipped:
        parts.append(f'<span class="gap">\u2026 {skipped} tokens \u2026</span>')
    return Markup("".join(parts))


def position_kinds(n: int, segments: Sequence[Mapping[str, Any]], default: str = "") -> list[str]:
    kinds = [default] * n
    for s in segments:
        for i in range(max(0, s["start"]), min(n, s["end"])):
            kinds[i] = s["kind"]
    return kinds


# --------------------------------------------------------------------------------------------------
# Charts (inline SVG)


def _nice(x: float) -> float:
    """The smallest of 1, 2, 5 x 10^k (k >= 0) at least ``x``: whole-number steps and bin widths."""
    if x <= 1:
        return 1.0
    e = 10 ** math.floor(math.log10(x))
    for m in (1, 2, 5, 10):
        if x <= m * e:
            return m * e
    return 10 * e


def _fmt_int(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def svg_bars(bars: Sequence[tuple[str, int, str, str]], *, width: int = 600, height: int = 210,
             x_title: str = "", y_title: str = "samples") -> Markup:
    """Vertical bar chart. ``bars``: (x label, count, fill colour, tooltip)."""
    if not bars:
        return Markup('<p class="muted">no data</p>')
    left, right, top, bottom = 46, 10, 16, 56
    pw, ph = width - left - right, height - top - bottom
    ymax = max(c for _, c, _, _ in bars) or 1
    step = _nice(ymax / 4)
    ytop = step * math.ceil(ymax / step)
    n = len(bars)
    bw = min(pw / n, 56.0)
    left += (pw - bw * n) / 2  # few bars: centred, not stretched
    gap = min(3.0, bw * 0.15)
    label_every = max(1, math.ceil(max(len(b[0]) for b in bars) * 6.2 / bw)) if bw < 60 else 1
    stagger = label_every == 2  # two rows of labels instead of dropping every other one
    if stagger:
        label_every = 1
    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
           f'xmlns="http://www.w3.org/2000/svg">']
    gx0, gx1 = 46, width - right
    y = 0.0
    while y <= ytop + 1e-9:
        py = top + ph - ph * y / ytop
        out.append(f'<line x1="{gx0}" x2="{gx1}" y1="{py:.1f}" y2="{py:.1f}" class="grid"/>'
                   f'<text x="{gx0 - 6}" y="{py + 4:.1f}" class="ax" text-anchor="end">{_fmt_int(y)}</text>')
        y += step
    for i, (label, count, colour, tip) in enumerate(bars):
        x = left + i * bw + gap / 2
        h = ph * count / ytop
        out.append(f'<g><title>{html.escape(tip)}</title>'
                   f'<rect x="{x:.1f}" y="{top + ph - h:.1f}" width="{max(bw - gap, 1):.1f}" height="{h:.1f}" fill="{colour}"/>')
        if count and bw >= 14:
            out.append(f'<text x="{x + (bw - gap) / 2:.1f}" y="{top + ph - h - 3:.1f}" class="val" text-anchor="middle">{count}</text>')
        out.append("</g>")
        if i % label_every == 0:
            ly = top + ph + 14 + (12 if stagger and i % 2 else 0)
            out.append(f'<text x="{x + (bw - gap) / 2:.1f}" y="{ly}" class="ax" text-anchor="middle">{html.escape(label)}</text>')
    out.append(f'<line x1="{gx0}" x2="{gx1}" y1="{top + ph}" y2="{top + ph}" class="axis"/>')
    if x_title:
        out.append(f'<text x="{(gx0 + gx1) / 2:.1f}" y="{height - 6}" class="axt" text-anchor="middle">{html.escape(x_title)}</text>')
    if y_title:
        out.append(f'<text x="12" y="{top + ph / 2:.1f}" class="axt" text-anchor="middle" transform="rotate(-90 12 {top + ph / 2:.1f})">{html.escape(y_title)}</text>')
    out.append("</svg>")
    return Markup("".join(out))


def diff_bars(counts: Mapping[int, int]) -> list[tuple[str, int, str, str]]:
    """Bars of a distribution of count differences: one per value when they are few and close,
    else signed power-of-two bins (0, ±1, ±2, ±3..4, ±5..8, ...)."""
    counts = {int(k): int(v) for k, v in counts.items() if v}
    if not counts:
        return []
    lo, hi = min(min(counts), 0), max(max(counts), 0)
    ok, bad = _VERDICT_COLOURS["exact"], _VERDICT_COLOURS["mismatch"]
    total = sum(counts.values())
    if hi - lo <= 40:
        return [(f"{d:+d}" if d else "0", counts.get(d, 0), ok if d == 0 else bad,
                 f"diff {d:+d}: {counts.get(d, 0)} samples ({counts.get(d, 0) / total:.1%})") for d in range(lo, hi + 1)]

    def bin_of(d: int) -> tuple[int, int]:
        a = abs(d)
        if a <= 2:
            return (a, a)
        k = math.ceil(math.log2(a))
        return (2 ** (k - 1) + 1, 2 ** k)

    binned: Counter = Counter()
    for d, c in counts.items():
        a, b = bin_of(d)
        binned[(a, b) if d >= 0 else (-b, -a)] += c
    keys = sorted(binned)
    bars = []
    for a, b in keys:
        label = (f"{a:+d}" if a else "0") if a == b else f"{a:+d}..{b:+d}"
        bars.append((label, binned[(a, b)], ok if a == b == 0 else bad,
                     f"diff {label}: {binned[(a, b)]} samples ({binned[(a, b)] / total:.1%})"))
    return bars


def length_bars(values: Sequence[int], target_bins: int = 24, colour: str = "#5b6fa8") -> list[tuple[str, int, str, str]]:
    """Histogram bars of token lengths with 'nice' bin widths."""
    values = [int(v) for v in values if v is not None]
    if not values:
        return []
    lo, hi = min(values), max(values)
    width = max(1, int(_nice(max(hi - lo, 1) / target_bins)))
    start = (lo // width) * width
    nbins = (hi - start) // width + 1
    counts = Counter((v - start) // width for v in values)
    return [(_fmt_int(start + i * width), counts.get(i, 0), colour,
             f"{start + i * width}..{start + (i + 1) * width - 1} tokens: {counts.get(i, 0)} samples") for i in range(nbins)]


def svg_stacked(parts: Sequence[tuple[str, int, str]], *, width: int = 600, height: int = 26,
                labels: bool = True) -> Markup:
    """One horizontal bar split into (name, count, colour) parts."""
    total = sum(c for _, c, _ in parts)
    out = [f'<svg class="stack" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'preserveAspectRatio="none" xmlns="http://www.w3.org/2000/svg">']
    if not total:
        out.append(f'<rect x="0" y="0" width="{width}" height="{height}" fill="#e5e7eb"/></svg>')
        return Markup("".join(out))
    x = 0.0
    for name, count, colour in parts:
        if not count:
            continue
        w = width * count / total
        out.append(f'<g><title>{html.escape(name)}: {count} ({count / total:.1%})</title>'
                   f'<rect x="{x:.2f}" y="0" width="{w:.2f}" height="{height}" fill="{colour}"/>')
        text = f"{name} {count}"
        if labels and w > len(text) * 7 + 8:
            out.append(f'<text x="{x + 6:.2f}" y="{height / 2 + 4:.1f}" class="stk">{html.escape(text)}</text>')
        out.append("</g>")
        x += w
    out.append("</svg>")
    return Markup("".join(out))


def verdict_stack(c: Mapping[str, int], **kw) -> Markup:
    return svg_stacked([(v, int(c.get(v, 0)), _VERDICT_COLOURS[v]) for v in VERDICTS], **kw)


def _stats(values: Sequence[int]) -> dict[str, Any]:
    v = sorted(int(x) for x in values if x is not None)
    if not v:
        return {}
    q = lambda f: v[min(len(v) - 1, int(f * (len(v) - 1) + 0.5))]  # noqa: E731
    return {"n": len(v), "min": v[0], "median": q(0.5), "p90": q(0.9), "max": v[-1], "mean": sum(v) / len(v)}


# --------------------------------------------------------------------------------------------------
# Data


def anchor(sample_id: str) -> str:
    """HTML id of a sample's section (deterministic, so other reports can link to it)."""
    return "s-" + re.sub(r"[^A-Za-z0-9_-]", lambda m: f".{ord(m.group()):x}.", sample_id)


def _key(row: Mapping[str, Any]) -> tuple:
    tier = 0 if row["verdict"] in ("mismatch", "error") else 1
    cd, pd = row.get("completion_diff"), row.get("prompt_diff")
    return (tier, -(abs(cd) if cd is not None else -1), -abs(pd or 0), row["id"])


def select_worst(rows: Sequence[Mapping[str, Any]], n: int) -> list[str]:
    """Ids of up to ``n`` worst samples (see module doc): the worst example of each reason code
    first, then the worst of each provider, then by rank; returned in rank order."""
    cands = sorted((r for r in rows if r["verdict"] != "exact"), key=_key)
    if n <= 0 or not cands:
        return []
    severity_rank = {"error": 0, "block": 1, "repair": 2, "info": 3}
    codes = sorted({c for r in cands for c in r["reasons"]},
                   key=lambda c: (severity_rank.get(REASONS.get(c, ("info",))[0], 9), c))
    picked: list[str] = []
    for code in codes:
        if len(picked) >= n:
            break
        for r in cands:
            if code in r["reasons"]:
                if r["id"] not in picked:
                    picked.append(r["id"])
                break
    seen_providers: set[str] = set()
    for r in cands:
        if len(picked) >= n:
            break
        if r["provider"] not in seen_providers:
            seen_providers.add(r["provider"])
            if r["id"] not in picked:
                picked.append(r["id"])
    for r in cands:
        if len(picked) >= n:
            break
        if r["id"] not in picked:
            picked.append(r["id"])
    rank = {r["id"]: i for i, r in enumerate(cands)}
    return sorted(picked, key=rank.__getitem__)


def _light_frame(tokens_dir: str | Path) -> pl.DataFrame:
    return read_shards(tokens_dir, columns=_LIGHT_COLUMNS)


def _full_rows(tokens_dir: str | Path, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    if not ids:
        return {}
    d = Path(tokens_dir)
    manifest = json.loads((d / "manifest.json").read_text(encoding="utf-8"))
    files = [str(d / s["file"]) for s in manifest["shards"]]
    df = pl.scan_parquet(files).filter(pl.col("id").is_in(list(ids))).collect()
    return {r["id"]: r for r in df.iter_rows(named=True)}


def _diff_counter(providers: Mapping[str, Mapping[str, Any]], key: str) -> Counter:
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


def _provider_rows(providers: Mapping[str, Mapping[str, Any]], advice: Mapping[str, Any]) -> list[dict[str, Any]]:
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


def _reason_rows(reasons: Mapping[str, Mapping[str, Any]], link) -> list[dict[str, Any]]:
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


def _template():
    text = resources.files("eagledata").joinpath("data/templates/report.html.jinja").read_text(encoding="utf-8")
    return _env().from_string(text)


def _write(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _sample_view(row: Mapping[str, Any], tokenizer, settings: Mapping[str, Any]) -> dict[str, Any]:
    ids = list(row["input_ids"] or [])
    plen = int(row["prompt_len"] or 0)
    completion = ids[plen:]
    segments = json.loads(row["segments"] or "[]")
    rewrites = json.loads(row["tool_id_rewrites"] or "[]")
    repair = json.loads(row.get("repair") or "null")
    units = token_units(completion, tokenizer)
    unit_texts = {p: u.text for u in units for p in range(u.start, u.end)}
    implications = [
        implicated_tokens(code, completion, segments, unit_texts=unit_texts, is_special=tokenizer.is_special_id,
                          decode=tokenizer.decode, completion_diff=row["completion_diff"],
                          prompt_diff=row["prompt_diff"], tool_id_rewrites=rewrites, repair=repair)
        for code in row["reasons"]
    ]
    marks: dict[int, tuple[str, list[str]]] = {}
    for imp in implications:
        if imp.level is None:
            continue
        for p in imp.positions:
            lv, cs = marks.get(p, (imp.level, []))
            if _LEVEL_RANK[imp.level] > _LEVEL_RANK[lv]:
                lv = imp.level
            marks[p] = (lv, cs + [imp.code])
    kinds = position_kinds(len(completion), segments)
    prompt = ids[:plen]
    tail = prompt[-int(settings["prompt_tail_tokens"]):] if settings["prompt_tail_tokens"] else []
    prompt_html = render_tokens(tail, token_units(tail, tokenizer), ["prompt"] * len(tail), max_tokens=len(tail) + 1) if tail else Markup("")
    return {
        "id": row["id"], "anchor": anchor(row["id"]), "provider": row["provider"], "model": row.get("model"),
        "verdict": row["verdict"], "finish_reason": row["finish_reason"], "status": row.get("status"),
        "counts": [
            ("prompt", plen, row["billed_prompt"], row["prompt_diff"]),
            ("completion", int(row["completion_len"] or 0), row["billed_completion"], row["completion_diff"]),
            ("reasoning", int(row["reasoning_len"] or 0), row["billed_reasoning"], None),
        ],
        "reasons": [{"code": imp.code, "severity": REASONS.get(imp.code, ("info", ""))[0],
                     "message": REASONS.get(imp.code, ("", imp.code))[1], "level": imp.level,
                     "positions": imp.positions, "note": imp.note} for imp in implications],
        "rewrites": rewrites,
        "repair": repair,
        "n_tokens": len(completion),
        "tokens_html": render_tokens(completion, units, kinds, marks, max_tokens=int(settings["max_tokens_shown"])),
        "prompt_html": prompt_html, "prompt_shown": len(tail), "prompt_len": plen,
    }


def _length_charts(df: pl.DataFrame) -> list[dict[str, Any]]:
    out = []
    for col, label in (("prompt_len", "prompt tokens (ours)"), ("completion_len", "completion tokens (ours)")):
        vals = [v for v in df[col].to_list() if v] if df.height else []
        out.append({"title": label, "stats": _stats(vals),
                    "svg": svg_bars(length_bars(vals), x_title=label, width=600)})
    return out


def _diff_charts(providers: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for key, label in (("completion_diff", "completion: ours - billed (provider's convention)"),
                       ("prompt_diff", "prompt: ours - billed")):
        c = _diff_counter(providers, key)
        n = sum(c.values())
        out.append({"title": label, "n": n, "zero": c.get(0, 0),
                    "svg": svg_bars(diff_bars(c), x_title="tokens (ours - billed)", width=600)})
    return out


def _load_validation(validation: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(validation, Mapping):
        return dict(validation)
    return json.loads(Path(validation).read_text(encoding="utf-8"))


def build_dataset_report(validation: str | Path | Mapping[str, Any], tokens_dir: str | Path, out_html: str | Path,
                         tokenizer, settings: Mapping[str, Any] | None = None,
                         run_report: str | None = None) -> dict[str, Any]:
    """Write one dataset's HTML report; returns the template context (for tests and logs).
    ``validation``: the dataset's ``validation.json`` (a path, or the parsed document)."""
    settings = {**REPORT_DEFAULTS, **(settings or {})}
    v = _load_validation(validation)
    df = _light_frame(tokens_dir)
    rows = df.to_dicts()
    worst_ids = select_worst(rows, int(settings["worst_samples"]))
    full = _full_rows(tokens_dir, worst_ids)
    samples = [_sample_view(full[i], tokenizer, settings) for i in worst_ids if i in full]
    shown = {s["id"] for s in samples}
    advice = routing_advice(v.get("providers") or {}, int(settings["min_samples"]), float(settings["ignore_below"]))
    ctx = {
        "scope": "dataset", "title": f"eagledata report: {v.get('dataset')}", "name": v.get("dataset"),
        "v": v, "counts": v["counts"], "stack": verdict_stack(v["counts"], width=1200, height=28),
        "providers": _provider_rows(v.get("providers") or {}, advice),
        "diff_charts": _diff_charts(v.get("providers") or {}),
        "length_charts": _length_charts(df),
        "reasons": _reason_rows(v.get("reasons") or {}, lambda ds, i: f"#{anchor(i)}" if i in shown else None),
        "samples": samples, "n_flagged": sum(1 for r in rows if r["verdict"] != "exact"),
        "implicated": IMPLICATED, "advice": advice,
        "advice_yaml": routing_advice_yaml(advice, f"dataset {v.get('dataset')}"),
        "datasets": [], "run_report": run_report, "version": __version__, "settings": settings,
        "colours": _VERDICT_COLOURS,
    }
    _write(out_html, _template().render(**ctx))
    return ctx


def build_run_report(datasets: Mapping[str, tuple[str | Path, str | Path]], out_html: str | Path,
                     out_json: str | Path, out_yaml: str | Path, settings: Mapping[str, Any] | None = None,
                     dataset_links: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Write the run-wide HTML report, ``validation.json`` and routing advice YAML.

    ``datasets``: name -> (validation.json path or parsed document, tokens dir); ``dataset_links``:
    name -> href of the dataset's own report, relative to ``out_html``."""
    settings = {**REPORT_DEFAULTS, **(settings or {})}
    validations = {name: _load_validation(vp) for name, (vp, _) in datasets.items()}
    run = aggregate_validations(validations, int(settings["min_samples"]), float(settings["ignore_below"]))
    links = dict(dataset_links or {})
    frames, shown = [], {}
    for name, (_, tokens_dir) in datasets.items():
        df = _light_frame(tokens_dir)
        frames.append(df.select(["prompt_len", "completion_len"]))
        shown[name] = set(select_worst(df.to_dicts(), int(settings["worst_samples"])))

    def link(ds, i):
        if ds not in links:
            return None
        return f"{links[ds]}#{anchor(i)}" if i in shown.get(ds, ()) else links[ds]

    all_lengths = pl.concat(frames) if frames else pl.DataFrame({"prompt_len": [], "completion_len": []})
    advice = run["routing_advice"]
    ds_rows = [{"name": name, **d, "link": links.get(name),
                "stack": verdict_stack(d["counts"], width=220, height=12, labels=False)} for name, d in run["datasets"].items()]
    ctx = {
        "scope": "run", "title": "eagledata report: run", "name": "run", "v": run, "counts": run["counts"],
        "stack": verdict_stack(run["counts"], width=1200, height=28),
        "providers": _provider_rows(run["providers"], advice),
        "diff_charts": _diff_charts(run["providers"]),
        "length_charts": _length_charts(all_lengths),
        "reasons": _reason_rows(run["reasons"], link),
        "samples": [], "n_flagged": run["counts"]["total"] - run["counts"]["exact"],
        "implicated": IMPLICATED, "advice": advice,
        "advice_yaml": routing_advice_yaml(advice, "datasets " + ", ".join(datasets)),
        "datasets": ds_rows, "run_report": None, "version": __version__, "settings": settings,
        "colours": _VERDICT_COLOURS,
    }
    _write(out_json, json.dumps(run, indent=2) + "\n")
    _write(out_yaml, ctx["advice_yaml"])
    _write(out_html, _template().render(**ctx))
    return ctx


# --------------------------------------------------------------------------------------------------
# Outside Snakemake: reports of whatever a run left, even when validation failed


def build_reports_from_config(config: Mapping[str, Any], out_dir: str | Path,
                              datasets: Sequence[str] | None = None) -> dict[str, Any]:
    """Every report for the datasets of ``config`` whose token shards exist, written under
    ``out_dir`` (``report.html``, ``validation.json``, ``routing_advice.yaml``,
    ``{dataset}/report.html``). A dataset whose ``validation.json`` is missing (the validate rule
    failed and Snakemake removed it) is summarised from its token shards. Returns the run context."""
    from eagledata.config import load_model_tokenizer
    from eagledata.validate.summary import summarize

    settings = report_settings(config)
    out = Path(out_dir)
    results = Path(config["results_dir"])
    found: dict[str, tuple[Any, Path]] = {}
    for name in datasets or list(config["datasets"]):
        tokens = results / name / "tokens"
        if not (tokens / "manifest.json").exists():
            continue
        vpath = results / name / "validation.json"
        if vpath.exists():
            validation: Any = vpath
        else:
            own = config["datasets"][name].get("validation") or {}
            limit = own.get("max_bad_fraction", (config.get("validation") or {}).get("max_bad_fraction", 0.05))
            validation = summarize(tokens, limit)
        tokenizer = load_model_tokenizer(config, config["datasets"][name]["model"])
        build_dataset_report(validation, tokens, out / name / "report.html", tokenizer, settings, "../report.html")
        found[name] = (validation, tokens)
    if not found:
        raise FileNotFoundError(f"no token shards under {results}/*/tokens: run the pipeline's tokens stage first")
    return build_run_report(found, out / "report.html", out / "validation.json", out / "routing_advice.yaml",
                            settings, {n: f"{n}/report.html" for n in found})


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m eagledata.report.build --config CONFIG --out DIR [--dataset NAME ...]``"""
    import argparse
    import sys

    from eagledata.config import load_config

    ap = argparse.ArgumentParser(prog="python -m eagledata.report.build",
                                 description="Build the HTML reports outside Snakemake (e.g. after a failed validate).")
    ap.add_argument("--config", default="config/config.yaml")
    ap.add_argument("--out", required=True, help="output directory (keep it outside results_dir)")
    ap.add_argument("--dataset", action="append", help="only these datasets (repeatable)")
    args = ap.parse_args(argv)
    try:
        ctx = build_reports_from_config(load_config(args.config), args.out, args.dataset)
    except FileNotFoundError as exc:
        print(f"eagledata report: {exc}", file=sys.stderr)
        return 2
    print(f"{Path(args.out) / 'report.html'} ({', '.join(d['name'] for d in ctx['datasets'])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

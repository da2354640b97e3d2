"""Per-shard summaries of what the samples teach, and the dataset's learning from them.

Everything :func:`~eagledata.tokens.checks.learn_conventions`,
:func:`~eagledata.tokens.learning.learn_reasoning_reliability` and
:func:`~eagledata.tokens.learning.learn_prompt_variants` read of the samples, as counters that add up
over shards (a shard's summary is a few hundred bytes, whatever its size), so the dataset-level
learning job reads one small JSON per shard and never a sample:

* ``conventions``: per provider, and per provider and finish reason, how many end-of-turn samples
  agree under each known convention;
* ``reasoning``: per (provider, finish reason, agrees under counts_eot, agrees under excludes_eot),
  the count, ``above``/``below`` and spread of the reasoning differences (which group is used
  depends on the learned convention, so every group is kept);
* ``prompts``: per (provider, has tools), the samples with a billed prompt count and up to two
  distinct prompt differences under each rendering (one distinct value is a variant; two is none);
* ``key_order``: per provider, the samples' tool key-order votes (``sorted``, ``request_order``,
  ``tied``; :meth:`~eagledata.tokens.checks.SampleStats.key_order_vote`).

:func:`learn` gives exactly what the three functions give on the samples themselves (tests compare).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from eagledata.tokens.checks import (EXCLUDES_EOT, COUNTS_EOT, REASONS, SampleStats, count_vote, convention_for,
                                     provider_conventions)
from eagledata.tokens.learning import MIN_VARIANT_SAMPLES, RENDERINGS, diff_under, key_order_learned, variant_name

# 2: a sample whose end may be a trimmed stop string casts no count-convention vote; 3: the tools in the
# request's key order (a rendering, and the key-order votes), and no vote from a tool call whose
# arguments came as compact JSON
SUMMARY_VERSION = 3


def _sep(*parts: Any) -> str:
    return "\x1f".join("" if p is None else str(p) for p in parts)


def _unsep(key: str) -> list[str]:
    return key.split("\x1f")


def _has_error(s: SampleStats) -> bool:
    return any(REASONS[k][0] == "error" for k in s.codes)


def summarize(stats: Iterable[SampleStats]) -> dict[str, Any]:
    """One shard's summary (JSON-ready)."""
    conv: dict[str, dict[str, int]] = {}
    by_finish: dict[str, dict[str, int]] = {}
    reasoning: dict[str, list] = {}
    prompts: dict[str, dict[str, Any]] = {}
    key_order: dict[str, dict[str, int]] = {}
    rows = 0
    for s in stats:
        rows += 1
        c = conv.setdefault(s.provider, {})
        f = by_finish.setdefault(_sep(s.provider, s.finish_reason or ""), {})
        vote = count_vote(s)
        if vote is not None:
            c[vote] = c.get(vote, 0) + 1
            f[vote] = f.get(vote, 0) + 1
        d = s.reasoning_diff()
        if d is not None and not _has_error(s):
            key = _sep(s.provider, s.finish_reason or "", int(s.completion_diff(COUNTS_EOT) == 0),
                       int(s.completion_diff(EXCLUDES_EOT) == 0))
            _add_reasoning(reasoning, key, [1, int(d > 1), int(d < 0), d, d])
        if s.prompt_diff is not None:
            p = prompts.setdefault(_sep(s.provider, int(s.has_tools)), {"n": 0, **{r: [] for r in RENDERINGS}})
            p["n"] += 1
            for r in RENDERINGS:
                _add_diffs(p[r], [diff_under(s, r)])
            order = s.key_order_vote()
            if order is not None:
                k = key_order.setdefault(s.provider, {})
                k[order] = k.get(order, 0) + 1
    return {"version": SUMMARY_VERSION, "rows": rows, "conventions": conv, "by_finish": by_finish,
            "reasoning": reasoning, "prompts": prompts, "key_order": key_order}


def _add_reasoning(into: dict[str, list], key: str, v: list) -> None:
    cur = into.get(key)
    if cur is None:
        into[key] = list(v)
    else:
        into[key] = [cur[0] + v[0], cur[1] + v[1], cur[2] + v[2], min(cur[3], v[3]), max(cur[4], v[4])]


def _add_diffs(into: list, values: Iterable) -> None:
    """Keep at most two distinct values: enough to tell "one constant" from "none"."""
    for v in values:
        if len(into) >= 2:
            return
        if v not in into:
            into.append(v)


def merge(summaries: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The sum of shard summaries (itself a summary)."""
    out: dict[str, Any] = {"version": SUMMARY_VERSION, "rows": 0, "conventions": {}, "by_finish": {},
                           "reasoning": {}, "prompts": {}, "key_order": {}}
    for s in summaries:
        if s.get("version") != SUMMARY_VERSION:
            raise ValueError(f"token shard summary version {s.get('version')!r}, expected {SUMMARY_VERSION}")
        out["rows"] += s["rows"]
        for part in ("conventions", "by_finish", "key_order"):
            for key, counts in s[part].items():
                c = out[part].setdefault(key, {})
                for k, n in counts.items():
                    c[k] = c.get(k, 0) + n
        for key, v in s["reasoning"].items():
            _add_reasoning(out["reasoning"], key, v)
        for key, p in s["prompts"].items():
            q = out["prompts"].setdefault(key, {"n": 0, **{r: [] for r in RENDERINGS}})
            q["n"] += p["n"]
            for r in RENDERINGS:
                _add_diffs(q[r], p[r])
    return out


def learn(summary: Mapping[str, Any]) -> tuple[dict[str, dict], dict[str, dict], dict[str, dict]]:
    """(conventions, reasoning reliability, prompt variants) of a merged summary."""
    groups: dict[str, dict[str, Mapping[str, int]]] = {}
    for key, c in summary["by_finish"].items():
        provider, finish = _unsep(key)
        groups.setdefault(provider, {})[finish] = c
    conventions = {provider: provider_conventions(c, groups.get(provider, {}))
                   for provider, c in summary["conventions"].items()}
    variants = _variants(summary["prompts"])
    for provider, votes in summary["key_order"].items():
        if any(votes.values()):
            variants[provider]["tool_key_order"] = key_order_learned(votes, variants.get(provider))
    return conventions, _reliability(summary["reasoning"], conventions), variants


def _reliability(groups: Mapping[str, list], conventions: Mapping[str, Mapping]) -> dict[str, dict[str, Any]]:
    seen: dict[str, list] = {}
    for key, v in groups.items():
        provider, finish, agree_counts, agree_excludes = _unsep(key)
        conv = convention_for(conventions, provider, finish or None)
        if conv == "unknown" or not int(agree_counts if conv == COUNTS_EOT else agree_excludes):
            continue
        _add_reasoning(seen, provider, v)
    return {provider: {"checksum": not (above and below), "samples": n, "agree": n - above - below,
                       "above": above, "below": below, "spread": [lo, hi]}
            for provider, (n, above, below, lo, hi) in seen.items()}


def _variants(prompts: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    by_provider: dict[str, dict[bool, Mapping[str, Any]]] = {}
    for key, p in prompts.items():
        provider, tools = _unsep(key)
        by_provider.setdefault(provider, {})[tools == "1"] = p
    out = {}
    for provider, parts in by_provider.items():
        learned = _one_variant(list(parts.items()))
        if learned["rendering"] is None:
            groups = {name: [(t, parts[t])] for name, t in (("without_tools", False), ("with_tools", True)) if t in parts}
            learned["groups"] = {name: _one_variant(g) for name, g in groups.items()}
        out[provider] = learned
    return out


def _one_variant(parts: list[tuple[bool, Mapping[str, Any]]]) -> dict[str, Any]:
    """As :func:`eagledata.tokens.learning._one_variant`, from the (has tools, counters) groups."""
    n = sum(p["n"] for _, p in parts)
    with_tools = sum(p["n"] for t, p in parts if t)
    base = {"samples": n, "with_tools": with_tools, "without_tools": n - with_tools}
    for rendering in RENDERINGS:
        diffs: list = []
        for _, p in parts:
            _add_diffs(diffs, p[rendering])
        if len(diffs) != 1 or diffs[0] is None:
            continue
        offset = diffs[0]
        if rendering == "canonical" and offset == 0:
            return {"variant": None, "rendering": "canonical", "offset": 0, **base}
        if n < MIN_VARIANT_SAMPLES:
            break
        return {"variant": variant_name(rendering, offset), "rendering": rendering, "offset": offset, **base}
    return {"variant": None, "rendering": None, "offset": None, **base}

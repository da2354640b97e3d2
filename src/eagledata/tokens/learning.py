"""What a dataset's samples teach about each provider, beyond its count convention
(:func:`eagledata.tokens.checks.learn_conventions`):

* **reasoning count reliability**: a provider whose ``reasoning_tokens`` disagrees with our reasoning
  segment in *both* directions on samples whose completion totals agree exactly is learned as
  "reasoning count is not a checksum". Its samples are judged on the completion total and the
  structure; the verdict says the split was not count-checked. A provider that disagrees in one
  direction only (e.g. a stripped space: reasoning one short *and* the total one short) is not
  excused: those samples keep their mismatch (or their repair).
* **prompt rendering variant**: a provider whose billed prompt counts are explained on every sample
  by one rendering (ours, or the tools declared as JSON instead of the model's TypeScript style)
  plus one constant, other than ours exactly, has a named variant (``offset+1``, ``json_tools``,
  ``json_tools+offset-2``, ``unsorted_tools``: the tools' keys in the request's own order). It is
  reported, never applied: our prompt ids stay the canonical rendering and the prompt verdict stays
  ``differs``.
* **tool key order**: Kimi K2 Thinking's and K2.5's own code deep-sorts the tools by key; a provider
  that skips it renders the request's key order, usually with the same token count, so a matching
  count alone does not prove the prompt (``unproven``, :func:`~eagledata.tokens.checks.prompt_verdict`).
  Samples whose two orders render to different counts show which one the provider uses: a provider
  with at least :data:`MIN_VARIANT_SAMPLES` samples billed as sorted and none as the request's order
  is proven to sort (``tool_key_order.sorts_keys``), and its tied samples are ``exact``. A tied sample
  casts no vote, so none proves itself.

Both are learned from :class:`~eagledata.tokens.checks.SampleStats` only, so they can be summed from
per-shard summaries.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Iterable, Mapping

from eagledata.tokens.checks import REASONS, UNSORTED_TOOLS, SampleStats, convention_for

#: Fewer samples than this never make a rendering variant (one sample is not a pattern).
MIN_VARIANT_SAMPLES = 3
JSON_TOOLS = "json_tools"
#: The renderings a provider's prompt variant is looked for under, in this order.
RENDERINGS = ("canonical", JSON_TOOLS, UNSORTED_TOOLS)
#: The votes of :meth:`~eagledata.tokens.checks.SampleStats.key_order_vote` a provider's
#: ``tool_key_order`` counts.
KEY_ORDER_VOTES = ("sorted", "request_order", "tied")


def learn_reasoning_reliability(stats: Iterable[SampleStats], conventions: Mapping[str, Mapping]) -> dict[str, dict[str, Any]]:
    """Per provider: ``{"checksum": bool, "samples", "agree", "above", "below", "spread": [min, max]}``
    over samples with a positive billed reasoning count whose completion total agrees (diffs are
    billed minus ours; ``agree`` counts 0 and +1, the ``</think>``)."""
    seen: dict[str, list[int]] = defaultdict(list)
    for s in stats:
        d = reasoning_vote(s, conventions)
        if d is not None:
            seen[s.provider].append(d)
    out = {}
    for provider, diffs in seen.items():
        above = sum(d > 1 for d in diffs)
        below = sum(d < 0 for d in diffs)
        out[provider] = {"checksum": not (above and below), "samples": len(diffs), "agree": len(diffs) - above - below,
                         "above": above, "below": below, "spread": [min(diffs), max(diffs)]}
    return out


def reasoning_checked(reliability: Mapping[str, Mapping[str, Any]], provider: str, own_diff: int | None = None) -> bool:
    """Whether ``provider``'s reasoning count is a checksum. ``own_diff``: the judged sample's own
    reasoning diff when it was one of the learning's samples (:func:`reasoning_vote`): left out, so a
    sample never excuses itself (one sample above and one below would excuse both)."""
    r = reliability.get(provider)
    if not r:
        return True
    if own_diff is None or "above" not in r:
        return bool(r.get("checksum", True))
    above, below = r["above"] - (own_diff > 1), r["below"] - (own_diff < 0)
    return not (above and below)


def reasoning_vote(s: SampleStats, conventions: Mapping[str, Mapping]) -> int | None:
    """The sample's reasoning diff when :func:`learn_reasoning_reliability` counts it, else ``None``."""
    d = s.reasoning_diff()
    if d is None or any(REASONS[c][0] == "error" for c in s.codes):
        return None
    conv = convention_for(conventions, s.provider, s.finish_reason)
    return d if conv != "unknown" and s.completion_diff(conv) == 0 else None


def learn_prompt_variants(stats: Iterable[SampleStats]) -> dict[str, dict[str, Any]]:
    """Per provider with billed prompt counts: ``{"variant": NAME | None, "rendering", "offset",
    "samples", "with_tools", "without_tools"}``. ``variant`` is ``None`` when our rendering matches
    every prompt (``rendering: canonical, offset: 0``) or when no single rendering and constant explain
    them all (``rendering: None``)."""
    groups: dict[str, list[SampleStats]] = defaultdict(list)
    for s in stats:
        if s.prompt_diff is not None:
            groups[s.provider].append(s)
    out = {provider: _variant_of(rows) for provider, rows in groups.items()}
    for provider, rows in groups.items():
        votes = Counter(v for v in (s.key_order_vote() for s in rows) if v is not None)
        if votes:
            out[provider]["tool_key_order"] = key_order_learned(votes, out[provider])
    return out


def key_order_learned(votes: Mapping[str, int], variant: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A provider's ``tool_key_order`` from its samples' key-order votes: the counts, and
    ``sorts_keys`` (at least :data:`MIN_VARIANT_SAMPLES` samples billed as the sorted rendering and
    none as the request's own order, and the provider's learned prompt ``variant`` is not the
    request's order with an offset: then its 'sorted' votes are coincidences of that offset)."""
    counts = {k: int(votes.get(k, 0)) for k in KEY_ORDER_VOTES}
    sorts = counts["sorted"] >= MIN_VARIANT_SAMPLES and counts["request_order"] == 0
    return {**counts, "sorts_keys": sorts and _tools_variant(variant or {}).get("rendering") != UNSORTED_TOOLS}


def _tools_variant(learned: Mapping[str, Any]) -> Mapping[str, Any]:
    """The learned variant that explains a provider's prompts with tools: its own, else its
    ``with_tools`` group's (``{}``: none)."""
    if learned.get("variant"):
        return learned
    v = (learned.get("groups") or {}).get("with_tools") or {}
    return v if v.get("variant") else {}


def request_order_explains(variants: Mapping[str, Mapping[str, Any]], s: SampleStats) -> bool:
    """Whether ``s``'s provider is learned to declare the tools in the request's key order (variant
    ``unsorted_tools`` with an offset) and that rendering, measured on ``s`` (its ids differ from
    ours), explains ``s``'s billed count too: then our canonical rendering having the count is a
    coincidence of the offset, not a proof (a token saved by sorting the keys, one by the template)."""
    v = _tools_variant(variants.get(s.provider) or {})
    return (v.get("rendering") == UNSORTED_TOOLS and s.has_tools and UNSORTED_TOOLS in (s.prompt_alt or {})
            and diff_under(s, UNSORTED_TOOLS) == v["offset"])


def provider_sorts_tool_keys(variants: Mapping[str, Mapping[str, Any]], provider: str) -> bool:
    """Whether ``provider`` is proven to declare the tools deep-sorted, as the model's code does
    (:func:`key_order_learned`)."""
    return bool(((variants.get(provider) or {}).get("tool_key_order") or {}).get("sorts_keys"))


def _variant_of(rows: list[SampleStats]) -> dict[str, Any]:
    """The provider's variant over all its prompts; when none explains them all, ``groups`` has the
    variant of its prompts without tools and of those with tools, each learned on its own (a provider
    may add one token to every plain prompt and declare tools its own way)."""
    learned = _one_variant(rows)
    if learned["rendering"] is None:
        parts = {"without_tools": [s for s in rows if not s.has_tools], "with_tools": [s for s in rows if s.has_tools]}
        learned["groups"] = {name: _one_variant(part) for name, part in parts.items() if part}
    return learned


def _one_variant(rows: list[SampleStats]) -> dict[str, Any]:
    with_tools = sum(s.has_tools for s in rows)
    base = {"samples": len(rows), "with_tools": with_tools, "without_tools": len(rows) - with_tools}
    for rendering in RENDERINGS:
        diffs = {diff_under(s, rendering) for s in rows}
        if len(diffs) != 1 or None in diffs:
            continue
        offset = diffs.pop()
        if rendering == "canonical" and offset == 0:
            return {"variant": None, "rendering": "canonical", "offset": 0, **base}
        if len(rows) < MIN_VARIANT_SAMPLES:
            break
        return {"variant": variant_name(rendering, offset), "rendering": rendering, "offset": offset, **base}
    return {"variant": None, "rendering": None, "offset": None, **base}


def diff_under(s: SampleStats, rendering: str) -> int | None:
    """Ours minus billed under ``rendering`` (``None``: that rendering was not measured). The tools in
    the request's key order are measured only where they render other ids than ours: absent, they are
    ours."""
    if rendering == "canonical" or not s.has_tools:
        return s.prompt_diff
    n = (s.prompt_alt or {}).get(rendering)
    if rendering == UNSORTED_TOOLS and n is None:
        return s.prompt_diff
    return None if n is None or s.billed_prompt is None else n - s.billed_prompt


def variant_name(rendering: str, offset: int) -> str:
    """``offset+1`` (ours is one token longer than billed on every prompt), ``json_tools``,
    ``json_tools+offset-2``, ``unsorted_tools``."""
    parts = [] if rendering == "canonical" else [rendering]
    if offset:
        parts.append(f"offset{offset:+d}")
    return "+".join(parts)


def sample_variant(variants: Mapping[str, Mapping[str, Any]], s: SampleStats) -> str | None:
    """The provider's learned variant when it explains this sample's differing prompt count."""
    v = variants.get(s.provider) or {}
    if not s.prompt_diff:
        return None
    if not v.get("variant"):
        v = (v.get("groups") or {}).get("with_tools" if s.has_tools else "without_tools") or {}
        if not v.get("variant"):
            return None
    return v["variant"] if diff_under(s, v["rendering"]) == v["offset"] else None

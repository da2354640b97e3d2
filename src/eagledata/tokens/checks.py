"""Per-sample checks and verdicts: every token id proven against the provider's billed counts, or
flagged with a machine-readable reason and a human sentence.

Verdicts:

* ``exact``: completion (and, where reported, reasoning and prompt) counts match the provider's
  billed counts under the provider's count convention, and every structural check passes; a prompt
  count proves the prompt only where no other rendering a provider is known to use has the same
  count (the tools' keys in the request's own order: ``prompt_order_unproven``);
* ``repaired``: as exact, but the text needed a known repair (a rebuilt tool-call id, tool markup
  moved out of text, reasoning split out of content);
* ``mismatch``: any blocking reason (counts differ, truncated, lossy text, broken structure, ...);
* ``error``: the provider answered with an error (HTTP, in a 200 body, mid-stream) or garbage.

Count conventions (only these are accepted, never a learned offset): ``counts_eot`` (billed
completion tokens include the final end-of-turn token) and ``excludes_eot``.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from eagledata.text.families import ModelFamily
from eagledata.tokens.reconstruct import STOP_REASONS
from eagledata.tokens.samples import UNSORTED_TOOLS, Sample
from eagledata.text.tokenizer import Tokenizer

COUNTS_EOT = "counts_eot"
EXCLUDES_EOT = "excludes_eot"
CONVENTIONS = (COUNTS_EOT, EXCLUDES_EOT)

#: code -> (severity, sentence). severity: error | block | repair | info
REASONS: dict[str, tuple[str, str]] = {
    "http_error": ("error", "the provider answered with an HTTP error status"),
    "error_in_body": ("error", "the provider returned an error object inside an HTTP 200 body"),
    "error_mid_stream": ("error", "the stream carried an error or ended before finishing"),
    "finish_error": ("error", "finish_reason is 'error': generation failed upstream"),
    "malformed_body": ("error", "the response body is not valid JSON or SSE"),
    "prompt_unrenderable": ("error", "the request's messages could not be rendered with the chat template"),
    "truncated": ("block", "the completion was cut at max_tokens (finish_reason 'length'): no end-of-turn"),
    "finish_unproven": ("block", "the response ended without a finish reason that proves its end (not a stop, not 'length': "
                                 "a content filter, an abort, or none reported): it may be cut off"),
    "stop_sequence_requested": ("block", "the request set stop sequences: a 'stop' finish may be one of them, trimmed "
                                         "from the text, rather than the model's end-of-turn"),
    "empty_response": ("block", "the response has no reasoning, no content and no tool calls"),
    "lossy_text": ("block", "returned text contains U+FFFD: bytes were lost, the ids cannot be proven"),
    "completion_count_missing": ("block", "usage.completion_tokens is missing: nothing to prove the ids against"),
    "completion_count_mismatch": ("block", "our completion token count differs from usage.completion_tokens under the provider's convention"),
    "reasoning_count_mismatch": ("block", "our reasoning token count differs from completion_tokens_details.reasoning_tokens (equal or +1 for </think> allowed)"),
    "prompt_count_mismatch": ("block", "our rendered prompt's token count differs from usage.prompt_tokens"),
    "prompt_order_unproven": ("block", "the request's tools are not in the deep-sorted key order the model's own code "
                                       "declares them in, and declaring them in the request's order is another prompt "
                                       "of the same token count (or, for a provider learned to render the request's "
                                       "order with an offset, of the billed count under that offset): the billed count "
                                       "cannot tell which one the provider rendered, and this provider is not proven "
                                       "to sort them (the prompt ids may not be what the model saw)"),
    "unknown_count_convention": ("block", "the provider's other samples support neither known convention (end-of-turn counted or not): a sample's own count cannot choose it (a provider needs at least two samples ending in end of turn)"),
    "reasoning_missing": ("block", "thinking was requested but the response carries no reasoning"),
    "reasoning_unexpected": ("block", "reasoning text returned for a model or request without thinking"),
    "think_close_count": ("block", "a thinking completion must contain exactly one </think>"),
    "tool_section_malformed": ("block", "the tool-call section's special tokens are not well formed"),
    "end_of_turn_misplaced": ("block", "end-of-turn must be the last token exactly when the model stopped"),
    "special_in_text": ("block", "a special-token id appears inside a text segment"),
    "decode_mismatch": ("block", "decoding our ids does not give back the provider's text"),
    "tool_call_malformed": ("block", "a tool call has no function name"),
    "text_after_tool_section": ("block", "text follows the tool-call section in the returned markup"),
    "tool_id_rebuilt": ("repair", "a tool-call id was not the model's native functions.NAME:IDX and was rebuilt"),
    "tool_markup_in_content": ("repair", "tool calls came as raw markup inside content and were moved to the tool section"),
    "tool_markup_in_reasoning": ("repair", "tool calls came as raw markup inside reasoning and were moved to the tool section"),
    "reasoning_in_content": ("repair", "reasoning came inside content between think tags and was split out"),
    "whitespace_restored": ("repair", "the provider stripped a leading space; restoring it is the unique candidate matching the billed counts"),
    "tool_arguments_respaced": ("repair", "the provider re-serialized tool arguments as compact JSON; the model's spacing is the unique candidate matching the billed counts"),
    "tool_arguments_order_unproven": ("block", "respacing the re-serialized tool arguments matches the billed counts, but an object "
                                      "in them has several keys, all in sorted order, from a provider not proven to keep key "
                                      "order (fewer than 2 samples whose arguments show unsorted keys): a re-serializer that "
                                      "sorts keys bills the model's order with the same count, so the ids cannot be proven"),
    "repair_ambiguous": ("block", "more than one repair candidate matches the billed counts: the ids cannot be singled out"),
    "whitespace_ambiguous": ("block", "this provider strips leading spaces and the counts match with and without one: the ids cannot be singled out"),
    "tool_arguments_ambiguous": ("block", "tool arguments came as compact JSON and the counts match with and without "
                                          "the model's spacing: the ids cannot be singled out"),
    "engine_prompt_echo": ("repair", "the engine's ids began with the prompt's last ids (SGLang releases whose "
                           "detokenizer returned its decode window as output_ids), so many more than its own "
                           "completion count: they were cut"),
    "ground_truth_ids": ("info", "the completion ids came from the serving engine itself (no reconstruction)"),
    "text_path_differs": ("info", "reconstructing from the returned text would have given different ids than the engine returned"),
    "prompt_path_differs": ("info", "the engine's prompt ids differ from our chat-template rendering (the engine's are used)"),
    "tool_id_index_unexpected": ("info", "a native tool-call id's index differs from the conversation-wide count"),
    "reasoning_count_unreported": ("info", "the provider reports 0 reasoning tokens for a response with reasoning"),
    "content_empty_after_reasoning": ("info", "a thinking answer of reasoning alone (no content, no tool call): only the "
                                      "reasoning count witnesses where </think> falls"),
    "reasoning_boundary_unproven": ("block", "a thinking answer of reasoning alone whose reasoning count is not reported, "
                                    "reported as 0 or not a checksum: a provider that never split off the content "
                                    "(all of it returned as reasoning) bills the same total, so </think> may be misplaced"),
    "tool_arguments_compact": ("info", "tool-call arguments came as compact JSON (no space after any ',' or ':'), as a "
                               "provider that re-serializes them returns them: the billed count may be of the model's "
                               "spaced arguments, so this sample casts no vote on its provider's count convention"),
    "reasoning_count_unchecked": ("info", "this provider's reasoning_tokens is learned not to be a checksum (it disagrees "
                                  "in both directions while the completion totals agree): the reasoning/content split "
                                  "was not count-checked, the completion total was"),
}

_ERROR_CODES = {"http": "http_error", "body": "error_in_body", "stream": "error_mid_stream",
                "finish": "finish_error", "malformed": "malformed_body"}


@dataclass
class SampleStats:
    """The scalar facts of one sample that verdicts are computed from."""

    id: str
    provider: str
    finish_reason: str | None
    prompt_len: int
    completion_len: int
    reasoning_len: int
    has_eot: bool
    billed_prompt: int | None
    billed_completion: int | None
    billed_reasoning: int | None
    codes: list[str] = field(default_factory=list)  # convention-independent reasons
    has_tools: bool = False
    #: our prompt length under other renderings a provider may use (``json_tools``; ``unsorted_tools``
    #: only where the request's key order renders other ids, see
    #: :func:`eagledata.tokens.samples.alternative_prompt_lengths`)
    prompt_alt: dict[str, int] | None = None

    def completion_diff(self, convention: str) -> int | None:
        if self.billed_completion is None:
            return None
        ours = self.completion_len - (1 if convention == EXCLUDES_EOT and self.has_eot else 0)
        return ours - self.billed_completion

    @property
    def prompt_diff(self) -> int | None:
        return None if self.billed_prompt is None or self.prompt_len == 0 else self.prompt_len - self.billed_prompt

    def key_order_vote(self) -> str | None:
        """What the billed prompt count says about the tools' key order, where the request's own order
        renders other ids than the deep-sorted one (else ``None``): ``sorted`` (only the canonical,
        sorted rendering has the billed count), ``request_order`` (only the request's order has it),
        ``tied`` (both have it: the count cannot tell) or ``None`` (neither)."""
        alt = (self.prompt_alt or {}).get(UNSORTED_TOOLS)
        if alt is None or self.billed_prompt is None or self.prompt_diff is None:
            return None
        canonical, request_order = self.prompt_diff == 0, alt == self.billed_prompt
        if canonical and request_order:
            return "tied"
        return "sorted" if canonical else "request_order" if request_order else None

    def reasoning_diff(self) -> int | None:
        """Billed reasoning minus ours when the provider reports a positive count, else ``None``."""
        br = self.billed_reasoning
        return br - self.reasoning_len if br is not None and br > 0 else None


def structural_codes(sample: Sample, tokenizer: Tokenizer, family: ModelFamily) -> list[str]:
    """Convention-independent reasons of one sample (errors, structure, decode, flags)."""
    codes: list[str] = []
    p, rc = sample.parsed, sample.completion
    if p.error is not None:
        codes.append(_ERROR_CODES.get(p.error.where, "malformed_body"))
    if sample.prompt_error:
        codes.append("prompt_unrenderable")
    codes.extend(f for f in rc.flags if f in REASONS)
    if p.error is None:
        if p.finish_reason == "length":
            codes.append("truncated")
        elif p.finish_reason not in STOP_REASONS:
            codes.append("finish_unproven")
        elif p.finish_reason == "stop" and _stop_sequences(sample.request) \
                and not ("ground_truth_ids" in rc.flags and rc.stopped):  # an engine's ids ending in end-of-turn prove it
            codes.append("stop_sequence_requested")
        if not (p.reasoning or p.content or p.tool_calls):
            codes.append("empty_response")
        if rc.thinking and sample.thinking_requested is not False and not rc.segment_text("reasoning"):
            codes.append("reasoning_missing")
        if rc.thinking and rc.segment_text("reasoning") and not rc.segment_text("content") and not p.tool_calls \
                and "ground_truth_ids" not in rc.flags:
            codes.append("content_empty_after_reasoning")
        if p.completion_tokens is None:
            codes.append("completion_count_missing")
    codes.extend(_structure_codes(rc, tokenizer, family, truncated=p.finish_reason == "length" or p.error is not None))
    if "ground_truth_ids" not in rc.flags and any(compact_json(s.text) for s in rc.segments
                                                  if s.kind == "tool_arguments" and s.text):
        codes.append("tool_arguments_compact")
    return list(dict.fromkeys(codes))


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


def compact_json(text: str) -> bool:
    """Whether ``text`` is JSON written compactly: a ``,`` or ``:`` outside strings, and no
    whitespace outside strings anywhere (``{"a":1}``, not ``{"a": 1}`` nor ``{}``). Such arguments are
    what a provider that parses and re-dumps them returns (the model spaces its JSON), so the
    model's text may have been longer than the returned one."""
    if not text or text[0] not in "[{":
        return False
    bare = _JSON_STRING.sub("", text)
    if not ("," in bare or ":" in bare) or any(c.isspace() for c in bare):
        return False
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _stop_sequences(request: Mapping[str, Any]) -> bool:
    """Whether a request body asked for stop sequences (``stop``, as OpenAI's and OpenRouter's APIs
    name it; ``stop_sequences``, as some providers do; SGLang's native ``sampling_params.stop``)."""
    sampling = request.get("sampling_params")
    bodies = [request, sampling] if isinstance(sampling, Mapping) else [request]
    return any(b.get(k) for b in bodies for k in ("stop", "stop_sequences"))


_FAMILY_IDS: dict[tuple[str, str], tuple[int, ...]] = {}


def _family_ids(tokenizer: Tokenizer, family: ModelFamily) -> tuple[int, ...]:
    """(think_close, section_begin, section_end, call_begin, argument_begin, call_end, end_of_turn)."""
    key = (tokenizer.fingerprint, family.name)
    ids = _FAMILY_IDS.get(key)
    if ids is None:
        sid = tokenizer.special_id
        think_close = sid(family.think_close) if family.thinking else -1
        ids = _FAMILY_IDS[key] = (think_close, *(sid(n) for n in (
            family.tool_section_begin, family.tool_section_end, family.tool_call_begin,
            family.tool_argument_begin, family.tool_call_end, family.end_of_turn)))
    return ids


def _text_codes(rc, tokenizer: Tokenizer, first_special: int | None) -> tuple[list[str], list[int] | None]:
    """(reasons, special ids) of the completion's segments, in one pass: ``special_in_text`` and
    ``decode_mismatch`` per text segment (each segment decoded on its own, never joined: a segment
    boundary inside a character must not pass), and the special ids in order when the segments tile
    the ids and no text segment holds a special id (then nothing else can be special), else ``None``."""
    ids, codes = rc.ids, []
    specials: list[int] | None = [] if first_special is not None else None
    pos = 0
    for seg in rc.segments:
        start, end = seg.start, seg.end
        if start != pos:
            specials = None
        pos = end
        if seg.text is None:
            if specials is not None:
                if end - start != 1:
                    specials = None
                elif ids[start] >= first_special:
                    specials.append(ids[start])
            continue
        seg_ids = ids[start:end]
        if first_special is not None:
            has_special = max(seg_ids, default=-1) >= first_special
        else:
            has_special = any(tokenizer.is_special_id(t) for t in seg_ids)
        if has_special:
            codes.append("special_in_text")
            specials = None
        if not tokenizer.decodes_to(seg_ids, seg.text):
            codes.append("decode_mismatch")
    return codes, specials if pos == len(ids) else None


def _structure_codes(rc, tokenizer: Tokenizer, family: ModelFamily, truncated: bool) -> list[str]:
    ids = rc.ids
    think_close, begin, end, call_begin, arg_begin, call_end, eot = _family_ids(tokenizer, family)
    codes, specials = _text_codes(rc, tokenizer, getattr(tokenizer, "first_special_id", None))
    seq = specials if specials is not None else ids  # the short list when the segments vouch for it
    if rc.thinking and not truncated and seq.count(think_close) != 1:
        codes.append("think_close_count")
    n_begin, n_end = seq.count(begin), seq.count(end)
    if n_begin != n_end or n_begin > 1:
        codes.append("tool_section_malformed")
    elif n_begin == 1:
        b, e = seq.index(begin), seq.index(end)
        order = [t for t in seq[b:e + 1] if t in (call_begin, arg_begin, call_end)]
        triple = [call_begin, arg_begin, call_end]
        if b > e or len(order) % 3 or any(order[i:i + 3] != triple for i in range(0, len(order), 3)):
            codes.append("tool_section_malformed")
    n_eot = seq.count(eot)
    if rc.stopped != (n_eot == 1 and bool(ids) and ids[-1] == eot) or n_eot > 1:
        codes.append("end_of_turn_misplaced")
    return list(dict.fromkeys(codes))


def sample_stats(sample: Sample, tokenizer: Tokenizer, family: ModelFamily) -> SampleStats:
    p, rc = sample.parsed, sample.completion
    return SampleStats(
        id=sample.id,
        provider=p.provider or "unknown",
        finish_reason=p.finish_reason,
        prompt_len=len(sample.prompt_ids),
        completion_len=len(rc.ids),
        reasoning_len=rc.reasoning_tokens,
        has_eot=rc.stopped,
        billed_prompt=p.prompt_tokens,
        billed_completion=p.completion_tokens,
        billed_reasoning=p.reasoning_tokens,
        codes=structural_codes(sample, tokenizer, family),
        has_tools=bool(sample.request.get("tools")),
    )


def learn_conventions(stats: Iterable[SampleStats]) -> dict[str, dict]:
    """Per provider, and per provider and finish reason: which known convention its billed
    completion counts follow.

    Only samples ending in end-of-turn tell the conventions apart; the convention with more exact
    agreements wins (``counts_eot`` on a tie); a group none of whose samples agree under either is
    ``unknown``. Serving stacks may count differently after a tool-call section than after plain
    text, so each finish reason gets its own convention when its samples support one; it falls
    back to the provider's overall convention otherwise; a finish reason other than ``stop`` never counts
    ``<|im_end|>`` where the provider's plain answers do not (:func:`group_convention`). Only the two known conventions are ever
    accepted, never an offset."""
    support: dict[str, Counter] = {}
    by_finish: dict[tuple[str, str], Counter] = {}
    for s in stats:
        c = support.setdefault(s.provider, Counter())
        f = by_finish.setdefault((s.provider, s.finish_reason or ""), Counter())
        vote = count_vote(s)
        if vote is not None:
            c[vote] += 1
            f[vote] += 1
    groups: dict[str, dict[str, Counter]] = {}
    for (provider, finish), c in by_finish.items():
        groups.setdefault(provider, {})[finish] = c
    return {provider: provider_conventions(c, groups.get(provider, {})) for provider, c in support.items()}


def provider_conventions(support: Mapping[str, int], by_finish: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
    """A provider's learned conventions from its votes: overall (``support``) and per finish reason
    (``by_finish``; a group without a vote is left out), each group's under :func:`group_convention`
    (the ``stop`` group first: the others are held to it)."""
    out: dict[str, Any] = {"convention": pick_convention(+Counter(support)), "support": dict(support), "by_finish": {}}
    for finish in sorted(by_finish, key=lambda f: f != "stop"):
        c = +Counter(by_finish[finish])
        if c:
            out["by_finish"][finish] = {"convention": group_convention(pick_convention(c), finish, reference_convention(out)),
                                        "support": dict(by_finish[finish])}
    return out


def reference_convention(learned: Mapping[str, Any], own_vote: str | None = None) -> str:
    """What a provider's plain answers follow: its ``stop`` group's convention, else its own (``own_vote``
    left out of the latter's support: a sample never proves itself)."""
    stop = (learned.get("by_finish") or {}).get("stop")
    if stop and stop.get("convention", "unknown") != "unknown":
        return stop["convention"]
    if own_vote is None:
        return learned.get("convention", "unknown")
    return _pick_without(learned.get("support") or {}, own_vote)


def group_convention(group: str, finish: str | None, reference: str) -> str:
    """A finish reason's convention given its samples' pick (``group``) and what the provider's plain
    answers follow (``reference``, :func:`reference_convention`): the group's, except that another
    finish reason than ``stop`` never counts ``<|im_end|>`` where the plain answers do not. Provider
    transformations lose tokens (a stripped space, compacted arguments), and a sample one token short
    agrees under ``counts_eot`` with a provider that excludes it: tool-call answers sharing such a loss
    (a stripped ``\n\n`` after ``</think>``) outvoted their group and were admitted with the token
    missing. Real stacks that count differently after a tool-call section exclude it there (recorded:
    Moonshot AI and Novita count it after text, not after tool calls), whatever the mix of a dataset's
    answers; a group that really counted it would be judged one token long, a mismatch, never a wrong
    id admitted."""
    if (finish or "") != "stop" and group == COUNTS_EOT and reference == EXCLUDES_EOT:
        return reference
    return group


def count_vote(s: SampleStats) -> str | None:
    """The convention this sample's billed completion count agrees under, when the sample can tell
    them apart (it ends in end-of-turn, is billed, has no error): its one vote in its group's
    support. The two conventions differ by one token, so a count agrees under one at most.

    A sample whose count a known provider transformation may have moved by a token casts no vote:
    one whose end-of-turn may stand for a trimmed stop string (``stop_sequence_requested``), and one
    whose tool-call arguments came as compact JSON (``tool_arguments_compact``): a provider that
    re-serializes them bills the model's spaced arguments, so a call whose compaction saved one
    token agrees under the other convention with ids the model never produced. Tool-call answers
    are mostly such samples, so their votes could flip their finish reason's convention (and, in a
    dataset of tool calls, the provider's) and admit the compact ids as exact."""
    if not s.has_eot or s.billed_completion is None or any(REASONS[k][0] == "error" for k in s.codes) \
            or "stop_sequence_requested" in s.codes \
            or "tool_arguments_compact" in s.codes:
        return None
    return next((conv for conv in CONVENTIONS if s.completion_diff(conv) == 0), None)


def pick_convention(c: Counter) -> str:
    if not c:
        return "unknown"
    return max(CONVENTIONS, key=lambda k: (c[k], k == COUNTS_EOT))


def convention_for(conventions: Mapping[str, Mapping], provider: str, finish_reason: str | None,
                   own_vote: str | None = None) -> str:
    """The convention a (provider, finish reason) group's samples are judged under: the group's, else
    the provider's. With ``own_vote`` (the judged sample's :func:`count_vote`), that vote is left out
    of the support first, so a sample never proves itself: a group whose only support is the sample
    falls back to the provider's other samples, and a provider whose only support it is judges it
    under no convention (``unknown``). Otherwise one sample with a token too many could pick the
    convention under which its count agrees."""
    p = conventions.get(provider) or {}
    group = (p.get("by_finish") or {}).get(finish_reason or "")
    if own_vote is None:
        return group["convention"] if group else p.get("convention", "unknown")
    if group:
        conv = _pick_without(group.get("support") or {}, own_vote)
        if conv != "unknown":
            # the reference: the stop group's (this sample's vote is not in it, or this is that group) else the
            # provider's without this vote
            return group_convention(conv, finish_reason, reference_convention(p, own_vote))
    return _pick_without(p.get("support") or {}, own_vote)


def _pick_without(support: Mapping[str, int], vote: str) -> str:
    c = Counter(support)
    c[vote] -= 1
    return pick_convention(+c)


def verdict(stats: SampleStats, convention: str, reasoning_checked: bool = True) -> tuple[str, list[str]]:
    """(verdict, reasons) of one sample under its provider's convention. ``reasoning_checked=False``
    (a provider whose reasoning count is learned not to be a checksum) leaves the reasoning split
    unchecked and says so; the completion total is checked either way."""
    codes = list(stats.codes)
    if convention == "unknown":
        if stats.billed_completion is not None and not _has(codes, "error"):
            codes.append("unknown_count_convention")
    else:
        diff = stats.completion_diff(convention)
        if diff not in (None, 0):
            codes.append("completion_count_mismatch")
    br = stats.billed_reasoning
    if br is not None:
        if br == 0 and stats.reasoning_len > 0:
            codes.append("reasoning_count_unreported")
        elif br > 0 and br not in (stats.reasoning_len, stats.reasoning_len + 1):
            codes.append("reasoning_count_mismatch" if reasoning_checked else "reasoning_count_unchecked")
    witnessed = reasoning_checked and br is not None and br > 0 and br in (stats.reasoning_len, stats.reasoning_len + 1)
    if "content_empty_after_reasoning" in codes and not witnessed:
        codes.append("reasoning_boundary_unproven")
    if stats.prompt_diff not in (None, 0):
        codes.append("prompt_count_mismatch")
    return verdict_of(codes), codes


def verdict_of(codes: list[str]) -> str:
    severities = {REASONS[c][0] for c in codes}
    if "error" in severities:
        return "error"
    if "block" in severities:
        return "mismatch"
    if "repair" in severities:
        return "repaired"
    return "exact"


COUNT_CODES = frozenset({"completion_count_mismatch", "reasoning_count_mismatch"})


def repairable(codes: list[str]) -> bool:
    """A completion whose only blocking reasons are completion count differences (a repair may
    explain them). A prompt count mismatch is judged separately: it keeps the sample a mismatch
    either way, but the completion ids can still be repaired."""
    blocking = {c for c in codes if REASONS[c][0] in ("block", "error")} - PROMPT_CODES
    return bool(blocking) and blocking <= COUNT_CODES


def completion_verified(codes: list[str]) -> bool:
    """Every completion-side check passes (the prompt may still differ)."""
    return completion_verdict(codes) in ("exact", "repaired")


#: Reasons about the prompt side only; every other reason is about the completion (or the whole
#: record: an error, an unrenderable prompt).
PROMPT_CODES = frozenset({"prompt_count_mismatch", "prompt_order_unproven", "prompt_path_differs"})


def completion_verdict(codes: list[str]) -> str:
    """The completion's verdict (``exact`` | ``repaired`` | ``mismatch`` | ``error``): every reason
    but the prompt-side ones."""
    return verdict_of([c for c in codes if c not in PROMPT_CODES])


def prompt_verdict(stats: SampleStats, sorts_tool_keys: bool = False, request_order_explains: bool = False) -> str:
    """The prompt's verdict: ``exact`` (our canonical rendering has the billed count, and no other
    rendering a provider is known to use has it too), ``unproven`` (it has the billed count, but so
    has the tools' declaration in the request's own key order, which is other ids, and the provider
    is not proven to sort the keys: ``sorts_tool_keys``, learned from its other samples, see
    :func:`eagledata.tokens.learning.provider_sorts_tool_keys`; or the provider is learned to render
    the request's key order with an offset that explains this count too: ``request_order_explains``,
    :func:`eagledata.tokens.learning.request_order_explains`), ``differs``, ``unbilled`` (no prompt
    count to check against) or ``error`` (the prompt could not be rendered)."""
    if "prompt_unrenderable" in stats.codes:
        return "error"
    diff = stats.prompt_diff
    if diff is None:
        return "unbilled"
    if diff != 0:
        return "differs"
    if request_order_explains:  # the provider's learned rendering (request's key order + offset) has it too
        return "unproven"
    return "unproven" if stats.key_order_vote() == "tied" and not sorts_tool_keys else "exact"


def _has(codes: list[str], severity: str) -> bool:
    return any(REASONS[c][0] == severity for c in codes)


def explain(codes: Iterable[str]) -> list[str]:
    return [f"{c}: {REASONS[c][1]}" for c in codes]


VERDICTS = ("exact", "repaired", "mismatch", "error")
PROMPT_VERDICTS = ("exact", "unproven", "differs", "unbilled", "error")

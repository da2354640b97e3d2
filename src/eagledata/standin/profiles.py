"""Provider profiles: how one upstream provider turns completion ids into a response.

:func:`decode_completion` splits the ids at the family's special ids and decodes each text run, as a
serving stack's reasoning and tool-call parsers do. A :class:`ProviderProfile` then applies its quirks:
``completion_hooks`` change the ids themselves (quirks of the served MODEL: a non-canonical BPE
split, a provider-side length cap, another prompt rendering) before decoding; ``hooks`` change the
decoded message (rewritten tool-call ids, tool markup in content, stripped whitespace, ...). Count
conventions (``counts_end_of_turn``, ``reasoning_tokens_include_close``, ``reasoning_count_noise``)
are fields of the profile. :data:`PROFILES` names the built-in ones.
"""

from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

from eagledata.standin.model import Completion
from eagledata.text.chat import prompt_ids, request_thinking
from eagledata.text.families import ModelFamily
from eagledata.text.tokenizer import Tokenizer
from eagledata.tokens.reconstruct import Segment

#: OpenRouter's keep-alive padding before a JSON body, as seen in the recorded traffic.
JSON_PADDING = "\n         \n\n"

@dataclass
class ProviderMessage:
    """The response fields a provider builds from the completion ids (mutable by quirk hooks)."""

    reasoning: str | None
    content: str
    tool_calls: list[dict[str, str]]  # {"id", "name", "arguments"}
    finish_reason: str
    native_finish_reason: str
    completion_tokens: int
    reasoning_tokens: int


def decode_completion(ids: Sequence[int], tok: Tokenizer, family: ModelFamily, thinking: bool,
                      finish_reason: str) -> ProviderMessage:
    """Split completion ids at the family's special ids and decode each text run, as a serving
    stack's reasoning and tool-call parsers do. An unfinished tool call (truncation) is dropped."""
    sid = {name: tok.special_id(name) for name in family.completion_specials()}
    n = len(ids)

    def find(start: int, *names: str) -> int:
        targets = {sid[x] for x in names}
        for j in range(start, n):
            if ids[j] in targets:
                return j
        return n

    i = 0
    reasoning = None
    reasoning_tokens = 0
    if thinking:
        if not family.think_in_prompt and n and ids[0] == sid[family.think_open]:
            i = 1
        j = find(i, family.think_close)
        reasoning, reasoning_tokens = tok.decode(ids[i:j]), j - i
        i = min(j + 1, n)
    j = find(i, family.tool_section_begin, family.end_of_turn)
    content = tok.decode(ids[i:j])
    calls: list[dict[str, str]] = []
    if j < n and ids[j] == sid[family.tool_section_begin]:
        i = j + 1
        id_re = re.compile(family.tool_call_id_pattern)
        while i < n and ids[i] == sid[family.tool_call_begin]:
            a = find(i + 1, family.tool_argument_begin)
            e = find(a + 1, family.tool_call_end)
            if e >= n:
                break
            call_id = tok.decode(ids[i + 1:a])
            m = id_re.fullmatch(call_id)
            calls.append({"id": call_id, "name": m.group("name") if m else call_id,
                          "arguments": tok.decode(ids[a + 1:e])})
            i = e + 1
    return ProviderMessage(reasoning, content, calls, finish_reason, finish_reason, n, reasoning_tokens)


@dataclass
class QuirkContext:
    rng: random.Random
    family: ModelFamily
    request: Mapping[str, Any]
    tokenizer: Tokenizer | None = None


Hook = Callable[[ProviderMessage, QuirkContext], None]
#: A quirk of the provider's MODEL (its ids themselves), applied to the truth before decoding.
CompletionHook = Callable[[Completion, QuirkContext], Completion]


def strip_leading_whitespace(msg: ProviderMessage, ctx: QuirkContext) -> None:
    msg.content = msg.content.lstrip()
    if msg.reasoning is not None:
        msg.reasoning = msg.reasoning.lstrip()


def rewrite_tool_ids(msg: ProviderMessage, ctx: QuirkContext) -> None:
    """Replace native ids with provider ids (``call_...``), as several providers do."""
    alphabet = string.ascii_letters + string.digits
    for call in msg.tool_calls:
        call["id"] = "call_" + "".join(ctx.rng.choice(alphabet) for _ in range(24))


def index_tool_ids(msg: ProviderMessage, ctx: QuirkContext) -> None:
    """Tool-call ids replaced by the call's position in the response (``0``, ``1``)."""
    for i, call in enumerate(msg.tool_calls):
        call["id"] = str(i)


def name_index_tool_ids(msg: ProviderMessage, ctx: QuirkContext) -> None:
    """Tool-call ids as ``NAME:i`` (``weather:0``), without the ``functions.`` prefix."""
    for i, call in enumerate(msg.tool_calls):
        call["id"] = f"{call['name']}:{i}"


def _tool_markup(msg: ProviderMessage, f: ModelFamily) -> str:
    calls = "".join(f"{f.tool_call_begin}{c['id']}{f.tool_argument_begin}{c['arguments']}{f.tool_call_end}"
                    for c in msg.tool_calls)
    return f"{f.tool_section_begin}{calls}{f.tool_section_end}"


def tool_markup_in_content(msg: ProviderMessage, ctx: QuirkContext) -> None:
    """Return the raw tool-call section inside content instead of structured tool_calls."""
    if not msg.tool_calls:
        return
    msg.content += _tool_markup(msg, ctx.family)
    msg.tool_calls = []
    msg.finish_reason = "stop"


def tool_markup_in_reasoning(msg: ProviderMessage, ctx: QuirkContext) -> None:
    """The tool-call section ends up at the end of the reasoning (a parser that never saw the
    think block close), no structured tool_calls."""
    if not msg.tool_calls or msg.reasoning is None:
        return
    msg.reasoning += _tool_markup(msg, ctx.family)
    msg.tool_calls = []
    msg.finish_reason = "stop"


def compact_tool_arguments(msg: ProviderMessage, ctx: QuirkContext) -> None:
    """Tool-call arguments re-serialized as compact JSON (``{"a":1}`` for the model's ``{"a": 1}``),
    as a provider that parses and re-dumps them does. Arguments that are no JSON stay as they are."""
    for call in msg.tool_calls:
        try:
            call["arguments"] = json.dumps(json.loads(call["arguments"]), separators=(",", ":"), ensure_ascii=False)
        except (ValueError, RecursionError):
            pass


def sorted_compact_tool_arguments(msg: ProviderMessage, ctx: QuirkContext) -> None:
    """Tool-call arguments re-serialized compact with keys sorted and non-ASCII escaped
    (``json.dumps(sort_keys=True, separators=(",", ":"))``; Go's maps and Rust's ``BTreeMap`` sort keys
    alike): the model's key order is gone, at the same token count."""
    for call in msg.tool_calls:
        try:
            call["arguments"] = json.dumps(json.loads(call["arguments"]), sort_keys=True, separators=(",", ":"))
        except (ValueError, RecursionError):
            pass


def drop_reasoning(msg: ProviderMessage, ctx: QuirkContext) -> None:
    msg.reasoning = None


def json_tool_declaration(c: Completion, ctx: QuirkContext) -> Completion:
    """The provider renders the prompt with the tools declared as JSON (the chat template's fallback)
    instead of the model's own declaration: the model saw, and the provider bills, that prompt."""
    tools = ctx.request.get("tools")
    if not tools or ctx.tokenizer is None:
        return c
    ids = prompt_ids(ctx.tokenizer, ctx.request["messages"], tools, thinking=request_thinking(ctx.request),
                     tool_declaration="json")
    return replace(c, prompt_ids=ids, quirks=c.quirks + ["prompt:json_tools"])


def unsorted_tool_declaration(c: Completion, ctx: QuirkContext) -> Completion:
    """The provider declares the tools in the request's own key order, skipping the deep sort of the
    model's tokenizer code (K2 Thinking, K2.5): the model saw, and the provider bills, that prompt. The
    same keys in another order: usually the same number of tokens, other ids."""
    tools = ctx.request.get("tools")
    if not tools or ctx.tokenizer is None:
        return c
    ids = prompt_ids(ctx.tokenizer, ctx.request["messages"], tools, thinking=request_thinking(ctx.request),
                     sort_tool_keys=False)
    return replace(c, prompt_ids=ids, quirks=c.quirks + ["prompt:unsorted_tools"])


def template_variant_minus_one(c: Completion, ctx: QuirkContext) -> Completion:
    """The provider's chat template renders one token fewer on every prompt (here: without the
    first token), with and without tools."""
    return replace(c, prompt_ids=c.prompt_ids[1:], quirks=c.quirks + ["prompt:-1"])


def noncanonical_split(c: Completion, ctx: QuirkContext) -> Completion:
    """The provider's model emitted a NON-CANONICAL BPE split of one word: one token of a content
    (else reasoning) segment is replaced by two tokens whose text is the same. The text is
    identical, the ids differ, and the billed count is one more than a canonical re-encoding
    gives. Recorded in ``Completion.quirks`` as ``noncanonical@POS``."""
    tok = ctx.tokenizer
    if tok is None:
        return c
    candidates: list[tuple[int, list[int]]] = []
    for kind in ("content", "reasoning", "tool_arguments"):
        for seg in (s for s in c.segments if s.kind == kind and s.text):
            for pos in range(seg.start, seg.end):
                piece = tok.decode([c.ids[pos]])
                if len(piece) < 3 or "\ufffd" in piece:
                    continue
                for cut in range(1, len(piece)):
                    a, b = tok.encode_plain(piece[:cut]), tok.encode_plain(piece[cut:])
                    if len(a) == 1 and len(b) == 1 and tok.decode(a + b) == piece:
                        candidates.append((pos, a + b))
                        break
                if len(candidates) >= 8:
                    break
            if len(candidates) >= 8:
                break
        if candidates:
            break
    if not candidates:
        return c
    pos, pair = ctx.rng.choice(candidates)
    ids = c.ids[:pos] + pair + c.ids[pos + 1:]
    segments = [Segment(s.kind, s.start + (s.start > pos), s.end + (s.end > pos), s.text, s.call) for s in c.segments]
    return replace(c, ids=ids, segments=segments, quirks=c.quirks + [f"noncanonical@{pos}"])


def provider_length_cap(c: Completion, ctx: QuirkContext) -> Completion:
    """The provider stops the model at its own output cap (half the completion here): finish
    ``length``, no end of turn, possibly inside the reasoning (then the content is empty)."""
    if len(c.ids) < 4:
        return c
    n = max(1, len(c.ids) // 2)
    kept = [s if s.end <= n else Segment(s.kind, s.start, n, ctx.tokenizer.decode(c.ids[s.start:n]) if s.text is not None and ctx.tokenizer else s.text, s.call)
            for s in c.segments if s.start < n]
    return replace(c, ids=c.ids[:n], segments=kept, stopped=False, finish_reason="length", quirks=c.quirks + [f"cap@{n}"])


@dataclass(frozen=True)
class ProviderProfile:
    """How one upstream provider reports a completion.

    ``counts_end_of_turn``: whether ``usage.completion_tokens`` counts the final end-of-turn id.
    ``reasoning_tokens_include_close``: ``reasoning_tokens`` also counts ``</think>``.
    ``reasoning_count_noise``: ``(low, high)``: the reported ``reasoning_tokens`` is off by a
    nonzero amount in that range (never 0 or +1), drawn per request: a count that is not a checksum
    (the completion total stays exact).
    ``completion_hooks``: quirks of the served MODEL, applied to the token ids (the truth) before
    they are decoded; ``hooks``: quirks of the provider's response building, applied in order to
    the decoded message. Add a quirk by writing a hook and registering a profile with it.
    """

    name: str
    counts_end_of_turn: bool = True
    reasoning_tokens_include_close: bool = False
    reasoning_count_noise: tuple[int, int] | None = None
    provider_name: str = "Simulator"
    json_padding: str = JSON_PADDING
    hooks: tuple[Hook, ...] = ()
    completion_hooks: tuple[CompletionHook, ...] = ()

    def with_hooks(self, name: str, *hooks: Hook, **changes: Any) -> "ProviderProfile":
        return replace(self, name=name, hooks=self.hooks + hooks, **changes)


_EXACT = ProviderProfile("exact")
PROFILES: dict[str, ProviderProfile] = {
    p.name: p
    for p in [
        _EXACT,
        replace(_EXACT, name="no-eot", counts_end_of_turn=False),
        replace(_EXACT, name="reasoning-counts-close", reasoning_tokens_include_close=True),
        _EXACT.with_hooks("strip-whitespace", strip_leading_whitespace),
        _EXACT.with_hooks("call-ids", rewrite_tool_ids),
        _EXACT.with_hooks("call-ids-index", index_tool_ids),
        _EXACT.with_hooks("call-ids-name", name_index_tool_ids),
        _EXACT.with_hooks("markup-in-content", tool_markup_in_content),
        _EXACT.with_hooks("markup-in-reasoning", tool_markup_in_reasoning),
        _EXACT.with_hooks("drop-reasoning", drop_reasoning),
        replace(_EXACT, name="truncating", completion_hooks=(provider_length_cap,)),
        replace(_EXACT, name="noncanonical", completion_hooks=(noncanonical_split,)),
        _EXACT.with_hooks("no-eot-call-ids", rewrite_tool_ids, counts_end_of_turn=False),
        _EXACT.with_hooks("no-eot-strip-whitespace", strip_leading_whitespace, counts_end_of_turn=False),
        _EXACT.with_hooks("compact-args", compact_tool_arguments),
        _EXACT.with_hooks("no-eot-compact-args", compact_tool_arguments, counts_end_of_turn=False),
        _EXACT.with_hooks("sorted-compact-args", sorted_compact_tool_arguments),
        replace(_EXACT, name="json-tools", completion_hooks=(json_tool_declaration,)),
        replace(_EXACT, name="unsorted-tools", completion_hooks=(unsorted_tool_declaration,)),
        replace(_EXACT, name="template-minus-one", completion_hooks=(template_variant_minus_one,)),
        replace(_EXACT, name="unreliable-reasoning", reasoning_count_noise=(-6, 9)),
        _EXACT.with_hooks("unreliable-reasoning-strip", strip_leading_whitespace, reasoning_count_noise=(-6, 9)),
    ]
}


def count_noise(bounds: tuple[int, int], key: str) -> int:
    """A nonzero offset in ``bounds`` other than +1 (an agreeing count), fixed per ``key``."""
    choices = [d for d in range(bounds[0], bounds[1] + 1) if d not in (0, 1)]
    return random.Random(key).choice(choices)


def get_profile(profile: str | ProviderProfile) -> ProviderProfile:
    """A profile given by name (one of :data:`PROFILES`) or itself."""
    if isinstance(profile, ProviderProfile):
        return profile
    try:
        return PROFILES[profile]
    except KeyError:
        raise KeyError(f"unknown simulator provider profile {profile!r}; known: {sorted(PROFILES)}") from None

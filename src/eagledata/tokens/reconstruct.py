"""Rebuild a completion's exact token ids from a provider's text response.

A completion of a chat model (see :class:`~eagledata.text.families.ModelFamily`) is, in order:
``[think_open]`` (thinking families whose prompt does not end with it), reasoning text,
``think_close``, content text, an optional tool-call section, and ``end_of_turn`` when the model
stopped by itself. Each text segment is encoded on its own as plain text (special-token text written
by the model stays ordinary tokens) and the special ids, looked up by name, are inserted between.

Provider deviations handled here (each recorded as a flag, never silently):

* reasoning returned inside ``content`` between think tags (``reasoning_in_content``);
* tool calls returned as raw markup inside content or reasoning (``tool_markup_in_content`` /
  ``tool_markup_in_reasoning``) instead of structured ``tool_calls``;
* tool-call ids that are not the model's native ``functions.NAME:IDX``: rebuilt with the
  conversation-wide index, the original kept in ``tool_id_rewrites`` (``tool_id_rebuilt``);
* U+FFFD in text: bytes were lost before we saw them (``lossy_text``);
* truncation (``finish_reason: length``) or an error: no end-of-turn token.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Mapping, NamedTuple, Sequence

import orjson

from eagledata.text.families import ModelFamily
from eagledata.tokens.responses import ParsedResponse, ToolCall
from eagledata.text.tokenizer import Tokenizer

STOP_REASONS = frozenset({"stop", "tool_calls", "end_turn", "eos"})

#: Segment kinds that hold text (encoded as plain text); every other kind is one special token.
TEXT_KINDS = frozenset({"reasoning", "content", "tool_id", "tool_arguments"})


class Segment(NamedTuple):
    """``ids[start:end]`` of the completion. ``text`` for text kinds; ``call`` numbers the tool call.
    (Immutable; a named tuple rather than a frozen dataclass, whose construction costs four times as
    much: a completion has a segment per text and special token, built again for each repair candidate.)"""

    kind: str
    start: int
    end: int
    text: str | None = None
    call: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "start": self.start, "end": self.end}
        if self.text is not None:
            d["text"] = self.text
        if self.call is not None:
            d["call"] = self.call
        return d


def segments_json(segments: Sequence[Segment]) -> str:
    """``json.dumps([s.to_dict() for s in segments], ensure_ascii=False)``, byte for byte, about
    five times faster: the segments' texts (most of a completion's characters) are escaped by
    orjson, whose output for a string equals the standard library's without ASCII escaping (every
    code point checked: tests/test_reconstruct.py), and the rest is written out in the standard
    library's spelling (``", "``, ``": "``). A text orjson refuses (a lone surrogate) falls back to
    the standard library."""
    try:
        return "[" + ", ".join(_segment_json(s) for s in segments) + "]"
    except TypeError:
        return json.dumps([s.to_dict() for s in segments], ensure_ascii=False)


def _segment_json(s: Segment) -> str:
    out = f'{{"kind": {orjson.dumps(s.kind).decode()}, "start": {int(s.start)}, "end": {int(s.end)}'
    if s.text is not None:
        out += f', "text": {orjson.dumps(s.text).decode()}'
    if s.call is not None:
        out += f', "call": {int(s.call)}'
    return out + "}"


@dataclass
class Reconstruction:
    ids: list[int]
    segments: list[Segment]
    flags: list[str] = field(default_factory=list)
    tool_id_rewrites: list[dict[str, Any]] = field(default_factory=list)
    stopped: bool = False
    thinking: bool = False

    @property
    def reasoning_tokens(self) -> int:
        return sum(s.end - s.start for s in self.segments if s.kind == "reasoning")

    def segment_text(self, kind: str) -> str:
        return "".join(s.text or "" for s in self.segments if s.kind == kind)


def count_tool_calls(messages: Sequence[Mapping[str, Any]]) -> int:
    """Number of tool calls made by assistant messages of a conversation (the index offset of the
    next call, since the model's native ids count calls across the whole conversation)."""
    return sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")


def _markup_regex(family: ModelFamily) -> re.Pattern[str]:
    return _markup_regex_for(family.tool_call_begin, family.tool_argument_begin, family.tool_call_end)


@lru_cache(maxsize=64)
def _markup_regex_for(begin: str, arg_begin: str, end: str) -> re.Pattern[str]:
    e = re.escape
    return re.compile(f"{e(begin)}(?P<id>.*?){e(arg_begin)}(?P<args>.*?){e(end)}", re.DOTALL)


def split_tool_markup(text: str, family: ModelFamily) -> tuple[str, list[ToolCall], str] | None:
    """Split ``text`` holding a raw tool-call section into (text before, calls, text after the
    section). ``None`` when the text holds no section."""
    pos = text.find(family.tool_section_begin)
    if pos < 0:
        return None
    before, rest = text[:pos], text[pos + len(family.tool_section_begin):]
    end = rest.find(family.tool_section_end)
    body, after = (rest, "") if end < 0 else (rest[:end], rest[end + len(family.tool_section_end):])
    calls = []
    id_re = re.compile(family.tool_call_id_pattern)
    for i, m in enumerate(_markup_regex(family).finditer(body)):
        raw_id = m.group("id")
        native = id_re.fullmatch(raw_id)
        calls.append(ToolCall(raw_id, native.group("name") if native else "", m.group("args"), i))
    return before, calls, after


def _split_think_tags(content: str, family: ModelFamily) -> tuple[str, str] | None:
    close = content.find(family.think_close)
    if close < 0:
        return None
    reasoning = content[:close]
    stripped = reasoning.lstrip()
    if stripped.startswith(family.think_open):
        reasoning = stripped[len(family.think_open):]
    return reasoning, content[close + len(family.think_close):]


class _Builder:
    def __init__(self, tokenizer: Tokenizer, family: ModelFamily):
        self.tok = tokenizer
        self.family = family
        self.ids: list[int] = []
        self.segments: list[Segment] = []

    def special(self, kind: str, name: str, call: int | None = None) -> None:
        start = len(self.ids)
        self.ids.append(self.tok.special_id(name))
        self.segments.append(Segment(kind, start, start + 1, None, call))

    def text(self, kind: str, text: str, call: int | None = None) -> None:
        if not text:
            return
        start = len(self.ids)
        self.ids.extend(self.tok.encode_plain(text))
        self.segments.append(Segment(kind, start, len(self.ids), text, call))


def reconstruct_completion(
    parsed: ParsedResponse,
    tokenizer: Tokenizer,
    family: ModelFamily,
    tool_call_offset: int = 0,
    thinking: bool | None = None,
) -> Reconstruction:
    """Token ids of the completion behind ``parsed``.

    ``tool_call_offset``: tool calls already made earlier in the conversation
    (:func:`count_tool_calls` of the request's messages). ``thinking``: whether thinking was on
    for this request (``None``: the family's default). With thinking off, a thinking family's
    prompt already holds an empty think block, so the completion has none.
    """
    flags: list[str] = []
    thinking_on = family.thinking and thinking is not False
    reasoning, content, calls = recover_text(parsed, family, thinking_on, flags)
    stopped = parsed.error is None and parsed.finish_reason in STOP_REASONS
    truncated = parsed.finish_reason == "length"
    b = _Builder(tokenizer, family)
    if thinking_on:
        if not family.think_in_prompt:
            b.special("think_open", family.think_open)
        b.text("reasoning", reasoning)
        cut_inside_reasoning = (truncated or parsed.error is not None) and not content and not calls
        if not cut_inside_reasoning:
            b.special("think_close", family.think_close)
    elif reasoning:
        flags.append("reasoning_unexpected")
    b.text("content", content)
    rewrites = _tool_section(b, calls, family, tool_call_offset, flags) if calls else []
    if stopped:
        b.special("end_of_turn", family.end_of_turn)
    if any("\ufffd" in (s.text or "") for s in b.segments):
        flags.append("lossy_text")
    return Reconstruction(b.ids, b.segments, _unique(flags), rewrites, stopped, thinking_on)


def recover_text(parsed: ParsedResponse, family: ModelFamily, thinking_on: bool,
                  flags: list[str]) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, content, tool calls) as the model wrote them: reasoning a provider left inside
    think tags in the content, and tool-call markup a provider left in the text, put back in place."""
    reasoning = parsed.reasoning or ""
    content = parsed.content or ""
    calls = list(parsed.tool_calls)
    if thinking_on and not reasoning.strip() and family.think_close in content:
        split = _split_think_tags(content, family)
        if split is not None:
            reasoning, content = split
            flags.append("reasoning_in_content")
    for where in ("content", "reasoning"):
        found = split_tool_markup(content if where == "content" else reasoning, family)
        if found is None:
            continue
        before, markup_calls, after = found
        flags.append(f"tool_markup_in_{where}")
        if after.strip():
            flags.append("text_after_tool_section")
        if where == "content":
            content = before
        else:
            reasoning = before
        if not calls:
            calls = markup_calls
    return reasoning, content, calls


def _tool_section(b: "_Builder", calls: list[ToolCall], family: ModelFamily, tool_call_offset: int,
                  flags: list[str]) -> list[dict[str, Any]]:
    """Append the tool-call section; ids that are not the model's native ones are rebuilt with the
    conversation-wide index (returned as rewrites)."""
    rewrites: list[dict[str, Any]] = []
    b.special("tool_section_begin", family.tool_section_begin)
    id_re = re.compile(family.tool_call_id_pattern)
    for n, call in enumerate(calls):
        index = tool_call_offset + n
        native = id_re.fullmatch(call.id or "")
        if not call.name and native:
            call = ToolCall(call.id, native.group("name"), call.arguments, call.index)
        if not call.name:
            flags.append("tool_call_malformed")
        if native and native.group("name") == call.name:
            call_id = call.id or ""
            if int(native.group("index")) != index:
                flags.append("tool_id_index_unexpected")
        else:
            call_id = family.native_tool_call_id(call.name, index)
            rewrites.append({"call": n, "original": call.id, "rebuilt": call_id})
        b.special("tool_call_begin", family.tool_call_begin, n)
        b.text("tool_id", call_id, n)
        b.special("tool_argument_begin", family.tool_argument_begin, n)
        b.text("tool_arguments", call.arguments, n)
        b.special("tool_call_end", family.tool_call_end, n)
    b.special("tool_section_end", family.tool_section_end)
    if rewrites:
        flags.append("tool_id_rebuilt")
    return rewrites


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def segment_ids(ids: Sequence[int], tokenizer: Tokenizer, family: ModelFamily, thinking: bool,
                stopped: bool | None = None) -> Reconstruction:
    """Segments of completion ids that are known exactly (a local server returned them): the
    inverse of :func:`reconstruct_completion`. Text runs are decoded; their kind follows from the
    special tokens around them (reasoning until ``think_close`` for a thinking completion, then
    content; tool ids and arguments inside the tool-call section)."""
    kinds = {tokenizer.special_id(n): k for k, n in (
        ("think_close", family.think_close), ("think_open", family.think_open), ("end_of_turn", family.end_of_turn),
        ("tool_section_begin", family.tool_section_begin), ("tool_section_end", family.tool_section_end),
        ("tool_call_begin", family.tool_call_begin), ("tool_argument_begin", family.tool_argument_begin),
        ("tool_call_end", family.tool_call_end)) if k not in ("think_close", "think_open") or family.thinking}
    segments: list[Segment] = []
    state = "reasoning" if thinking else "content"
    call = -1
    run_start = 0

    def flush(end: int) -> None:
        if end > run_start:
            segments.append(Segment(state, run_start, end, tokenizer.decode(list(ids[run_start:end])),
                                    call if state in ("tool_id", "tool_arguments") else None))

    for i, t in enumerate(ids):
        kind = kinds.get(t)
        if kind is None:
            continue
        flush(i)
        if kind == "tool_call_begin":
            call += 1
        segments.append(Segment(kind, i, i + 1, None, call if kind.startswith("tool_call") or kind == "tool_argument_begin" else None))
        state = {"think_close": "content", "tool_section_begin": "content", "tool_call_begin": "tool_id",
                 "tool_argument_begin": "tool_arguments", "tool_call_end": "content"}.get(kind, state)
        run_start = i + 1
    flush(len(ids))
    eot = tokenizer.special_id(family.end_of_turn)
    if stopped is None:
        stopped = bool(ids) and ids[-1] == eot
    return Reconstruction(list(ids), segments, [], [], stopped, thinking)  # exact ids: nothing was lost

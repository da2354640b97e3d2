"""Token-level views of a completion: which positions each reason code implicates
(:data:`IMPLICATED`, :func:`implicated_tokens`), completion tokens decoded one by one into display
units (:func:`token_units`) and rendered as HTML chips (:func:`render_tokens`)."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from markupsafe import Markup

from eagledata.tokens.reconstruct import TEXT_KINDS

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
    "reasoning_boundary_unproven": ("suspect", "</think>: the content may have been returned inside the reasoning "
                                               "before it"),
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
    "tool_arguments_ambiguous": ("suspect", "the tool arguments (the model's spacing may or may not belong there)"),
    "tool_arguments_order_unproven": ("suspect", "the tool arguments (their keys may be in the provider's sorted order, "
                                                 "not the model's)"),
    "tool_arguments_compact": (None, "no token: the tool arguments came as compact JSON (this sample cast no "
                                     "count-convention vote)"),
    "tool_id_index_unexpected": ("suspect", "the tool-call ids (a native id's index differs from the conversation count)"),
    "prompt_count_mismatch": (None, "no completion token: the difference is in the prompt"),
    "prompt_order_unproven": (None, "no completion token: the prompt's tool key order is unproven"),
    "prompt_unrenderable": (None, "no completion token: the prompt could not be rendered"),
    "http_error": (None, "no completion token: the provider answered with an error"),
    "error_in_body": (None, "no completion token: the provider answered with an error"),
    "malformed_body": (None, "no completion token: the body could not be parsed"),
    "empty_response": (None, "no completion token: the response is empty"),
    "finish_unproven": (None, "no single token: the response's end is unproven (it may be cut off after the last one)"),
    "stop_sequence_requested": (None, "no single token: the end-of-turn may stand for a stop sequence the provider trimmed"),
    "completion_count_missing": (None, "no single token: the provider reported no completion count"),
    "unknown_count_convention": (None, "no single token: the provider's other samples support neither known convention"),
    "reasoning_unexpected": (None, "no token: the reasoning text returned without thinking is not in the ids"),
    "reasoning_count_unreported": (None, "no token: the provider reports 0 reasoning tokens"),
    "content_empty_after_reasoning": (None, "no token: the answer is reasoning alone"),
    "reasoning_count_unchecked": (None, "no token: this provider's reasoning count is not a checksum; the total was checked"),
    "engine_prompt_echo": (None, "no completion token: the prompt's ids the engine returned before them were cut"),
    "ground_truth_ids": (None, "no token: the serving engine returned these ids itself"),
    "text_path_differs": (None, "no token marked: the engine's ids are used; the text path would have differed"),
    "prompt_path_differs": (None, "no token: the engine's prompt ids differ from our template rendering"),
}

LEVEL_RANK = {"offending": 3, "suspect": 2, "repair": 1}
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
    elif code in ("reasoning_missing", "reasoning_boundary_unproven"):
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
    elif code in ("tool_arguments_respaced", "tool_arguments_ambiguous", "tool_arguments_order_unproven"):
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
                if level is None or LEVEL_RANK[lv] > LEVEL_RANK[level]:
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

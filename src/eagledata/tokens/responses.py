"""Parse one exact chat-completions response body (JSON or SSE) into a :class:`ParsedResponse`.

Accepted bodies: a JSON object (possibly preceded by keep-alive whitespace padding or a byte order
mark), or an SSE stream of ``data: {...}`` lines with ``: comment`` lines and a final ``data: [DONE]``.
Streams are read as the SSE format and a client read them: the stream ends at ``[DONE]`` (what follows
is not read), the ``data:`` lines of one event (up to a blank line) are one payload when only joined
(by line breaks) are they JSON, an unterminated last line that is not JSON is an event the server never
finished (dropped); text deltas are concatenated, tool-call deltas merged by index, the last ``usage``
seen kept. A message's or chunk's reasoning is the first non-empty of ``reasoning``,
``reasoning_content`` and the texts of ``reasoning_details`` (the same rule for a JSON body and for
each chunk of a stream).

Errors are values, never exceptions: an HTTP error status, an ``error`` object in a 200 body or in
a stream chunk, ``finish_reason: "error"``, a body that is not valid JSON/SSE, a text that is not a
string (content parts, a number, tool-call arguments as an object in a stream), or a response with
no choices all yield a :class:`ParsedResponse` with ``error`` set (``code``, ``message``, ``where``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from eagledata.io import loads_json
from eagledata.tokens.chunk_templates import ChunkTemplate, learn_chunk_template


@dataclass
class ToolCall:
    id: str | None
    name: str
    arguments: str
    index: int | None = None


@dataclass
class ResponseError:
    code: str | int | None
    message: str
    where: str  # http | body | stream | finish | malformed


@dataclass
class ParsedResponse:
    streamed: bool
    generation_id: str | None = None
    provider: str | None = None
    model: str | None = None
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    native_finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: ResponseError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def completion_tokens(self) -> int | None:
        return _int_or_none(_field(self.usage, "completion_tokens"))

    @property
    def prompt_tokens(self) -> int | None:
        return _int_or_none(_field(self.usage, "prompt_tokens"))

    @property
    def reasoning_tokens(self) -> int | None:
        return _int_or_none(_field(_field(self.usage, "completion_tokens_details"), "reasoning_tokens"))

    @property
    def cost(self) -> float | None:
        c = _number(_field(self.usage, "cost"))
        return float(c) if c is not None and c >= 0 else None  # (a negative charge is no price: estimated instead)


def _field(obj: Any, key: str) -> Any:
    """``obj[key]`` of an object; None for anything else (a usage that is not an object counts nothing)."""
    return obj.get(key) if isinstance(obj, dict) else None


def _number(v: Any) -> int | float | None:
    """A finite JSON number (not a boolean; NaN and Infinity, which the standard library reads, are no count)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return v if isinstance(v, int) or math.isfinite(v) else None


def _int_or_none(v: Any) -> int | None:
    n = _number(v)
    return int(n) if n is not None else None


def _error_from(obj: Any, where: str) -> ResponseError:
    if isinstance(obj, dict):
        return ResponseError(obj.get("code"), str(obj.get("message") or obj), where)
    return ResponseError(None, str(obj), where)


_SSE_FIELDS = ("data:", ":", "event:", "id:", "retry:")


def is_sse(raw: str) -> bool:
    return raw.lstrip("\ufeff \t\r\n").startswith(_SSE_FIELDS)


def _reasoning_from_details(details: Any) -> str | None:
    if not isinstance(details, list):
        return None
    texts = [d.get("text") for d in details if isinstance(d, dict) and isinstance(d.get("text"), str)]
    return "".join(texts) if texts else None


def _text_of(obj: Mapping[str, Any], key: str, where: str) -> str | None:
    """``obj[key]`` when it is a string or absent/null; raises ``ValueError`` for any other value
    (content parts, a number: no text to encode, never dropped silently)."""
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}.{key} is a {type(value).__name__}, not text")
    return value


def _reasoning_of(obj: Mapping[str, Any], where: str) -> str | None:
    """A message's or a chunk delta's reasoning: the first non-empty of ``reasoning``,
    ``reasoning_content`` and the texts of ``reasoning_details``; else ``""`` when one of them is an
    empty text, else ``None``. Raises ``ValueError`` when ``reasoning``/``reasoning_content`` is not text."""
    first = _text_of(obj, "reasoning", where)
    if first:
        return first
    second = _text_of(obj, "reasoning_content", where)
    if second:
        return second
    details = obj.get("reasoning_details")
    third = _reasoning_from_details(details) if details else None
    if third:
        return third
    return next((t for t in (first, second, third) if t is not None), None)


def parse_response(raw: str, status: int = 200) -> ParsedResponse:
    """Parse an exact response body. Never raises on bad input; see the module docstring."""
    raw = raw.removeprefix("\ufeff")
    streamed = is_sse(raw)
    try:
        parsed = _parse_sse(raw) if streamed else _parse_json(raw)
    except (ValueError, TypeError, AttributeError, KeyError, IndexError, RecursionError) as exc:
        parsed = ParsedResponse(streamed=streamed, error=ResponseError("malformed", f"unparseable body: {exc}", "malformed"))
    if status != 200 and parsed.error is None:
        parsed.error = ResponseError(status, f"HTTP {status}", "http")
    elif status != 200 and parsed.error is not None and parsed.error.where == "body":
        parsed.error.where = "http"
    if parsed.error is None and parsed.finish_reason == "error":
        parsed.error = ResponseError("finish_error", "finish_reason is 'error'", "finish")
    return parsed


def _parse_json(raw: str) -> ParsedResponse:
    body = loads_json(raw)
    out = ParsedResponse(streamed=False)
    if not isinstance(body, dict):
        out.error = ResponseError("malformed", "body is not a JSON object", "malformed")
        return out
    if "output_ids" in body and "meta_info" in body:
        return _parse_sglang_native(body)
    out.generation_id, out.provider, out.model = body.get("id"), body.get("provider"), body.get("model")
    out.usage = body.get("usage")
    if "error" in body and body["error"]:
        out.error = _error_from(body["error"], "body")
        return out
    choices = body.get("choices")
    if not choices:
        out.error = ResponseError("no_choices", "response has no choices", "body")
        return out
    if not isinstance(choices, list) or not isinstance(choices[0], dict):
        raise ValueError("choices is not a list of objects")
    choice = choices[0]
    msg = choice.get("message") or {}
    if not isinstance(msg, dict):
        raise ValueError("choices[0].message is not an object")
    if choice.get("error"):
        out.error = _error_from(choice["error"], "body")
    try:
        out.content, out.reasoning = _text_of(msg, "content", "message"), _reasoning_of(msg, "message")
    except ValueError as exc:  # content parts, a number...: no text to encode
        out.error = ResponseError("malformed", str(exc), "malformed")
        return out
    for i, tc in enumerate(msg.get("tool_calls") or []):
        fn = tc.get("function") or {}
        args = fn.get("arguments")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False) if args is not None else ""
        out.tool_calls.append(ToolCall(tc.get("id"), fn.get("name") or "", args, tc.get("index", i)))
    out.finish_reason = choice.get("finish_reason")
    out.native_finish_reason = choice.get("native_finish_reason")
    return out


def _until_done(lines: list[str]) -> tuple[list[str], bool]:
    """A stream's lines up to its ``data: [DONE]`` line (a client stops reading there: what follows is
    not part of the answer), and whether it has one. The spelling every server sends is found without
    a loop in Python; another (``data:[DONE]``, spaces) is looked for only in a stream without it (one
    before it is then read as a chunk that is not JSON: the stream is refused, never misread)."""
    try:
        return lines[:lines.index("data: [DONE]")], True
    except ValueError:
        pass
    for i, line in enumerate(lines):
        if _data_payload(line) == "[DONE]":
            return lines[:i], True
    return lines, False


def _unfinished(line: str) -> bool:
    """Whether ``line``, the last of a stream and not ended by a line break, is a ``data:`` line
    whose payload is not JSON: an event the server never finished (the SSE format drops it)."""
    payload = _data_payload(line)
    if not payload:
        return False
    try:
        loads_json(payload)
    except ValueError:
        return True
    return False


def _sse_payloads(lines: list[str]) -> list[str]:
    """The payloads of a stream's events in order. An event is its ``data:`` lines up to a blank
    line: one payload, joined by line breaks, when only so are they JSON (the SSE format's rule),
    else a payload per line (chunks with no blank line between them, as a client reading lines
    takes them; a JSON text followed by more is never JSON, so the two readings never compete)."""
    payloads: list[str] = []
    event: list[str] = []
    for line in lines:
        if not line:
            payloads += _event_payloads(event)
            event = []
            continue
        data = _data_payload(line)
        if data:
            event.append(data)
    return payloads + _event_payloads(event)


def _event_payloads(event: list[str]) -> list[str]:
    if len(event) < 2:
        return event
    joined = "\n".join(event)
    try:
        loads_json(joined)
    except ValueError:
        return event
    return [joined]


def _data_payload(line: str) -> str | None:
    """The payload of a ``data:`` line; None for comments (": OPENROUTER PROCESSING"), ``event:``,
    ``id:`` and blank lines."""
    return line[5:].strip(_JSON_SPACE) if line.startswith("data:") else None


_JSON_SPACE = " \t\r\n"  # the only white space JSON has (str.strip would also take U+00A0, U+2028...)


def _read_lines(lines: list[str], start: int, end: int, stream: "_StreamAssembly") -> None:
    """Fold the ``data:`` lines of ``lines[start:end]`` into ``stream`` in order, each its own
    chunk, until a text chunk teaches a template; the rest is then read by it
    (:func:`_read_templated`). Raises ``ValueError`` for a line that is not JSON (say, one line of
    a chunk the server cut over several: the plain reading joins them)."""
    for i in range(start, end):
        payload = _data_payload(lines[i])
        if payload:
            chunk = loads_json(payload)
            stream.add_chunk(chunk)
            fields = _text_fields(chunk) if stream.templates_left else None
            if fields:
                stream.templates_left -= 1
                template = learn_chunk_template(payload, chunk, fields)
                if template is not None:
                    _read_templated(lines, i + 1, end, template, stream)
                    return


def _texts_by_kind(kinds: tuple[str, ...], texts: list[list[str]]) -> list[tuple[str, list[str]]]:
    """A template's decoded holes as the stream's texts: its content, and line by line its reasoning
    as :func:`_reasoning_of` picks it (the reasoning hole when not empty, else the details hole)."""
    holes = dict(zip(kinds, texts))
    out = [("content", holes["content"])] if "content" in holes else []
    reasoning, details = holes.get("reasoning"), holes.get("details")
    if reasoning is not None and details is not None:
        out.append(("reasoning", [r or d for r, d in zip(reasoning, details)]))
    elif reasoning is not None or details is not None:
        out.append(("reasoning", reasoning if reasoning is not None else details))
    return out


def _read_templated(lines: list[str], start: int, end: int, template: ChunkTemplate,
                    stream: "_StreamAssembly") -> None:
    """Fold ``lines[start:end]`` into ``stream``: each line the template matches adds its texts
    (all decoded in one parse); the other lines between two matches are read by :func:`_read_lines`."""
    found, texts = template.match_lines(lines, start, end)
    per_hole = [(stream.texts[kind], hole) for kind, hole in _texts_by_kind(template.kinds, texts)]
    n = len(found)
    if n and found[-1] - found[0] == 2 * (n - 1) and not any(lines[found[0] + 1:found[-1]:2]):
        # the usual stream: every other line matched, blank lines between; only its ends can hold others
        steps: Any = ((0, found[0], start - 1), (n, end, found[-1]))
    else:
        steps = zip(range(n + 1), found + [end], [start - 1] + found)
    added = 0
    for k, i, prev in steps:  # k: the matched lines before line i; prev: the line before them
        gap = i - prev
        if gap > 2 or (gap == 2 and lines[i - 1]):  # a line between two matches that is not blank
            for into, hole in per_hole:
                into += hole[added:k]
            added = k
            _read_lines(lines, prev + 1, i, stream)
    for into, hole in per_hole:
        into += hole[added:]


def _text_fields(chunk: Any) -> dict[str, str] | None:
    """For a chunk whose only effect on the assembled answer (:meth:`_StreamAssembly.add_chunk`) is
    text appended, the keys of those texts -> what they are (content, reasoning, details); else None."""
    if not isinstance(chunk, dict) or chunk.get("usage") or chunk.get("error"):
        return None
    choices = chunk.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    delta = choice.get("delta")
    if choice.get("finish_reason") or choice.get("error") or not isinstance(delta, dict) or delta.get("tool_calls"):
        return None
    texts = {key: delta.get(key) for key in ("content", "reasoning", "reasoning_content")}
    if any(v is not None and not isinstance(v, str) for v in texts.values()) \
            or (texts["reasoning"] is not None and texts["reasoning_content"] is not None):
        return None  # not text (read plainly: refused), or two reasoning texts to choose from per line
    fields = {}
    if texts["content"] is not None:
        fields["content"] = "content"
    if texts["reasoning"] is not None:
        fields["reasoning"] = "reasoning"
    elif texts["reasoning_content"] is not None:
        fields["reasoning_content"] = "reasoning"
    details = delta.get("reasoning_details")
    if details:
        texts = [d for d in details if isinstance(d, dict) and isinstance(d.get("text"), str)] \
            if isinstance(details, list) else []
        if len(texts) > 1:
            return None
        if texts:
            fields["text"] = "details"
    return fields or None


def _add_tool_call_delta(calls: dict[int, ToolCall], tc: Mapping[str, Any]) -> None:
    """Fold one streamed tool-call fragment into the call at its ``index``. A fragment without one
    (the OpenAI format always has it) continues the last call begun, unless it carries another id
    than that call's: then it begins a new call. Raises ``ValueError`` for arguments that are not
    text (fragments of an object cannot be joined)."""
    idx = tc.get("index")
    if idx is not None and (not isinstance(idx, int) or isinstance(idx, bool)):
        raise ValueError(f"delta.tool_calls[].index is {idx!r}, not an integer")
    if idx is None:
        last = next(reversed(calls), None)
        new_id = tc.get("id")
        starts = last is None or bool(new_id and calls[last].id and new_id != calls[last].id)
        idx = (max(calls) + 1 if calls else 0) if starts else last
    fn = tc.get("function") or {}
    call = calls.setdefault(idx, ToolCall(None, "", "", idx))
    if tc.get("id") and not call.id:
        call.id = tc["id"]
    name = fn.get("name")
    if name and name != call.name:
        call.name += name
    args = fn.get("arguments")
    if isinstance(args, str):
        call.arguments += args
    elif args is not None:
        raise ValueError(f"delta.tool_calls[{idx}].function.arguments is a {type(args).__name__}, not text")


class _StreamAssembly:
    """A stream's answer as a client assembles it, one chunk at a time: text deltas concatenated,
    tool-call deltas merged by index, the last ``usage`` kept."""

    def __init__(self) -> None:
        self.out = ParsedResponse(streamed=True)
        self.texts: dict[str, list[str]] = {"content": [], "reasoning": []}
        self.calls: dict[int, ToolCall] = {}
        self.gid = self.provider = self.model = None
        self.done = False  # the stream has its [DONE]
        self.choices = False  # a chunk had a choice (a stream with none has no answer)
        # at most this many text-chunk templates are learned: a thinking stream needs two (reasoning,
        # then content); one that matches nothing costs a scan of the rest of the stream, so a stream
        # whose chunks all differ (say in a per-chunk timestamp) is soon read chunk by chunk
        self.templates_left = 4

    def add_chunk(self, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            raise ValueError("stream chunk is not a JSON object")
        out = self.out
        self.gid = self.gid or chunk.get("id")
        self.provider = self.provider or chunk.get("provider")
        self.model = self.model or chunk.get("model")
        usage = chunk.get("usage")
        if usage:
            out.usage = usage
        if chunk.get("error"):
            out.error = _error_from(chunk["error"], "stream")
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            if index != 0 or isinstance(index, bool):
                # the request asks one answer: a second choice would be merged into it
                raise ValueError(f"stream chunk has a choice of index {index!r}: one answer expected")
            self.choices = True
            delta = choice.get("delta")
            if delta:
                self._add_delta(delta)
            if choice.get("finish_reason"):
                out.finish_reason = choice["finish_reason"]
                out.native_finish_reason = choice.get("native_finish_reason")
            if choice.get("error"):
                out.error = _error_from(choice["error"], "stream")

    def _add_delta(self, delta: Mapping[str, Any]) -> None:
        text = _text_of(delta, "content", "delta")
        if text is not None:
            self.texts["content"].append(text)
        text = _reasoning_of(delta, "delta")
        if text is not None:
            self.texts["reasoning"].append(text)
        for tc in delta.get("tool_calls") or ():
            _add_tool_call_delta(self.calls, tc)

    def result(self) -> ParsedResponse:
        out, texts = self.out, self.texts
        out.generation_id, out.provider, out.model = self.gid or None, self.provider or None, self.model or None
        # a text seen at all, even empty, is a text ("" and None differ)
        out.content = "".join(texts["content"]) if texts["content"] else None
        out.reasoning = "".join(texts["reasoning"]) if texts["reasoning"] else None
        out.tool_calls = [self.calls[i] for i in sorted(self.calls)]
        if out.error is None and not self.done and out.finish_reason is None:
            out.error = ResponseError("stream_incomplete", "stream ended without finish_reason or [DONE]", "stream")
        if out.error is None and not self.choices:
            out.error = ResponseError("no_choices", "stream has no choices", "stream")
        return out


# a shorter stream is read the plain way: learning a template costs about what parsing 20 chunks does
_TEMPLATED_LINES = 80


def _parse_sse(raw: str) -> ParsedResponse:
    """Lines end at CRLF, CR or LF, as the SSE format says (``str.splitlines`` would also cut a line
    at a U+2028 or U+0085 that JSON allows raw inside a string); the stream ends at its ``[DONE]``.
    Text chunks are read through their stream's template (:mod:`eagledata.tokens.chunk_templates`);
    a stream that cannot be read whole that way (a chunk that is not JSON, not an object, cut over
    several lines...) is read again the plain way (:func:`_sse_payloads`), every chunk parsed on its
    own before any is folded, so its error is the one the plain reading reports."""
    if "\r" in raw:
        raw = raw.replace("\r\n", "\n").replace("\r", "\n")
    lines, done = _until_done(raw.split("\n"))
    if not done and lines[-1] and _unfinished(lines[-1]):  # a last line with no line break
        lines.pop()
    if len(lines) >= _TEMPLATED_LINES:
        stream = _StreamAssembly()
        stream.done = done
        try:
            _read_lines(lines, 0, len(lines), stream)
            return stream.result()
        except (ValueError, TypeError, AttributeError, KeyError, IndexError, RecursionError):
            pass
    stream = _StreamAssembly()
    stream.done = done
    for chunk in [loads_json(p) for p in _sse_payloads(lines)]:  # raises on the first that is not JSON
        stream.add_chunk(chunk)
    return stream.result()


def _parse_sglang_native(body: dict) -> ParsedResponse:
    """SGLang's native ``/generate`` answer: ``text``, ``output_ids``, ``meta_info`` (finish
    ``{type, matched}``, token counts). The text is the whole completion; the ids ride beside it."""
    meta = body.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    text = _text_of(body, "text", "body")  # raises for a text that is not one (malformed)
    out = ParsedResponse(streamed=False, generation_id=meta.get("id"), provider="SGLang", content=text,
                         finish_reason={"stop": "stop", "length": "length", "abort": "error"}.get(kind, kind),
                         usage={"prompt_tokens": meta.get("prompt_tokens"), "completion_tokens": meta.get("completion_tokens")})
    if kind == "abort":
        message = finish.get("message") if isinstance(finish, dict) else None
        out.error = ResponseError("abort", str(message or "request aborted"), "finish")
    return out


def prompt_echo(ids: Any, prompt: Any, count: Any, stop_to_append: bool = False) -> int | None:
    """How many ids at the start of an engine's returned ``ids`` repeat the end of its ``prompt``
    ids, by its own completion ``count`` (SGLang releases whose detokenizer returned its decode
    window, the prompt's last 5 ids and the output, as ``output_ids``: sgl-project/sglang issues
    #10896, #17240): 0 when the ids are not more than the count (or no count is known), ``k`` when
    the ``k`` ids too many are exactly the prompt's last ``k``, ``None`` when they are not.
    ``stop_to_append``: the ids leave out a matched stop id that will be appended (one id fewer)."""
    if not isinstance(count, int) or isinstance(count, bool) or not isinstance(ids, list):
        return 0
    k = len(ids) - count + (1 if stop_to_append else 0)
    if k <= 0:
        return 0
    if not isinstance(prompt, list) or k > len(prompt) or ids[:k] != prompt[-k:]:
        return None
    return k

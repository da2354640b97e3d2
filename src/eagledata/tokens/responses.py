"""Parse one exact chat-completions response body (JSON or SSE) into a :class:`ParsedResponse`.

Accepted bodies: a JSON object (possibly preceded by keep-alive whitespace padding), or an SSE
stream of ``data: {...}`` lines with ``: comment`` lines and a final ``data: [DONE]``. Streams are
assembled the way a client does: text deltas concatenated, tool-call deltas merged by index, the
last ``usage`` seen kept.

Errors are values, never exceptions: an HTTP error status, an ``error`` object in a 200 body or in
a stream chunk, ``finish_reason: "error"``, a body that is not valid JSON/SSE, or a response with no
choices all yield a :class:`ParsedResponse` with ``error`` set (``code``, ``message``, ``where``).
"""

from __future__ import annotations

import json
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
        return _int_or_none((self.usage or {}).get("completion_tokens"))

    @property
    def prompt_tokens(self) -> int | None:
        return _int_or_none((self.usage or {}).get("prompt_tokens"))

    @property
    def reasoning_tokens(self) -> int | None:
        details = (self.usage or {}).get("completion_tokens_details") or {}
        return _int_or_none(details.get("reasoning_tokens"))

    @property
    def cost(self) -> float | None:
        c = (self.usage or {}).get("cost")
        return float(c) if isinstance(c, (int, float)) else None


def _int_or_none(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _error_from(obj: Any, where: str) -> ResponseError:
    if isinstance(obj, dict):
        return ResponseError(obj.get("code"), str(obj.get("message") or obj), where)
    return ResponseError(None, str(obj), where)


def is_sse(raw: str) -> bool:
    head = raw.lstrip()[:6]
    return head.startswith("data:") or head.startswith(":") or head.startswith("event:")


def _reasoning_from_details(details: Any) -> str | None:
    if not isinstance(details, list):
        return None
    texts = [d.get("text") for d in details if isinstance(d, dict) and isinstance(d.get("text"), str)]
    return "".join(texts) if texts else None


def parse_response(raw: str, status: int = 200) -> ParsedResponse:
    """Parse an exact response body. Never raises on bad input; see the module docstring."""
    streamed = is_sse(raw)
    try:
        parsed = _parse_sse(raw) if streamed else _parse_json(raw)
    except (ValueError, TypeError, AttributeError) as exc:
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
    choice = choices[0]
    msg = choice.get("message") or {}
    if choice.get("error"):
        out.error = _error_from(choice["error"], "body")
    out.content = msg.get("content")
    out.reasoning = msg.get("reasoning")
    if out.reasoning is None:
        out.reasoning = msg.get("reasoning_content") or _reasoning_from_details(msg.get("reasoning_details"))
    for name, value in (("content", out.content), ("reasoning", out.reasoning)):
        if value is not None and not isinstance(value, str):  # content parts, a number...: no text to encode
            out.content = out.reasoning = None
            out.error = ResponseError("malformed", f"message.{name} is a {type(value).__name__}, not text", "malformed")
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


def _sse_payloads(lines: list[str]) -> tuple[list[str], bool]:
    """The payloads of a stream's ``data:`` lines, and whether ``[DONE]`` was among them."""
    done = False
    payloads = []
    for line in lines:
        data = _data_payload(line)
        if data == "[DONE]":
            done = True
        elif data:
            payloads.append(data)
    return payloads, done


def _data_payload(line: str) -> str | None:
    """The payload of a ``data:`` line; None for comments (": OPENROUTER PROCESSING"), ``event:``,
    ``id:`` and blank lines."""
    return line[5:].strip() if line.startswith("data:") else None


def _parse_payloads(payloads: list[str]) -> list[Any]:
    """Every payload parsed; raises on the first that is not JSON."""
    try:  # one parse of all chunks is several times faster than one json.loads per chunk
        chunks = loads_json("[" + ",".join(payloads) + "]")
        if len(chunks) != len(payloads):
            raise ValueError("chunk count changed")
    except ValueError:
        chunks = [loads_json(p) for p in payloads]  # raises on the offending chunk (json.loads's error)
    return chunks


def _read_lines(lines: list[str], start: int, end: int, stream: "_StreamAssembly") -> None:
    """Fold the ``data:`` lines of ``lines[start:end]`` into ``stream`` in order, until a text chunk
    teaches a template; the rest is then read by it (:func:`_read_templated`)."""
    for i in range(start, end):
        payload = _data_payload(lines[i])
        if payload == "[DONE]":
            stream.done = True
        elif payload:
            chunk = loads_json(payload)
            stream.add_chunk(chunk)
            fields = _text_fields(chunk) if stream.templates_left else None
            if fields:
                stream.templates_left -= 1
                template = learn_chunk_template(payload, chunk, fields)
                if template is not None:
                    _read_templated(lines, i + 1, end, template, stream)
                    return


def _read_templated(lines: list[str], start: int, end: int, template: ChunkTemplate,
                    stream: "_StreamAssembly") -> None:
    """Fold ``lines[start:end]`` into ``stream``: each line the template matches adds its texts
    (all decoded in one parse); the other lines between two matches are read by :func:`_read_lines`."""
    found, texts = template.match_lines(lines, start, end)
    per_hole = [(stream.texts[kind], texts[h]) for h, kind in enumerate(template.kinds)]
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
    fields = {}
    if isinstance(delta.get("content"), str):
        fields["content"] = "content"
    if isinstance(delta.get("reasoning"), str):
        fields["reasoning"] = "reasoning"
    elif isinstance(delta.get("reasoning_content"), str):
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
    """Fold one streamed tool-call fragment into the call at its index."""
    idx = tc.get("index", len(calls))
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


class _StreamAssembly:
    """A stream's answer as a client assembles it, one chunk at a time: text deltas concatenated,
    tool-call deltas merged by index, the last ``usage`` kept."""

    def __init__(self) -> None:
        self.out = ParsedResponse(streamed=True)
        self.texts: dict[str, list[str]] = {"content": [], "reasoning": [], "details": []}
        self.calls: dict[int, ToolCall] = {}
        self.gid = self.provider = self.model = None
        self.done = False  # [DONE] seen
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
            delta = choice.get("delta")
            if delta:
                self._add_delta(delta)
            if choice.get("finish_reason"):
                out.finish_reason = choice["finish_reason"]
                out.native_finish_reason = choice.get("native_finish_reason")
            if choice.get("error"):
                out.error = _error_from(choice["error"], "stream")

    def _add_delta(self, delta: Mapping[str, Any]) -> None:
        text = delta.get("content")
        if isinstance(text, str):
            self.texts["content"].append(text)
        text = delta.get("reasoning")
        if not isinstance(text, str):
            text = delta.get("reasoning_content")
        if isinstance(text, str):
            self.texts["reasoning"].append(text)
        details = delta.get("reasoning_details")
        if details:
            dt = _reasoning_from_details(details)
            if dt is not None:
                self.texts["details"].append(dt)
        for tc in delta.get("tool_calls") or ():
            _add_tool_call_delta(self.calls, tc)

    def result(self) -> ParsedResponse:
        out, texts = self.out, self.texts
        out.generation_id, out.provider, out.model = self.gid or None, self.provider or None, self.model or None
        # a text seen at all, even empty, is a text ("" and None differ)
        out.content = "".join(texts["content"]) if texts["content"] else None
        if texts["reasoning"]:
            out.reasoning = "".join(texts["reasoning"])
        elif texts["details"]:
            out.reasoning = "".join(texts["details"])
        out.tool_calls = [self.calls[i] for i in sorted(self.calls)]
        if out.error is None and not self.done and out.finish_reason is None:
            out.error = ResponseError("stream_incomplete", "stream ended without finish_reason or [DONE]", "stream")
        return out


# a shorter stream is read the plain way: learning a template costs about what parsing 20 chunks does
_TEMPLATED_LINES = 80


def _parse_sse(raw: str) -> ParsedResponse:
    """Lines end at CRLF, CR or LF, as the SSE format says (``str.splitlines`` would also cut a line
    at a U+2028 or U+0085 that JSON allows raw inside a string). Text chunks are read through their
    stream's template (:mod:`eagledata.tokens.chunk_templates`); a stream that cannot be read whole
    that way (a chunk that is not JSON, not an object...) is read again the plain way, every chunk
    parsed before any is folded, so its error is the one the plain reading reports."""
    if "\r" in raw:
        raw = raw.replace("\r\n", "\n").replace("\r", "\n")
    lines = raw.split("\n")
    if len(lines) >= _TEMPLATED_LINES:
        stream = _StreamAssembly()
        try:
            _read_lines(lines, 0, len(lines), stream)
            return stream.result()
        except (ValueError, TypeError, AttributeError):
            pass
    payloads, done = _sse_payloads(lines)
    stream = _StreamAssembly()
    stream.done = done
    for chunk in _parse_payloads(payloads):
        stream.add_chunk(chunk)
    return stream.result()


def _parse_sglang_native(body: dict) -> ParsedResponse:
    """SGLang's native ``/generate`` answer: ``text``, ``output_ids``, ``meta_info`` (finish
    ``{type, matched}``, token counts). The text is the whole completion; the ids ride beside it."""
    meta = body.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    out = ParsedResponse(streamed=False, generation_id=meta.get("id"), provider="SGLang", content=body.get("text"),
                         finish_reason={"stop": "stop", "length": "length", "abort": "error"}.get(kind, kind),
                         usage={"prompt_tokens": meta.get("prompt_tokens"), "completion_tokens": meta.get("completion_tokens")})
    if kind == "abort":
        out.error = ResponseError("abort", str(finish.get("message") or "request aborted"), "finish")
    return out

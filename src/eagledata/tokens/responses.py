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
    for i, tc in enumerate(msg.get("tool_calls") or []):
        fn = tc.get("function") or {}
        args = fn.get("arguments")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False) if args is not None else ""
        out.tool_calls.append(ToolCall(tc.get("id"), fn.get("name") or "", args, tc.get("index", i)))
    out.finish_reason = choice.get("finish_reason")
    out.native_finish_reason = choice.get("native_finish_reason")
    return out


def _sse_chunks(raw: str) -> tuple[list[Any], bool]:
    """The JSON payloads of a stream's ``data:`` lines, and whether ``[DONE]`` was among them."""
    done = False
    payloads = []
    for line in raw.splitlines():
        if not line.startswith("data:"):
            continue  # comments (": OPENROUTER PROCESSING"), event:, id:, blank lines
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
        elif data:
            payloads.append(data)
    try:  # one parse of all chunks is several times faster than one json.loads per chunk
        chunks = loads_json("[" + ",".join(payloads) + "]")
        if len(chunks) != len(payloads):
            raise ValueError("chunk count changed")
    except ValueError:
        chunks = [json.loads(p) for p in payloads]  # raises on the offending chunk
    return chunks, done


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


def _parse_sse(raw: str) -> ParsedResponse:
    out = ParsedResponse(streamed=True)
    content: list[str] = []
    reasoning: list[str] = []
    details_text: list[str] = []
    saw_content = saw_reasoning = False
    calls: dict[int, ToolCall] = {}
    chunks, done = _sse_chunks(raw)
    gid = provider = model = None
    for chunk in chunks:
        if not isinstance(chunk, dict):
            raise ValueError("stream chunk is not a JSON object")
        if not gid:
            gid = chunk.get("id")
        if not provider:
            provider = chunk.get("provider")
        if not model:
            model = chunk.get("model")
        usage = chunk.get("usage")
        if usage:
            out.usage = usage
        if chunk.get("error"):
            out.error = _error_from(chunk["error"], "stream")
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta")
            if delta:
                text = delta.get("content")
                if isinstance(text, str):
                    saw_content = True
                    content.append(text)
                text = delta.get("reasoning")
                if not isinstance(text, str):
                    text = delta.get("reasoning_content")
                if isinstance(text, str):
                    saw_reasoning = True
                    reasoning.append(text)
                details = delta.get("reasoning_details")
                if details:
                    dt = _reasoning_from_details(details)
                    if dt is not None:
                        details_text.append(dt)
                for tc in delta.get("tool_calls") or ():
                    _add_tool_call_delta(calls, tc)
            if choice.get("finish_reason"):
                out.finish_reason = choice["finish_reason"]
                out.native_finish_reason = choice.get("native_finish_reason")
            if choice.get("error"):
                out.error = _error_from(choice["error"], "stream")
    out.generation_id, out.provider, out.model = gid or None, provider or None, model or None
    out.content = "".join(content) if saw_content else None
    if saw_reasoning:
        out.reasoning = "".join(reasoning)
    elif details_text:
        out.reasoning = "".join(details_text)
    out.tool_calls = [calls[i] for i in sorted(calls)]
    if out.error is None and not done and out.finish_reason is None:
        out.error = ResponseError("stream_incomplete", "stream ended without finish_reason or [DONE]", "stream")
    return out


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

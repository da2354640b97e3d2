import json

from eagledata.tokens.responses import parse_response


def _json_body(**message):
    body = {"id": "gen-1", "provider": "P", "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls",
            "native_finish_reason": "tool_calls", "message": {"role": "assistant", **message}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 20, "completion_tokens_details": {"reasoning_tokens": 5}, "cost": 0.001}}
    return json.dumps(body)


def _sse(chunks, comments=True, done=True):
    out = []
    if comments:
        out.append(": OPENROUTER PROCESSING\n\n")
    for c in chunks:
        out.append("data: " + json.dumps({"id": "gen-1", "provider": "P", "model": "m", "object": "chat.completion.chunk", **c}) + "\n\n")
    if done:
        out.append("data: [DONE]\n\n")
    return "".join(out)


def _delta(finish=None, **delta):
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


MESSAGE = dict(reasoning=" think hard", content=" The answer:",
               tool_calls=[{"index": 0, "id": "functions.add:0", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}},
                           {"index": 1, "id": "call_x", "type": "function", "function": {"name": "mul", "arguments": "{}"}}])


def test_json_with_keepalive_padding():
    p = parse_response("\n         \n" + _json_body(**MESSAGE))
    assert p.ok and not p.streamed
    assert (p.reasoning, p.content, p.finish_reason) == (" think hard", " The answer:", "tool_calls")
    assert [(t.id, t.name, t.arguments) for t in p.tool_calls] == [("functions.add:0", "add", "{\"a\": 1}"), ("call_x", "mul", "{}")]
    assert (p.prompt_tokens, p.completion_tokens, p.reasoning_tokens, p.cost) == (10, 20, 5, 0.001)


def test_sse_assembles_the_same_message_as_json():
    chunks = [
        _delta(role="assistant", reasoning=" think"), _delta(reasoning=" hard"),
        _delta(content=" The"), _delta(content=" answer:"),
        _delta(tool_calls=[{"index": 0, "id": "functions.add:0", "type": "function", "function": {"name": "add", "arguments": "{\"a\""}}]),
        _delta(tool_calls=[{"index": 0, "function": {"arguments": ": 1}"}}]),
        _delta(tool_calls=[{"index": 1, "id": "call_x", "function": {"name": "mul", "arguments": ""}}]),
        _delta(tool_calls=[{"index": 1, "id": "call_x", "function": {"name": "", "arguments": "{}"}}]),
        _delta(finish="tool_calls", content=""),
        {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 20, "completion_tokens_details": {"reasoning_tokens": 5}, "cost": 0.001}},
    ]
    s = parse_response(_sse(chunks))
    j = parse_response(_json_body(**MESSAGE))
    assert s.ok and s.streamed
    for field in ("reasoning", "content", "finish_reason", "usage", "provider", "generation_id"):
        assert getattr(s, field) == getattr(j, field), field
    assert [(t.id, t.name, t.arguments) for t in s.tool_calls] == [(t.id, t.name, t.arguments) for t in j.tool_calls]


def test_reasoning_details_fallback():
    p = parse_response(_json_body(content="x", reasoning_details=[{"type": "reasoning.text", "text": "abc"}]))
    assert p.reasoning == "abc"


def test_error_inside_200_body():
    p = parse_response(json.dumps({"error": {"code": 502, "message": "upstream died"}}), 200)
    assert not p.ok and p.error.where == "body" and p.error.code == 502


def test_mid_stream_error_and_finish_error():
    chunks = [_delta(content="partial"), {"error": {"code": "server_error", "message": "boom"},
              "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}]}]
    p = parse_response(_sse(chunks))
    assert not p.ok and p.error.where == "stream" and p.content == "partial"
    p2 = parse_response(_sse([_delta(content="x"), _delta(finish="error")]))
    assert not p2.ok and p2.error.where == "finish"


def test_truncated_stream_without_done_is_an_error():
    p = parse_response(_sse([_delta(content="half")], done=False))
    assert not p.ok and p.error.code == "stream_incomplete"


def test_http_error_and_malformed_bodies():
    p = parse_response(json.dumps({"error": {"code": 429, "message": "rate limited"}}), 429)
    assert not p.ok and p.error.where == "http"
    assert parse_response('{"id": "gen', 200).error.where == "malformed"
    assert parse_response("data: {not json}\n\n", 200).error.where == "malformed"
    assert parse_response("[1, 2]", 200).error.where == "malformed"


def test_every_recorded_body_parses(recorded):
    for rec in recorded:
        p = parse_response(rec["response_raw"], rec["status"])
        assert p.ok, (rec["source"], p.error)
        assert p.completion_tokens is not None and p.provider
        assert p.finish_reason in ("stop", "tool_calls")

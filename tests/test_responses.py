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
    # a message whose content or reasoning is not text (content parts, a number) is malformed, not a crash
    for message in ({"content": [{"type": "text", "text": "hi"}]}, {"content": "ok", "reasoning": 5}):
        body = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", **message}}]}
        p = parse_response(json.dumps(body), 200)
        assert p.error.where == "malformed" and "not text" in p.error.message and p.content is None



def _both_readers(body_of):
    """``body_of(n_filler)`` read as a short stream (the plain reading) and as one of >= 80 lines
    (through a template): the two parses."""
    return parse_response(body_of(0)), parse_response(body_of(60))


def _filler(n):
    return [_delta(content="") for _ in range(n)]


def test_the_stream_ends_at_its_done_line():
    after = "data: " + json.dumps(_delta(finish="length", content=" extra")) + "\n\n"
    for p in _both_readers(lambda n: _sse(_filler(n) + [_delta(content="Hello [DONE]"), _delta(finish="stop")]) + after):
        assert p.ok and (p.content, p.finish_reason) == ("Hello [DONE]", "stop")
    # another spelling of [DONE] ends the stream too
    body = _sse([_delta(content="Hi"), _delta(finish="stop")], done=False) + "data:[DONE] \n\n" + after
    assert (parse_response(body).content, parse_response(body).finish_reason) == ("Hi", "stop")


def test_a_text_that_is_not_a_string_in_a_stream_is_malformed():
    for bad in (_delta(content=[{"type": "text", "text": " world"}]), _delta(reasoning=5),
                _delta(tool_calls=[{"index": 0, "id": "c", "function": {"name": "f", "arguments": {"a": 1}}}])):
        for p in _both_readers(lambda n: _sse(_filler(n) + [_delta(content="Hello"), bad, _delta(finish="stop")])):
            assert p.error is not None and p.error.where == "malformed" and "not text" in p.error.message, bad


def test_tool_call_fragments_without_an_index_continue_their_call():
    chunks = [_delta(tool_calls=[{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]),
              _delta(tool_calls=[{"function": {"arguments": '{"a":'}}]), _delta(tool_calls=[{"function": {"arguments": "1}"}}]),
              _delta(tool_calls=[{"id": "call_2", "function": {"name": "g", "arguments": "{}"}}]), _delta(finish="tool_calls")]
    p = parse_response(_sse(chunks))
    assert p.ok and [(t.id, t.name, t.arguments) for t in p.tool_calls] == [("call_1", "f", '{"a":1}'), ("call_2", "g", "{}")]


def test_a_chunk_cut_over_several_data_lines_is_one_payload():
    line = json.dumps({"id": "g", **_delta(content="Hello")})
    cut = line.index('"choices"')
    split = f"data: {line[:cut]}\ndata: {line[cut:]}\n\n"
    for p in _both_readers(lambda n: _sse(_filler(n)) .removesuffix("data: [DONE]\n\n") + split + _sse([_delta(finish="stop")])):
        assert p.ok and p.content == "Hello"
    # two whole chunks with no blank line between them are two chunks (as a client reading lines takes them)
    two = "".join("data: " + json.dumps(c) + "\n" for c in (_delta(content="a"), _delta(content="b", finish="stop")))
    assert parse_response(two + "\ndata: [DONE]\n\n").content == "ab"


def test_payloads_that_are_json_only_together_are_refused():
    body = 'data: {"choices":[{"delta":{"content":"Hel\n\ndata: lo"},"finish_reason":"stop"}]}\n\ndata: {},{}\n\ndata: [DONE]\n\n'
    assert parse_response(body).error.where == "malformed"


def test_reasoning_is_the_first_nonempty_text_in_a_body_and_in_a_stream():
    details = [{"type": "reasoning.text", "text": "think"}]
    for fields, expected in (({"reasoning_content": "", "reasoning_details": details}, "think"),
                             ({"reasoning": "", "reasoning_details": details}, "think"),
                             ({"reasoning": "", "reasoning_content": "rc"}, "rc"),
                             ({"reasoning": "r", "reasoning_details": details}, "r"),
                             ({"reasoning": ""}, ""), ({}, None)):
        body = parse_response(_json_body(content="ok", **fields))
        stream = parse_response(_sse([_delta(content="ok", **fields), _delta(finish="stop")]))
        assert body.reasoning == stream.reasoning == expected, fields
    # chunk by chunk: a chunk with only details adds its text after one with both
    chunks = [_delta(reasoning="a", reasoning_details=[{"type": "reasoning.text", "text": "a"}]),
              _delta(reasoning_details=[{"type": "reasoning.text", "text": "b"}]), _delta(finish="stop", content="x")]
    assert parse_response(_sse(chunks)).reasoning == "ab"


def test_a_stream_after_a_byte_order_mark_or_an_id_line_and_an_unfinished_last_line():
    body = _sse([_delta(content="x"), _delta(finish="stop")], done=False)
    for raw in ("\ufeff" + body, "id: 1\n" + body, body + "data: [DON", body + 'data: {"usage": {"prompt_'):
        p = parse_response(raw)
        assert p.ok and p.streamed and (p.content, p.finish_reason) == ("x", "stop"), raw[-20:]
    assert parse_response("\ufeff" + _json_body(content="y")).content == "y"
    # a cut last line that is all the stream has left is still no answer
    assert parse_response(_sse([_delta(content="x")], done=False) + 'data: {"choices"').error.code == "stream_incomplete"


def test_sglang_native_text_and_abort():
    native = {"output_ids": [1], "meta_info": {"id": "r", "finish_reason": "abort", "prompt_tokens": 1, "completion_tokens": 1}}
    assert parse_response(json.dumps({**native, "text": "hi"})).error.code == "abort"
    assert parse_response(json.dumps({**native, "text": ["hi"]})).error.where == "malformed"

def test_every_recorded_body_parses(recorded):
    for rec in recorded:
        p = parse_response(rec["response_raw"], rec["status"])
        assert p.ok, (rec["source"], p.error)
        assert p.completion_tokens is not None and p.provider
        assert p.finish_reason in ("stop", "tool_calls")


# --- text chunks read through the stream's template (eagledata.tokens.chunk_templates) -------------

TRICKY = ['plain', '', ' "quoted" ', 'back\\slash\\', '"content":"x"', '},"finish_reason":"stop"}]}',
          'line\nbreak', 'sep\u2028arator', 'nel\u0085', 'é ü 漢字 🙂', '\ud800', 'tab\t', '\\"', '\\u0041']


def _stream_lines(chunks, dumps=json.dumps):
    return "".join("data: " + dumps({"id": "gen-9", "provider": "P", "model": "m", "object": "chat.completion.chunk",
                                     "created": 1, **c}) + "\n\n" for c in chunks) + "data: [DONE]\n\n"


def _expected(chunks):
    """What a client assembles from text deltas (the semantics the template path must keep)."""
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    content = [d["content"] for d in deltas if isinstance(d.get("content"), str)]
    reasoning = [d["reasoning"] for d in deltas if isinstance(d.get("reasoning"), str)]
    return ("".join(content) if content else None), ("".join(reasoning) if reasoning else None)


def _unique_lines(chunks):
    """The same chunks, each line different outside its text (so no template can match)."""
    return [{**c, "n": i} for i, c in enumerate(chunks)]


def test_text_chunks_through_a_template_equal_the_plain_reading():
    import random
    rng = random.Random(7)
    for trial in range(60):
        chunks = [_delta(role="assistant", content="")]
        thinking = trial % 2 == 0
        for _ in range(rng.randint(0, 40) if trial % 3 == 0 else rng.randint(40, 90)):  # short: the plain reading
            text = rng.choice(TRICKY) + rng.choice(TRICKY)
            if thinking and rng.random() < 0.5:
                chunks.append(_delta(role="assistant", content="", reasoning=text, reasoning_details=[
                    {"type": "reasoning.text", "text": text, "format": "unknown", "index": 0}]))
            else:
                chunks.append(_delta(role="assistant", content=text))
            if rng.random() < 0.05:  # a chunk of another shape in the middle
                chunks.append(_delta(role="assistant", content=None, tool_calls=[
                    {"index": 0, "id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": text}}]))
            if rng.random() < 0.05:  # the same shape with another fingerprint
                chunks.append({**_delta(role="assistant", content=text), "system_fingerprint": "fp2"})
        chunks.append(_delta(finish="stop", content=""))
        for dumps in (json.dumps, lambda o: json.dumps(o, ensure_ascii=False)):
            fast = parse_response(_stream_lines(chunks, dumps))
            plain = parse_response(_stream_lines(_unique_lines(chunks), dumps))
            assert fast.ok and (fast.content, fast.reasoning) == _expected(chunks), trial
            assert (fast.content, fast.reasoning, [(t.id, t.arguments) for t in fast.tool_calls]) == \
                (plain.content, plain.reasoning, [(t.id, t.arguments) for t in plain.tool_calls])


def test_irregular_streams_read_through_templates_equal_the_plain_reading():
    """Template lines interrupted anywhere (a comment, no blank line or two, a chunk of another shape,
    a text ending in a backslash, which the one parse of a template's holes refuses) give what the
    plain reading gives."""
    import random
    rng = random.Random(23)
    gaps = ["\n"] * 4 + ["\n\n\n", "\n\n: keep-alive\n\n", "\n: c\n"]
    for trial in range(150):
        chunks = [_delta(role="assistant", content="")]
        for _ in range(rng.randint(80, 160)):
            text = rng.choice(TRICKY + ["x\\", "y\\\\"])
            kind = rng.random()
            if kind < 0.4 and trial % 2:
                chunks.append(_delta(role="assistant", content="", reasoning=text))
            elif kind < 0.95:
                chunks.append(_delta(role="assistant", content=text))
            else:
                chunks.append(_delta(role="assistant", content=None, tool_calls=[
                    {"index": 0, "id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": text}}]))
        chunks.append(_delta(finish="stop", content=""))
        dumps = json.dumps if trial % 3 else (lambda o: json.dumps(o, ensure_ascii=False))
        lines = ["data: " + dumps({"id": "gen-9", "provider": "P", "model": "m", "object": "chat.completion.chunk", **c})
                 for c in chunks]
        body = "".join(line + (rng.choice(gaps) if rng.random() < 0.2 else "\n\n") for line in lines) + "data: [DONE]\n\n"
        fast, plain = parse_response(body), _plain(body)
        assert repr(fast) == repr(plain), trial
        assert fast.ok and (fast.content, fast.reasoning) == _expected(chunks), trial


def test_a_line_with_the_templates_literals_but_two_values_is_read_in_full():
    chunk = _delta(role="assistant", content="a")
    line = _stream_lines([chunk, chunk, chunk] + [_delta(role="assistant", content="")] * 60)
    # the middle line's hole holds `"x","refusal":"y"`: same literals around, but two string tokens
    forged = line.replace('"content": "a"', '"content": "x", "refusal": "y"', 2).replace('"content": "x", "refusal": "y"', '"content": "a"', 1)
    p = parse_response(forged)
    assert p.ok and p.content == "axa"


def test_a_raw_line_separator_inside_a_json_string_does_not_cut_the_line():
    chunks = [_delta(content="one\u2028two"), _delta(content="\u0085three")] + [_delta(content="")] * 60 + [_delta(finish="stop", content="")]
    p = parse_response(_stream_lines(chunks, lambda o: json.dumps(o, ensure_ascii=False)))
    assert p.ok and p.content == "one\u2028two\u0085three"


def test_crlf_and_cr_line_ends():
    raw = _stream_lines([_delta(content="a"), _delta(content="b"), _delta(content="c")] + [_delta(content="")] * 60 + [_delta(finish="stop")])
    for ending in ("\r\n", "\r"):
        p = parse_response(raw.replace("\n", ending))
        assert p.ok and p.content == "abc" and p.finish_reason == "stop"


def test_errors_in_templated_streams_are_the_plain_readings_errors():
    good = [_delta(content="a"), _delta(content="b"), _delta(content="c")] + [_delta(content="")] * 60  # long: templated
    # an invalid escape inside a hole, a chunk that is not an object, then one that is not JSON
    bad_escape = _stream_lines(good).replace('"content": "b"', '"content": "\\x"')
    p = parse_response(bad_escape)
    assert p.error.where == "malformed" and "unparseable body" in p.error.message
    not_object = _stream_lines(good) .replace("data: [DONE]", "data: [1]\n\ndata: {not json}\n\ndata: [DONE]")
    p = parse_response(not_object)
    assert p.error.where == "malformed" and "Expecting property name" in p.error.message  # parse errors first
    p = parse_response(_stream_lines(good).replace("data: [DONE]", "data: [1]"))
    assert p.error.where == "malformed" and "not a JSON object" in p.error.message


def test_a_template_matches_every_text_line_of_its_shape_and_no_other():
    from eagledata.tokens.chunk_templates import learn_chunk_template
    thinking = [_delta(role="assistant", content="", reasoning=t, reasoning_details=[
        {"type": "reasoning.text", "text": t, "format": "unknown", "index": 0}]) for t in TRICKY]
    answer = [_delta(role="assistant", content=t) for t in TRICKY]
    other = [_delta(role="assistant", content=None, tool_calls=[{"index": 0, "function": {"arguments": "x"}}])]
    lines = _stream_lines(thinking + answer + other, lambda o: json.dumps(o, ensure_ascii=False)).split("\n")
    first = json.loads(lines[0][6:])
    template = learn_chunk_template(lines[0][6:], first, {"content": "content", "reasoning": "reasoning", "text": "details"})
    assert template.kinds == ("content", "reasoning", "details")
    found, texts = template.match_lines(lines, 0, len(lines))
    assert found == [2 * i for i in range(len(TRICKY))]  # the thinking lines, not the answer or the tool call
    assert texts[1] == [json.loads(json.dumps(t)) for t in TRICKY] == texts[2] and texts[0] == [""] * len(TRICKY)
    # the same lines checked one pattern match each (the path for lines the one parse cannot prove)
    assert template._match_each(found, [lines[i][len("data: " + template.literals[0]):-len(template.literals[-1])]
                                        for i in found]) == (found, texts)
    # a key spelled twice, or with escapes, gets no template
    assert learn_chunk_template('{"content":"a","x":{"content":"b"}}', {"content": "a", "x": {"content": "b"}},
                                {"content": "content"}) is None
    assert learn_chunk_template('{"con\\u0074ent":"a"}', {"content": "a"}, {"content": "content"}) is None


def test_a_line_cut_after_its_text_is_not_read_as_a_template_line():
    """A line that starts like the template's and holds one string token where the hole is, but lacks
    the template's end (a body cut short), is read in full: the stream is malformed, as read plainly."""
    chunks = [_delta(content=t) for t in ("a", "b", "c")] + [_delta(content="")] * 60 + [_delta(finish="stop")]
    raw = _stream_lines(chunks)
    whole = raw.split("\n\n")[2]  # the third chunk's line
    cut = whole[:whole.index('"content": "c"') + len('"content": "c"')]
    for body in (raw.replace(whole, cut), _stream_lines(_unique_lines(chunks)).replace('"content": "c"}', '"content": "c"')):
        p = parse_response(body)
        assert not p.ok and p.error.where == "malformed", p


def test_the_one_parse_of_a_templates_holes_proves_each_is_one_string_token():
    """_strings_at_holes answers only when every piece is exactly one JSON string token (whatever the
    pieces hold: quotes, escapes, commas, brackets spread over several lines), else leaves the lines
    to one pattern match each."""
    import random
    from eagledata.tokens.chunk_templates import _middle_patterns, _strings_at_holes
    rng = random.Random(11)
    bits = ['"', 'a', '\\', ',', '\\"', ' ', '[', ']', '"a"', '\\\\', '\\u00e9', ':', '{"k":1}']
    answered = 0
    for _ in range(20000):
        inner = rng.choice([(), ("|",), ("|", "::")])
        middles = []
        for _ in range(rng.randint(1, 4)):
            pieces = ['"' + "".join(rng.choice(bits) for _ in range(rng.randint(0, 3))) + '"'
                      if rng.random() < 0.8 else "".join(rng.choice(bits) for _ in range(rng.randint(0, 4)))
                      for _ in range(len(inner) + 1)]
            middles.append(pieces[0] + "".join(lit + p for lit, p in zip(inner, pieces[1:])))
        got = _strings_at_holes(middles, inner)
        if got is None:
            continue
        answered += 1
        one, _ = _middle_patterns(inner)  # the pattern match each line gets otherwise: the reference
        matches = [one.fullmatch(m) for m in middles]
        assert all(matches), middles
        assert got == [[json.loads(m.group(h + 1)) for m in matches] for h in range(len(inner) + 1)], middles
    assert answered > 1000


def test_a_body_nested_too_deeply_is_malformed_not_a_crash():
    """JSON nested beyond what a parser reads (one chunk, a JSON body, or brackets opened in one text
    line's hole and closed lines later, which only the joined holes nest) is a malformed body."""
    deep = "[" * 1500 + "]" * 1500
    text = [_delta(content=f"w{i}") for i in range(60)]
    raw = _stream_lines(text + [_delta(finish="stop", content="")])
    holes = ['"a",' + "[" * 400 + '"x"'] * 3 + ['"y"' + "]" * 1200 + ',"b"']
    forged = raw.replace("data: [DONE]", "".join('data: {"id": "gen-9", "provider": "P", "model": "m", "object": '
                                                 '"chat.completion.chunk", "created": 1, "choices": [{"index": 0, "delta": '
                                                 '{"content": ' + h + '}, "finish_reason": null}]}\n\n' for h in holes) + "data: [DONE]")
    for body in (raw.replace("data: [DONE]", f"data: {deep}\n\ndata: [DONE]"), deep, forged):
        p = parse_response(body)
        assert not p.ok and p.error.where == "malformed", p


def _plain(body):
    """``body`` read the plain way only (every chunk parsed on its own)."""
    import eagledata.tokens.responses as responses
    saved, responses._TEMPLATED_LINES = responses._TEMPLATED_LINES, 10 ** 9
    try:
        return parse_response(body)
    finally:
        responses._TEMPLATED_LINES = saved


_END = 'data: {"id":"g","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
_LINE = 'data: {"id":"g","choices":[{"index":0,"delta":%s,"finish_reason":null}]%s}\n\n'


def test_a_repeated_key_never_moves_a_templates_hole():
    """A line whose parse dropped a key (a later duplicate, spelled with an escape, or in an object a
    later duplicate key replaced) teaches no template: the hole would sit on the text the parse dropped."""
    escaped = "".join(_LINE % ('{"content":"w%d","cont\\u0065nt":""}' % i, "") for i in range(81)) + _END
    escaped = escaped.replace('"content":"w0"', '"content":""', 1)
    sibling = "".join(_LINE % ('{"content":""}', ',"x":{"content":"w%d"},"x":0' % i) for i in range(81)) + _END
    for body in (escaped, sibling):
        p = parse_response(body)
        assert p.ok and p.content == "" and repr(p) == repr(_plain(body))


def test_a_text_chunk_nested_deeply_is_read_the_plain_way():
    body = _LINE % ('{"content":"A"}', ',"logprobs":' + "[" * 600 + "]" * 600) + _LINE % ('{"content":"b"}', "") * 80 + _END
    p = parse_response(body)
    assert p.ok and p.content == "A" + "b" * 80 and repr(p) == repr(_plain(body))


def test_bodies_of_the_wrong_shape_are_malformed_values_not_exceptions():
    deep_args = '{"choices":[{"message":{"tool_calls":[{"function":{"name":"f","arguments":%s}}]}}]}' % ("[" * 994 + "]" * 994)
    for body in ('{"choices":{"0":{}}}', '{"choices":["x"]}', '{"choices":[{"message":[1]}]}', deep_args):
        p = parse_response(body)
        assert not p.ok and p.error.where == "malformed", (body[:40], p.error)


def test_counts_and_costs_that_are_not_finite_numbers_count_nothing():
    for bad in ("NaN", "Infinity", "-Infinity", "true", '"12"', "[1]"):
        body = ('{"choices":[{"message":{"content":"A"},"finish_reason":"stop"}],"usage":{"prompt_tokens":%s,'
                '"completion_tokens":%s,"completion_tokens_details":{"reasoning_tokens":%s},"cost":%s}}') % ((bad,) * 4)
        p = parse_response(body)
        assert (p.prompt_tokens, p.completion_tokens, p.reasoning_tokens, p.cost) == (None, None, None, None), bad
    for usage in ("[1]", '"x"', '{"completion_tokens_details":[1]}'):
        p = parse_response('{"choices":[{"message":{"content":"A"},"finish_reason":"stop"}],"usage":%s}' % usage)
        assert (p.completion_tokens, p.reasoning_tokens, p.cost) == (None, None, None)
    p = parse_response('{"choices":[{"message":{"content":"A"},"finish_reason":"stop"}],"usage":{"cost":-0.5,"completion_tokens":3.0}}')
    assert p.cost is None and p.completion_tokens == 3


def test_streams_a_client_would_not_read_as_one_answer_are_errors():
    two_choices = [_delta(content="A"), {"choices": [{"index": 1, "delta": {"content": "B"}, "finish_reason": None}]},
                   _delta(finish="stop")]
    bool_index = [_delta(content="A"), _delta(tool_calls=[{"index": True, "id": "c", "function": {"name": "f", "arguments": "{}"}}]),
                  _delta(finish="stop")]
    for chunks in (two_choices, bool_index):
        for p in _both_readers(lambda n, chunks=chunks: _sse(_filler(n) + chunks)):
            assert not p.ok and p.error.where == "malformed", p
    for body in ("data: [DONE]\n\n", _sse([{"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 0}}])):
        p = parse_response(body)
        assert not p.ok and p.error.code == "no_choices", p
    for space in ("\xa0", "\u2028", "\x85", "\x1f"):
        for p in _both_readers(lambda n, space=space: _sse(_filler(n) + [_delta(content="A"), _delta(finish="stop")])
                               .replace('"A"}', '"A"}' + space, 1)):
            assert not p.ok and p.error.where == "malformed", (space, p)

"""History for turn-by-turn regeneration and the merged-sample check, with the real Kimi templates."""
from __future__ import annotations


from eagledata.text.chat import prompt_ids, prompt_text
from eagledata.text.history import ToolCallText, arguments_equal, assistant_message, check_merged
from eagledata.tokens.reconstruct import reconstruct_completion
from eagledata.tokens.responses import ParsedResponse, ToolCall

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def _turn_ids(tok, fam, messages, reasoning, content, calls=(), tools=None):
    """The ids one regenerated turn produced after its own prompt, and its history message."""
    first = sum(len(m.get("tool_calls") or []) for m in messages)
    msg = assistant_message(reasoning, content, [ToolCallText(n, a) for n, a in calls], fam, first)
    parsed = ParsedResponse(streamed=False, reasoning=reasoning, content=content,
                            tool_calls=[ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                                        for c in msg.get("tool_calls", [])],
                            finish_reason="tool_calls" if calls else "stop")
    rc = reconstruct_completion(parsed, tok, fam, first)
    return msg, rc.ids


def test_assistant_message_uses_native_ids_counted_over_the_conversation(k25):
    _, fam = k25
    msg = assistant_message("think", "", [ToolCallText("weather", '{"city": "Oslo"}'), ToolCallText("time", "{}")], fam, 2)
    assert [c["id"] for c in msg["tool_calls"]] == ["functions.weather:2", "functions.time:3"]
    assert msg["reasoning_content"] == "think" and msg["content"] == ""
    assert "reasoning_content" not in assistant_message(None, "hi", [], fam)


def test_k2_history_is_the_reply_as_produced_so_turns_merge(k2):
    tok, fam = k2
    messages = [{"role": "user", "content": "Name a colour."}]
    m1, ids1 = _turn_ids(tok, fam, messages, None, "Blue.")
    messages += [m1, {"role": "user", "content": "Another?"}]
    m2, ids2 = _turn_ids(tok, fam, messages, None, "Green.")
    messages.append(m2)
    check = check_merged(tok, messages, [ids1, ids2])
    assert check.ok, check.reason
    assert [check.ids[a:b] for a, b in check.spans] == [ids1, ids2]
    assert check.ids[: check.spans[0][0]] == prompt_ids(tok, messages[:1])


def test_k25_drops_earlier_reasoning_so_the_merge_is_refused_with_the_turn(k25):
    tok, fam = k25
    messages = [{"role": "user", "content": "Name a colour."}]
    m1, ids1 = _turn_ids(tok, fam, messages, "The user wants one colour.", "Blue.")
    messages += [m1, {"role": "user", "content": "Another?"}]
    # the second turn's prompt renders the first reply without its reasoning (K2.5's template)
    assert "The user wants one colour." not in prompt_text(tok, messages)
    m2, ids2 = _turn_ids(tok, fam, messages, "Pick a different one.", "Green.")
    messages.append(m2)
    check = check_merged(tok, messages, [ids1, ids2])
    assert not check.ok and check.turn == 0 and "turn 0" in check.reason and "completion" in check.reason


def test_k25_keeps_reasoning_inside_a_tool_call_chain_so_it_merges(k25):
    tok, fam = k25
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    m1, ids1 = _turn_ids(tok, fam, messages, "I should call the tool.", "", [("weather", '{"city": "Oslo"}')], TOOLS)
    messages += [m1, {"role": "tool", "tool_call_id": m1["tool_calls"][0]["id"], "content": "12 C, rain"}]
    # the tool result's turn: the reasoning of the call is part of this prompt (the current chain)
    assert "I should call the tool." in prompt_text(tok, messages, TOOLS)
    m2, ids2 = _turn_ids(tok, fam, messages, "Now answer.", "", [("weather", '{"city": "Bergen"}')], TOOLS)
    messages.append(m2)
    check = check_merged(tok, messages, [ids1, ids2], TOOLS)
    assert check.ok, check.reason
    assert [check.ids[a:b] for a, b in check.spans] == [ids1, ids2]


def test_tool_arguments_match_as_json_values():
    assert arguments_equal('{"city": "Oslo", "days": 2}', '{"days":2,"city":"Oslo"}')
    assert not arguments_equal('{"city": "Oslo"}', '{"city": "Bergen"}')
    assert arguments_equal("not json", "not json") and not arguments_equal("not json", "other")

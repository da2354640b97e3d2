"""Turn-by-turn regeneration plans (``turns: all``): history from the model's own replies, tool
results spliced only for matching calls, ShareGPT records, prompt identity for deduplication."""
from __future__ import annotations

import pytest

from eagledata.generate.conversation import (ConversationEnd, ConversationFormatError, Reply, prompt_key,
                                             sharegpt_messages, split_turns, turn_request, user_turns)
from eagledata.text.families import get_family
from eagledata.text.history import ToolCallText

FAM = get_family("kimi-k2.5")
RECORD = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"},
    {"role": "assistant", "content": "Rainy, 12 C."},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": "Unknown."},
    {"role": "user", "content": "Thanks!"},
]
CALL = ToolCallText("weather", '{"city": "Oslo"}')


def test_split_turns_reads_preamble_turns_and_tool_results():
    preamble, turns = split_turns(RECORD)
    assert preamble == RECORD[:1]
    assert [len(t.opening) for t in turns] == [1, 0, 1, 1]
    assert turns[0].tool_results == [RECORD[3]] and turns[1].original == RECORD[4] and turns[3].original is None
    assert user_turns(RECORD) == 4


def test_each_request_carries_the_models_own_replies_and_spliced_results():
    r0 = turn_request(RECORD, [], FAM)
    assert r0 == RECORD[:2]
    replies = [Reply("Call the tool.", "", (CALL,))]
    r1 = turn_request(RECORD, replies, FAM)
    asst, tool = r1[2], r1[3]
    assert asst["tool_calls"][0]["id"] == "functions.weather:0" and asst["reasoning_content"] == "Call the tool."
    assert asst["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'  # the model's own text
    assert tool == {"role": "tool", "tool_call_id": "functions.weather:0", "content": "12 C, rain"}
    assert len(r1) == 4  # turn 1 opens with the spliced result, no new user message
    replies.append(Reply(None, "It rains.", ()))
    r2 = turn_request(RECORD, replies, FAM)
    assert r2[4] == {"role": "assistant", "content": "It rains."} and r2[5] == RECORD[5]
    replies += [Reply("x", "No idea.", ())]
    r3 = turn_request(RECORD, replies, FAM)
    assert r3[-1] == RECORD[7] and r3[-2]["content"] == "No idea."
    end = turn_request(RECORD, replies + [Reply(None, "Bye.", ())], FAM)
    assert isinstance(end, ConversationEnd) and end.complete


@pytest.mark.parametrize("reply, reason", [
    (Reply(None, "", (ToolCallText("weather", '{"city": "Bergen"}'),)), "other arguments"),
    (Reply(None, "", (ToolCallText("time", "{}"),)), "called ['time'], the original ['weather']"),
    (Reply(None, "I cannot check.", ()), "answered without one"),
])
def test_a_different_call_ends_the_conversation_with_the_reason(reply, reason):
    end = turn_request(RECORD, [reply], FAM)
    assert isinstance(end, ConversationEnd) and not end.complete and reason in end.reason


def test_a_call_where_the_original_had_none_ends_it():
    end = turn_request([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                        {"role": "user", "content": "more"}], [Reply(None, "", (CALL,))], FAM)
    assert isinstance(end, ConversationEnd) and "did not" in end.reason


def test_sharegpt_records_become_messages_with_located_errors():
    assert sharegpt_messages([{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}], "f:1") == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for bad, where in (([], "f:3:conversations:"), ([{"from": "bot", "value": "x"}], "f:3:conversations[0].from:"),
                       ([{"value": "x"}], "f:3:conversations[0].from: missing"),
                       ([{"from": "human", "value": 3}], "f:3:conversations[0].value:")):
        with pytest.raises(ConversationFormatError, match=__import__("re").escape(where)):
            sharegpt_messages(bad, "f:3")


def test_prompt_key_is_the_canonical_prompt(k2):
    tok, _ = k2
    a = [{"role": "user", "content": "Same question?"}]
    b = [{"content": "Same question?", "role": "user"}]
    assert prompt_key(tok, a, None) == prompt_key(tok, b, None)
    assert prompt_key(tok, a, None) != prompt_key(tok, [{"role": "user", "content": "Other question?"}], None)

import json
from collections import Counter, defaultdict

import pytest

from eagledata.tokens.reconstruct import count_tool_calls, reconstruct_completion
from eagledata.tokens.responses import ParsedResponse, ToolCall, parse_response


def _resp(reasoning=None, content=None, calls=(), finish="stop", error=None):
    return ParsedResponse(streamed=False, reasoning=reasoning, content=content, tool_calls=list(calls),
                          finish_reason=finish, provider="P")




def test_k25_thinking_completion_structure(k25):
    tok, fam = k25
    rc = reconstruct_completion(_resp(" I think.", " Answer."), tok, fam)
    sid = tok.special_id
    assert rc.ids == tok.encode_plain(" I think.") + [sid("</think>")] + tok.encode_plain(" Answer.") + [sid("<|im_end|>")]
    assert [s.kind for s in rc.segments] == ["reasoning", "think_close", "content", "end_of_turn"]
    assert rc.reasoning_tokens == len(tok.encode_plain(" I think."))
    assert rc.flags == []


def test_k2_thinking_model_emits_its_own_think_open(k25):
    from eagledata.text.families import get_family

    tok, _ = k25
    rc = reconstruct_completion(_resp("r", "c"), tok, get_family("kimi-k2-thinking"))
    assert rc.ids[0] == tok.special_id("<think>") and rc.ids.count(tok.special_id("</think>")) == 1


def test_thinking_disabled_has_no_think_block(k25):
    tok, fam = k25
    rc = reconstruct_completion(_resp(None, "plain"), tok, fam, thinking=False)
    assert tok.special_id("</think>") not in rc.ids


def test_instruct_model_has_no_think_close(k2):
    tok, fam = k2
    rc = reconstruct_completion(_resp(None, "hello"), tok, fam)
    assert rc.ids == tok.encode_plain("hello") + [tok.special_id("<|im_end|>")]


def test_literal_special_text_in_content_stays_text(k25):
    tok, fam = k25
    rc = reconstruct_completion(_resp("r", 'print("<|im_end|>")'), tok, fam)
    assert rc.ids.count(tok.special_id("<|im_end|>")) == 1 and rc.ids[-1] == tok.special_id("<|im_end|>")


@pytest.mark.parametrize("finish", ["length", "error"])
def test_no_end_of_turn_unless_the_model_stopped(k25, finish):
    tok, fam = k25
    rc = reconstruct_completion(_resp("r", "partial", finish=finish), tok, fam)
    assert tok.special_id("<|im_end|>") not in rc.ids and not rc.stopped


def test_truncated_inside_reasoning_has_no_think_close(k25):
    tok, fam = k25
    rc = reconstruct_completion(_resp("long reasoning cut", "", finish="length"), tok, fam)
    assert tok.special_id("</think>") not in rc.ids


def test_tool_calls_with_conversation_wide_index_and_rebuilt_ids(k25):
    tok, fam = k25
    calls = [ToolCall("call_abc", "add", '{"a": 1}', 0), ToolCall("functions.mul:3", "mul", "{}", 1)]
    rc = reconstruct_completion(_resp("r", "", calls, finish="tool_calls"), tok, fam, tool_call_offset=2)
    assert rc.tool_id_rewrites == [{"call": 0, "original": "call_abc", "rebuilt": "functions.add:2"}]
    assert "tool_id_rebuilt" in rc.flags and "tool_id_index_unexpected" not in rc.flags
    sid = tok.special_id
    expected = ([*tok.encode_plain("r"), sid("</think>"), sid("<|tool_calls_section_begin|>"),
                 sid("<|tool_call_begin|>"), *tok.encode_plain("functions.add:2"), sid("<|tool_call_argument_begin|>"),
                 *tok.encode_plain('{"a": 1}'), sid("<|tool_call_end|>"),
                 sid("<|tool_call_begin|>"), *tok.encode_plain("functions.mul:3"), sid("<|tool_call_argument_begin|>"),
                 *tok.encode_plain("{}"), sid("<|tool_call_end|>"), sid("<|tool_calls_section_end|>"), sid("<|im_end|>")])
    assert rc.ids == expected


def test_native_id_with_unexpected_index_is_kept_and_flagged(k25):
    tok, fam = k25
    rc = reconstruct_completion(_resp("r", "", [ToolCall("functions.add:7", "add", "{}")], "tool_calls"), tok, fam)
    assert rc.tool_id_rewrites == [] and "tool_id_index_unexpected" in rc.flags


def test_tool_markup_inside_content_equals_structured_calls(k25):
    tok, fam = k25
    markup = ("Let me add.<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>"
              '{"a": 1}<|tool_call_end|><|tool_calls_section_end|>')
    leaked = reconstruct_completion(_resp("r", markup, finish="tool_calls"), tok, fam)
    clean = reconstruct_completion(_resp("r", "Let me add.", [ToolCall("functions.add:0", "add", '{"a": 1}')], "tool_calls"), tok, fam)
    assert leaked.ids == clean.ids and "tool_markup_in_content" in leaked.flags


def test_tool_markup_inside_reasoning(k25):
    tok, fam = k25
    markup = ("plan<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
              "<|tool_call_end|><|tool_calls_section_end|>")
    rc = reconstruct_completion(_resp(markup, "", finish="tool_calls"), tok, fam)
    assert "tool_markup_in_reasoning" in rc.flags and rc.segment_text("reasoning") == "plan"
    assert rc.segment_text("tool_id") == "functions.f:0"


def test_reasoning_inside_content_between_think_tags(k25):
    tok, fam = k25
    rc = reconstruct_completion(_resp(None, "<think> step one</think> The answer"), tok, fam)
    assert "reasoning_in_content" in rc.flags
    assert rc.segment_text("reasoning") == " step one" and rc.segment_text("content") == " The answer"


def test_replacement_character_is_flagged_lossy(k25):
    tok, fam = k25
    assert "lossy_text" in reconstruct_completion(_resp("r", "bad byte \ufffd here"), tok, fam).flags


def test_empty_and_null_content(k25):
    tok, fam = k25
    rc = reconstruct_completion(_resp("r", None), tok, fam)
    assert [s.kind for s in rc.segments] == ["reasoning", "think_close", "end_of_turn"]


def test_segments_point_at_exact_tokens(k25):
    tok, fam = k25
    rc = reconstruct_completion(_resp(" why", " because", [ToolCall("x", "f", "{}")], "tool_calls"), tok, fam)
    for seg in rc.segments:
        if seg.text is not None:
            assert tok.decode(rc.ids[seg.start:seg.end]) == seg.text
        else:
            assert seg.end - seg.start == 1


def test_count_tool_calls():
    msgs = [{"role": "user"}, {"role": "assistant", "tool_calls": [{}, {}]}, {"role": "tool"}, {"role": "assistant", "tool_calls": [{}]}]
    assert count_tool_calls(msgs) == 3


def test_every_recorded_response_reconstructs(k2, recorded):
    """No crash on any real record; completion counts compared with usage and reported per provider."""
    tok, fam = k2
    by_provider: dict[str, Counter] = defaultdict(Counter)
    for rec in recorded:
        parsed = parse_response(rec["response_raw"], rec["status"])
        rc = reconstruct_completion(parsed, tok, fam, count_tool_calls(rec["request"]["messages"]))
        assert rc.stopped and rc.ids[-1] == tok.special_id("<|im_end|>")
        for seg in rc.segments:
            if seg.text is not None:
                assert tok.decode(rc.ids[seg.start:seg.end]) == seg.text
        by_provider[parsed.provider][len(rc.ids) - parsed.completion_tokens] += 1
    print("\ncompletion diff (ours - billed) per provider:", json.dumps({k: dict(v) for k, v in sorted(by_provider.items())}))
    # Providers that count <|im_end|> match exactly on plain replies; DeepInfra and SiliconFlow do not count it.
    for provider in ("BaseTen", "Chutes", "Fireworks", "WandB"):
        assert set(by_provider[provider]) == {0}, provider
    assert by_provider["SiliconFlow"] == Counter({1: 24})
    exact_or_eot = sum(n for c in by_provider.values() for d, n in c.items() if d in (0, 1))
    assert exact_or_eot / len(recorded) > 0.85


def _all_code_points_in_pieces(size: int = 4096):
    points = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    for i in range(0, len(points), size):
        yield "".join(map(chr, points[i:i + size]))


def test_segments_json_is_the_standard_librarys_spelling_for_every_code_point():
    """The part's ``segments`` column is written by segments_json; its bytes must stay those of
    json.dumps(..., ensure_ascii=False), or every stored shard (and the hidden states extracted from
    it) would be rebuilt on upgrade."""
    from eagledata.tokens.reconstruct import Segment, segments_json

    for text in _all_code_points_in_pieces():
        segs = [Segment("think_open", 0, 1), Segment("reasoning", 1, 9, text), Segment("tool_arguments", 9, 12, text[:40], 2),
                Segment("end_of_turn", 12, 13, None, None)]
        assert segments_json(segs) == json.dumps([s.to_dict() for s in segs], ensure_ascii=False)
    assert segments_json([]) == "[]"


def test_segments_json_falls_back_to_the_standard_library_for_a_lone_surrogate():
    from eagledata.tokens.reconstruct import Segment, segments_json

    segs = [Segment("content", 0, 2, "a\ud800b")]
    assert segments_json(segs) == json.dumps([s.to_dict() for s in segs], ensure_ascii=False)

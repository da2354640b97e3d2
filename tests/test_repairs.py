"""Adversarial samples for the verdict logic: each case is built from true token ids, then a
provider transformation is applied to the text while the billed counts stay those of the truth."""
import json

import polars as pl

from eagledata.tokens.checks import _structure_codes, learn_conventions
from eagledata.text.chat import prompt_ids
from eagledata.tokens.reconstruct import reconstruct_completion
from eagledata.tokens.responses import ParsedResponse, ToolCall
from eagledata.tokens.shards import build_token_shards, read_shards

MSGS = [{"role": "user", "content": "How many?"}]


def _true_len(tok, fam, reasoning, content, calls=(), finish="stop"):
    p = ParsedResponse(streamed=False, reasoning=reasoning, content=content, tool_calls=list(calls), finish_reason=finish)
    return len(reconstruct_completion(p, tok, fam).ids)


def _rec(rid, provider, reasoning, content, billed, n_prompt, calls=None, finish="stop"):
    msg = {"role": "assistant", "reasoning": reasoning, "content": content}
    if calls:
        msg["tool_calls"] = [{"id": c[0], "type": "function", "function": {"name": c[1], "arguments": c[2]}} for c in calls]
    body = {"id": rid, "provider": provider, "choices": [{"index": 0, "finish_reason": finish, "message": msg}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": billed}}
    return {"id": rid, "request": {"messages": MSGS}, "status": 200, "response_raw": json.dumps(body)}


def _judge(tok, fam, tmp_path, records):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    res = build_token_shards(path, tmp_path / "t", tok, fam, "adv")
    df = read_shards(tmp_path / "t")
    return {r["id"]: r for r in df.iter_rows(named=True)}, res.manifest


def test_wrong_special_id_in_place_of_end_of_turn_is_caught(k25):
    tok, fam = k25
    rc = reconstruct_completion(ParsedResponse(streamed=False, reasoning=" r", content=" c", finish_reason="stop"), tok, fam)
    assert _structure_codes(rc, tok, fam, truncated=False) == []
    rc.ids[-1] = 163533  # the ordinary token 'chas', not <|im_end|> (163586)
    assert "end_of_turn_misplaced" in _structure_codes(rc, tok, fam, truncated=False)


def test_non_canonical_split_is_never_exact(k25, tmp_path):
    """The model emitted 'hel'+'lo' (two ids) where we re-encode 'hello' (one): identical text,
    billed count one higher. Only the count reveals it."""
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    r, c = " Thinking about it.", " hello world"
    canonical = _true_len(tok, fam, r, c)
    rows, _ = _judge(tok, fam, tmp_path, [
        _rec("ok", "P", r, c, canonical, n_prompt),
        _rec("ok2", "P", r, c, canonical, n_prompt),
        _rec("split", "P", r, c, canonical + 1, n_prompt),
    ])
    assert rows["ok"]["verdict"] == "exact"
    assert rows["split"]["verdict"] == "mismatch" and "completion_count_mismatch" in rows["split"]["reasons"]
    assert rows["split"]["completion_diff"] == -1 and not rows["split"]["train"]


def test_stripped_leading_space_is_repaired_only_when_unique(k25, tmp_path):
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    r = " Let me count."
    # ' pneumonoultra' merges into fewer tokens than 'pneumonoultra', '\npneumonoultra', ...: only a
    # restored single space explains the billed count -> provable repair
    true_c = " pneumonoultra is here."
    lens = {p: len(tok.encode_plain(p + true_c.lstrip())) for p in ("", " ", "\n", "\n\n", "  ")}
    assert list(lens.values()).count(lens[" "]) == 1
    # ' The' and 'The' are one token each: stripping is invisible to the count -> ambiguous
    neutral = " The answer is clear."
    assert len(tok.encode_plain(neutral)) == len(tok.encode_plain(neutral.lstrip()))
    rows, manifest = _judge(tok, fam, tmp_path, [
        _rec("honest", "Clean", r, true_c, _true_len(tok, fam, r, true_c), n_prompt),
        _rec("strip1", "Stripper", r, true_c.lstrip(), _true_len(tok, fam, r, true_c), n_prompt),
        _rec("strip1b", "Stripper", r, true_c.lstrip(), _true_len(tok, fam, r, true_c), n_prompt),  # a second proof
        _rec("strip2", "Stripper", r, neutral.lstrip(), _true_len(tok, fam, r, neutral), n_prompt),
        _rec("strip42", "Stripper", r, "42 apples.", _true_len(tok, fam, r, " 42 apples."), n_prompt),
        _rec("clean-neutral", "Clean", r, neutral.lstrip(), _true_len(tok, fam, r, neutral.lstrip()), n_prompt),
        # strip2's text with a tool call whose provider id is rebuilt (repaired during reconstruction)
        _rec("strip2-call", "Stripper", r, neutral.lstrip(),
             _true_len(tok, fam, r, neutral, [ToolCall("functions.add:0", "add", '{"a": 1}')], "tool_calls"), n_prompt,
             [("call_1", "add", '{"a": 1}')], "tool_calls"),
    ])
    s1 = rows["strip1"]
    assert s1["verdict"] == "repaired" and "whitespace_restored" in s1["reasons"]
    assert s1["input_ids"][s1["prompt_len"]:] == reconstruct_completion(
        ParsedResponse(streamed=False, reasoning=r, content=true_c, finish_reason="stop"), tok, fam).ids
    evidence = json.loads(s1["repair"])
    assert evidence["status"] == "unique" and evidence["transforms"] == ["whitespace_restored:content=' '"]
    # ' 42' and '\n42' both explain the count: ambiguous, never a guess
    assert rows["strip42"]["verdict"] == "mismatch" and "repair_ambiguous" in rows["strip42"]["reasons"]
    # same count with or without the space, from a provider proven to strip: never exact
    assert rows["strip2"]["verdict"] == "mismatch" and "whitespace_ambiguous" in rows["strip2"]["reasons"]
    # its ids stay the text the provider returned: the restored candidate is evidence, never stored
    s2 = rows["strip2"]
    assert s2["input_ids"][s2["prompt_len"]:] == reconstruct_completion(
        ParsedResponse(streamed=False, reasoning=r, content=neutral.lstrip(), finish_reason="stop"), tok, fam).ids
    assert json.loads(s2["repair"])["status"] == "unique"
    # a sample repaired during reconstruction is no exception: ambiguous too, never admitted
    call = rows["strip2-call"]
    assert call["verdict"] == "mismatch" and {"tool_id_rebuilt", "whitespace_ambiguous"} <= set(call["reasons"])
    assert not call["train"]
    # the same text from a provider never seen stripping stays exact
    assert rows["clean-neutral"]["verdict"] == "exact"
    assert manifest["conventions"]["Stripper"]["transformations_seen"] == {"whitespace_restored": 2, "tool_id_rebuilt": 1}


def test_compact_json_arguments_are_respaced(k25, tmp_path):
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    r = " Use the tool."
    spaced, compact = '{"b": 3, "a": 2}', '{"b":3,"a":2}'  # unsorted: no sorting re-serializer wrote it
    truth = _true_len(tok, fam, r, "", [ToolCall("functions.add:0", "add", spaced)], "tool_calls")
    rows, _ = _judge(tok, fam, tmp_path, [
        _rec("compact", "Groq-like", r, "", truth, n_prompt, [("functions.add:0", "add", compact)], "tool_calls"),
        _rec("compact2", "Groq-like", r, "", truth, n_prompt, [("functions.add:0", "add", compact)], "tool_calls"),
        _rec("plain", "Groq-like", r, " ok", _true_len(tok, fam, r, " ok"), n_prompt),
    ])
    row = rows["compact"]
    assert row["verdict"] == "repaired" and "tool_arguments_respaced" in row["reasons"]
    args = [s for s in json.loads(row["segments"]) if s["kind"] == "tool_arguments"]
    assert args[0]["text"] == spaced


def test_one_sample_alone_never_proves_a_repair(k25, tmp_path):
    """A transformation is a provider's behaviour only with two samples evidencing it: one sample
    whose billed count is off (a billing glitch) explains itself through a whitespace prefix and was
    then 'repaired' with text the model never wrote; alone it stays a mismatch, never trained."""
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    r, true_c = " Let me count.", " pneumonoultra is here."
    text = true_c.lstrip()  # what the provider returned; its count as if a space had been stripped
    rows, manifest = _judge(tok, fam, tmp_path, [
        _rec("glitch", "P", r, text, _true_len(tok, fam, r, true_c), n_prompt),
        _rec("fine", "P", r, " ok", _true_len(tok, fam, r, " ok"), n_prompt),
        _rec("fine2", "P", r, " fine", _true_len(tok, fam, r, " fine"), n_prompt),
    ])
    g = rows["glitch"]
    assert g["verdict"] == "mismatch" and "completion_count_mismatch" in g["reasons"] and not g["train"], g["reasons"]
    assert g["input_ids"][g["prompt_len"]:] == reconstruct_completion(
        ParsedResponse(streamed=False, reasoning=r, content=text, finish_reason="stop"), tok, fam).ids
    assert rows["fine"]["verdict"] == rows["fine2"]["verdict"] == "exact"
    assert "whitespace_restored" not in manifest["conventions"]["P"].get("transformations_seen", {})


def test_conventions_are_only_the_known_two(k25):
    from eagledata.tokens.checks import SampleStats

    stats = [SampleStats(f"s{i}", "Odd", "stop", 10, 20, 0, True, 10, 17, None) for i in range(5)]
    conv = learn_conventions(stats)  # billed 3 below ours: no known convention explains it
    assert conv["Odd"]["convention"] == "unknown"


def test_arguments_nested_too_deeply_are_not_respaced_and_do_not_crash():
    from eagledata.tokens.repairs import _respaced
    assert _respaced('{"a":1,"b":[2,3]}') == '{"a": 1, "b": [2, 3]}' and _respaced('{"a": 1}') is None
    assert _respaced("[" * 5000 + "]" * 5000) is None and _respaced('{"a":') is None


def test_a_sample_never_proves_its_own_count_convention(k25, tmp_path):
    """A sample is judged under the convention its provider's other samples support: a finish reason
    seen once, whose ids hold one token more than the model produced, is judged under the provider's
    convention (a mismatch), not under the one its own count happens to agree with; a provider seen
    once has no convention (unknown); two samples of a finish reason that agree support each other."""
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    r, call = " Let me think.", [ToolCall("functions.add:0", "add", '{"a": 1}')]
    calls = [("functions.add:0", "add", '{"a": 1}')]
    true_n = _true_len(tok, fam, r, " Sure", call, "tool_calls")
    assert _true_len(tok, fam, r, " Sure!!", call, "tool_calls") == true_n + 1
    records = [_rec(f"chat{i}", "P", r, f" Answer {i}.", _true_len(tok, fam, r, f" Answer {i}."), n_prompt) for i in range(5)]
    records.append(_rec("extra-token", "P", r, " Sure!!", true_n, n_prompt, calls, "tool_calls"))
    records.append(_rec("once", "Q", r, " Answer.", _true_len(tok, fam, r, " Answer.") - 1, n_prompt))
    rows, manifest = _judge(tok, fam, tmp_path, records)
    assert manifest["conventions"]["P"]["by_finish"]["tool_calls"]["convention"] == "excludes_eot"  # its own count
    extra = rows["extra-token"]
    assert extra["verdict"] == "mismatch" and "completion_count_mismatch" in extra["reasons"] and not extra["train"]
    assert extra["completion_diff"] == 1  # under P's convention: counts_eot
    once = rows["once"]
    assert once["verdict"] == "mismatch" and "unknown_count_convention" in once["reasons"] and not once["train"]
    assert all(rows[f"chat{i}"]["verdict"] == "exact" for i in range(5))
    # a second tool_calls sample of P whose count agrees under excludes_eot too: independent evidence
    # that P does not count <|im_end|> after a tool call, so each supports the other
    records.append(_rec("second", "P", r, " Fine!!", _true_len(tok, fam, r, " Fine!!", call, "tool_calls") - 1,
                        n_prompt, calls, "tool_calls"))
    (tmp_path / "two").mkdir()
    rows, _ = _judge(tok, fam, tmp_path / "two", records)
    assert rows["extra-token"]["verdict"] == rows["second"]["verdict"] == "exact"


def test_an_end_that_is_not_proven_is_never_exact(k25, tmp_path):
    """Only a stop reason proves the model's end-of-turn, and only 'length' is a known cut: a content
    filter, an abort or no finish reason at all (as a stream that just ends) blocks the sample even
    when its count agrees; a 'stop' when the request set stop sequences may be one of them, trimmed
    from the text, so it proves no end-of-turn either."""
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    r = " Let me think."
    records = [_rec(f"ok{i}", "P", r, f" Answer {i}.", _true_len(tok, fam, r, f" Answer {i}."), n_prompt) for i in range(3)]
    for finish in ("content_filter", None, "abort"):  # cut: no end-of-turn, the count agrees without one
        records.append(_rec(f"cut-{finish}", "P", r, " The answer is", _true_len(tok, fam, r, " The answer is", (), finish),
                            n_prompt, finish=finish))
    stopped = _rec("stop-sequence", "P", r, " The answer is 5.", _true_len(tok, fam, r, " The answer is 5."), n_prompt)
    stopped["request"]["stop"] = ["\n\n"]
    records.append(stopped)
    rows, _ = _judge(tok, fam, tmp_path, records)
    assert all(rows[f"ok{i}"]["verdict"] == "exact" for i in range(3))
    for finish in ("content_filter", None, "abort"):
        row = rows[f"cut-{finish}"]
        assert row["completion_diff"] == 0 and row["verdict"] == "mismatch" and not row["train"], row
        assert "finish_unproven" in row["reasons"]
    row = rows["stop-sequence"]
    assert row["completion_diff"] == 0 and row["verdict"] == "mismatch" and "stop_sequence_requested" in row["reasons"]


def test_arguments_with_a_fraction_are_not_respaced(k25, tmp_path):
    """A number's spelling does not survive a re-serialization (19.90 and 19.9 may count alike): a
    compact text holding one is no respacing candidate, whatever the provider is known to do."""
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    r = " Use the tool."
    spaced, compact = '{"b": 3, "a": 2}', '{"b":3,"a":2}'  # unsorted: no sorting re-serializer wrote it
    model, sent = '{"item": "book", "price": 19.90}', '{"item":"book","price":19.90}'
    truth = _true_len(tok, fam, r, "", [ToolCall("functions.add:0", "add", spaced)], "tool_calls")
    priced = _true_len(tok, fam, r, "", [ToolCall("functions.f:0", "f", model)], "tool_calls")
    rows, _ = _judge(tok, fam, tmp_path, [
        _rec("compact", "Q", r, "", truth, n_prompt, [("functions.add:0", "add", compact)], "tool_calls"),
        _rec("compact2", "Q", r, "", truth, n_prompt, [("functions.add:0", "add", compact)], "tool_calls"),
        _rec("plain", "Q", r, " ok", _true_len(tok, fam, r, " ok"), n_prompt),
        _rec("plain2", "Q", r, " fine", _true_len(tok, fam, r, " fine"), n_prompt),
        _rec("price", "Q", r, "", priced, n_prompt, [("functions.f:0", "f", sent)], "tool_calls"),
    ])
    assert rows["compact"]["verdict"] == "repaired"  # Q is proven to compact its arguments
    price = rows["price"]
    assert price["verdict"] == "mismatch" and not price["train"] and "tool_arguments_respaced" not in price["reasons"]


def test_a_stop_sequence_finish_casts_no_vote_and_engine_ids_prove_only_an_end_of_turn(k25, k2, tmp_path):
    """Samples whose 'stop' may be a trimmed stop string cast no count-convention vote (three of them
    would otherwise teach a provider that excludes <|im_end|> to count it, and a tool call one token
    short would pass); an engine's own ids exempt a 'stop' only when they end in <|im_end|>."""
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    r, call = " Let me think.", [ToolCall("functions.add:0", "add", '{"a": 1}')]
    records = [_rec(f"hit{i}", "P", r, f" Answer {i}.", _true_len(tok, fam, r, f" Answer {i}."), n_prompt) for i in range(3)]
    records.append(_rec("natural", "P", r, " Done.", _true_len(tok, fam, r, " Done.") - 1, n_prompt))
    true_n = _true_len(tok, fam, r, " Sure!!", call, "tool_calls")  # the model's; P excludes <|im_end|>
    records.append(_rec("short-call", "P", r, " Sure", true_n - 1, n_prompt, [("functions.add:0", "add", '{"a": 1}')],
                        "tool_calls"))
    for rec in records:
        rec["request"]["stop"] = ["\n\n"]
    rows, manifest = _judge(tok, fam, tmp_path, records)
    assert sum(manifest["conventions"]["P"]["support"].values()) == 1  # the tool call's own: no 'stop' votes
    assert rows["short-call"]["verdict"] == "mismatch" and not rows["short-call"]["train"]
    # an SGLang chat answer with its own ids: stopped at <|im_end|> it is proven; at the stop string not
    tok2, fam2 = k2
    msgs = [{"role": "user", "content": "Count to 3"}]
    pids = prompt_ids(tok2, msgs)
    eot = tok2.special_id(fam2.end_of_turn)
    engine = []
    for rid, text, stopped in (("eot", "1, 2, 3.", True), ("eot2", "One two three.", True),
                               ("stop-string", "1, 2, 3.\n\n", False)):
        ids = tok2.encode_plain(text) + ([eot] if stopped else [])
        body = {"id": rid, "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
                "matched_stop": eot if stopped else "\n\n", "message": {"role": "assistant", "content": text.rstrip("\n")}}],
                "usage": {"prompt_tokens": len(pids), "completion_tokens": len(ids)}}
        engine.append({"id": rid, "backend": "sglang", "request": {"messages": msgs, "stop": ["\n\n"]}, "status": 200,
                       "response_raw": json.dumps(body), "token_ids": ids, "prompt_token_ids": pids})
    (tmp_path / "engine").mkdir()
    rows, _ = _judge(tok2, fam2, tmp_path / "engine", engine)
    assert rows["eot"]["verdict"] == rows["eot2"]["verdict"] == "exact" and rows["eot"]["train"]
    assert rows["stop-string"]["verdict"] == "mismatch" and "stop_sequence_requested" in rows["stop-string"]["reasons"]


def test_reasoning_alone_is_exact_only_where_the_reasoning_count_witnesses_its_end(k25, tmp_path):
    """A provider whose parser never split the content off returns it all as reasoning: same total,
    </think> after the content. Only the reasoning count can tell; where it is not reported, reported
    as 0 (or not a checksum), a thinking answer of reasoning alone is not proven."""
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    r = " Let me count the apples one by one. The answer is 42."
    total = _true_len(tok, fam, r, "")
    reasoning = reconstruct_completion(ParsedResponse(streamed=False, reasoning=r, content="", finish_reason="stop"),
                                       tok, fam).reasoning_tokens

    def rec(rid, details):
        body = json.loads(_rec(rid, "P", r, "", total, n_prompt)["response_raw"])
        if details is not None:
            body["usage"]["completion_tokens_details"] = {"reasoning_tokens": details}
        return {**_rec(rid, "P", r, "", total, n_prompt), "response_raw": json.dumps(body)}

    other = [_rec(f"ok{i}", "P", r, " 42.", _true_len(tok, fam, r, " 42."), n_prompt) for i in range(3)]
    rows, _ = _judge(tok, fam, tmp_path, other + [rec("unreported", None), rec("zero", 0), rec("witnessed", reasoning)])
    for rid in ("unreported", "zero"):
        assert rows[rid]["verdict"] == "mismatch" and "reasoning_boundary_unproven" in rows[rid]["reasons"], rows[rid]["reasons"]
        assert not rows[rid]["train"]
    assert rows["witnessed"]["verdict"] == "exact" and rows["witnessed"]["train"], rows["witnessed"]["reasons"]
    assert all(rows[f"ok{i}"]["verdict"] == "exact" for i in range(3))


def test_whitespace_ambiguity_is_checked_whatever_the_prompt_verdict(k25, tmp_path):
    """A provider proven to strip leading spaces: a completion whose count matches with and without the
    space is ambiguous even when the provider also rendered the prompt differently (a differing prompt
    made the sample's joint verdict mismatch, and the check skipped it: its completion stayed exact and
    the default policy, which admits a differing prompt, trained on ids that may not be the model's)."""
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    r, true_c, neutral = " Let me count.", " pneumonoultra is here.", " The answer is clear."
    rows, _ = _judge(tok, fam, tmp_path, [
        _rec("strip1", "Stripper", r, true_c.lstrip(), _true_len(tok, fam, r, true_c), n_prompt),
        _rec("strip1b", "Stripper", r, true_c.lstrip(), _true_len(tok, fam, r, true_c), n_prompt),
        _rec("strip2-prompt", "Stripper", r, neutral.lstrip(), _true_len(tok, fam, r, neutral), n_prompt - 1),
        *(_rec(f"votes{i}", "Stripper", r, "Yes.", _true_len(tok, fam, r, "Yes."), n_prompt) for i in range(2)),
    ])  # (votes*: samples whose counts agree as they came, the provider's count convention)
    s = rows["strip2-prompt"]
    assert s["prompt_verdict"] == "differs" and "whitespace_ambiguous" in s["reasons"]
    assert s["completion_verdict"] == "mismatch" and not s["train"]


def _stats(n, provider, finish, ours, billed, codes=()):
    from eagledata.tokens.checks import SampleStats
    return [SampleStats(f"{provider}-{finish}-{billed}-{i}", provider, finish, 10, ours, 0, True, 10, billed, None,
                        codes=list(codes)) for i in range(n)]


def test_compact_arguments_cast_no_count_convention_vote():
    """A provider that re-serializes tool arguments compactly and bills the model's spaced text
    without <|im_end|>: a call whose compaction saved one token agrees under counts_eot (ours, with
    the compact ids and <|im_end|>, equals the billed spaced count). Such votes, most of a tool-call
    group, flipped its convention and admitted the compact ids as exact. They cast no vote now: the
    group follows its other samples, else the provider's; spaced tool calls still teach their own."""
    from eagledata.tokens import summaries
    from eagledata.tokens.checks import convention_for, count_vote, verdict

    compact = _stats(15, "P", "tool_calls", 30, 30, ["tool_arguments_compact"])  # agree under counts_eot
    stats = _stats(10, "P", "stop", 20, 19) + compact + _stats(2, "P", "tool_calls", 30, 29)
    conv = learn_conventions(stats)
    assert conv["P"]["convention"] == "excludes_eot" and conv["P"]["support"] == {"excludes_eot": 12}
    assert conv["P"]["by_finish"]["tool_calls"] == {"convention": "excludes_eot", "support": {"excludes_eot": 2}}
    assert count_vote(compact[0]) is None
    assert convention_for(conv, "P", "tool_calls", count_vote(compact[0])) == "excludes_eot"
    v, reasons = verdict(compact[0], convention_for(conv, "P", "tool_calls", count_vote(compact[0])))
    assert v == "mismatch" and "completion_count_mismatch" in reasons  # the respacing repair may prove it
    # a group of compact calls alone follows the provider's convention; a provider of compact calls alone has none
    only_compact = learn_conventions(_stats(5, "Q", "stop", 20, 19) + _stats(9, "Q", "tool_calls", 30, 30,
                                                                            ["tool_arguments_compact"]))
    assert "tool_calls" not in only_compact["Q"]["by_finish"]
    assert convention_for(only_compact, "Q", "tool_calls") == "excludes_eot"
    assert learn_conventions(_stats(4, "R", "tool_calls", 30, 30, ["tool_arguments_compact"]))["R"]["convention"] == "unknown"
    # a group never counts <|im_end|> where its provider does not (group_convention): samples one token
    # short (a shared loss) would agree so; a real stack counting it only after calls is judged one token long
    flipped = learn_conventions(stats + _stats(3, "P", "tool_calls", 31, 31))
    assert flipped["P"]["by_finish"]["tool_calls"] == {"convention": "excludes_eot",
                                                       "support": {"counts_eot": 3, "excludes_eot": 2}}
    assert convention_for(flipped, "P", "tool_calls", "counts_eot") == "excludes_eot"
    # the other way round stands: a provider counting <|im_end|> whose tool calls do not (Moonshot AI),
    # also where its tool calls outnumber its plain answers (the provider's own pick is then excludes_eot)
    for n_calls in (4, 40):
        other = learn_conventions(_stats(10, "M", "stop", 20, 20) + _stats(n_calls, "M", "tool_calls", 30, 29))
        assert other["M"]["by_finish"]["tool_calls"]["convention"] == "excludes_eot"
        assert other["M"]["by_finish"]["stop"]["convention"] == "counts_eot"
        assert convention_for(other, "M", "tool_calls", "excludes_eot") == "excludes_eot"
        assert convention_for(other, "M", "stop", "counts_eot") == "counts_eot"
        merged, _, _ = summaries.learn(summaries.merge([summaries.summarize(_stats(10, "M", "stop", 20, 20)),
                                                        summaries.summarize(_stats(n_calls, "M", "tool_calls", 30, 29))]))
        assert merged["M"]["by_finish"] == other["M"]["by_finish"]
    # the per-shard summaries learn the same
    learned, _, _ = summaries.learn(summaries.merge([summaries.summarize(stats[:12]), summaries.summarize(stats[12:])]))
    assert learned["P"]["support"] == conv["P"]["support"]
    assert learned["P"]["by_finish"]["tool_calls"] == conv["P"]["by_finish"]["tool_calls"]


def test_compact_json_is_told_from_spaced_json():
    from eagledata.tokens.checks import compact_json

    for text in ('{"a":1}', '[1,2]', '{"k":false}', '{"a":"x, y: z"}', '{"a":{"b":[1,{"c":"\\"q: r\\""}]}}',
                 '{"p":19.90}'):
        assert compact_json(text), text
    for text in ('{"a": 1}', '{}', '[]', '"a,b:c"', '{"a":', 'not json', '', '{"a":1, "b":2}', '{\n"a":1}', '[1]'):
        assert not compact_json(text), text


def test_compact_arguments_that_count_alike_spaced_are_ambiguous(k25, tmp_path):
    """Spacing ``{"k":false}`` costs no token (`` false`` is one token as ``false`` is): a compact
    call's count agrees with the model's spaced arguments as with the returned ones, so its ids cannot
    be singled out, whether or not the provider is known to compact (it was admitted as exact)."""
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    r = " Use the tool."
    spaced, compact = '{"k": false}', '{"k":false}'
    truth = _true_len(tok, fam, r, "", [ToolCall("functions.f:0", "f", spaced)], "tool_calls")
    assert truth == _true_len(tok, fam, r, "", [ToolCall("functions.f:0", "f", compact)], "tool_calls")
    rows, _ = _judge(tok, fam, tmp_path, [
        _rec("flag", "C", r, "", truth, n_prompt, [("functions.f:0", "f", compact)], "tool_calls"),
        _rec("plain", "C", r, " ok", _true_len(tok, fam, r, " ok"), n_prompt),
        _rec("plain2", "C", r, " fine", _true_len(tok, fam, r, " fine"), n_prompt),
        _rec("spaced", "C", r, "", truth, n_prompt, [("functions.f:0", "f", spaced)], "tool_calls"),
    ])
    flag = rows["flag"]
    assert flag["verdict"] == "mismatch" and not flag["train"], flag["reasons"]
    assert {"tool_arguments_compact", "tool_arguments_ambiguous"} <= set(flag["reasons"])
    assert rows["spaced"]["verdict"] == rows["plain"]["verdict"] == "exact"


def test_a_repair_that_keeps_compact_arguments_is_ambiguous_when_spacing_counts_alike(k25, tmp_path):
    """A provider proven to strip leading spaces (not to compact): a sample with a stripped space and
    compact ``{"k":false}`` arguments is explained by the space restored with the arguments as they
    came and with the model's spacing too (which costs no token there): no single candidate, a
    mismatch (it was repaired with the compact arguments kept)."""
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    r, true_c = " Let me count.", " pneumonoultra is here."
    assert _true_len(tok, fam, r, true_c) != _true_len(tok, fam, r, true_c.lstrip())
    call = [ToolCall("functions.f:0", "f", '{"k": false}')]
    records = [_rec(f"strip{i}", "S", r, true_c.lstrip(), _true_len(tok, fam, r, true_c), n_prompt) for i in range(2)]
    records += [_rec(f"plain{i}", "S", r, f" Answer {i}.", _true_len(tok, fam, r, f" Answer {i}."), n_prompt) for i in range(3)]
    records.append(_rec("both", "S", r, true_c.lstrip(), _true_len(tok, fam, r, true_c, call, "tool_calls"), n_prompt,
                        [("functions.f:0", "f", '{"k":false}')], "tool_calls"))
    rows, _ = _judge(tok, fam, tmp_path, records)
    assert rows["strip0"]["verdict"] == "repaired" and "whitespace_restored" in rows["strip0"]["reasons"]
    both = rows["both"]
    assert both["verdict"] == "mismatch" and "repair_ambiguous" in both["reasons"] and not both["train"], both["reasons"]


def test_integers_a_double_cannot_hold_are_not_respaced():
    """A re-serializer reading numbers as doubles (JavaScript) rewrites an integer beyond 2**53 with
    other digits and most likely the same count: such compact text is no respacing candidate."""
    from eagledata.tokens.repairs import _respaced
    assert _respaced('{"id":9007199254740992}') == '{"id": 9007199254740992}'
    for big in ("9007199254740993", "12345678901234567000", "-12345678901234567890"):
        assert _respaced('{"id":%s}' % big) is None, big
        assert _respaced('{"ids":[1,{"n":%s}]}' % big) is None, big


MODEL_ARGS = '{"origin": "Lisbon", "destination": "Oslo"}'  # the model's order: not sorted
SORTED_SPACED = '{"destination": "Oslo", "origin": "Lisbon"}'  # a sort_keys re-serializer's, same count
SORTED_COMPACT = '{"destination":"Oslo","origin":"Lisbon"}'


def _call_rec(tok, fam, n_prompt, rid, provider, returned, truth_args=MODEL_ARGS):
    """A tool call whose billed count is the model's (``truth_args``) and whose returned arguments are ``returned``."""
    r = " Book it."
    truth = _true_len(tok, fam, r, "", [ToolCall("functions.book:0", "book", truth_args)], "tool_calls")
    return _rec(rid, provider, r, "", truth, n_prompt, [("functions.book:0", "book", returned)], "tool_calls")


def test_a_sorted_key_order_is_never_respaced_into_a_repair(k25, tmp_path):
    """A provider re-dumping arguments with sorted keys and compact separators: respacing gives the
    model's count with the keys in the provider's order (counts cannot see order). Without proof that
    the provider keeps key order the sample stays a mismatch, its ids the returned text; a provider
    whose other arguments show unsorted keys (it does not sort) is repaired."""
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    assert _true_len(tok, fam, "x", "", [ToolCall("functions.book:0", "book", MODEL_ARGS)], "tool_calls") == \
        _true_len(tok, fam, "x", "", [ToolCall("functions.book:0", "book", SORTED_SPACED)], "tool_calls")
    keeper_args = '{"origin":"Lisbon","destination":"Oslo"}'
    rows, manifest = _judge(tok, fam, tmp_path, [
        _call_rec(tok, fam, n_prompt, "sorter1", "Sorter", SORTED_COMPACT),
        _call_rec(tok, fam, n_prompt, "sorter2", "Sorter", SORTED_COMPACT),
        _rec("plain", "Sorter", " r", " ok", _true_len(tok, fam, " r", " ok"), n_prompt),  # its convention
        # the same sorted arguments from a provider whose other samples keep an unsorted order
        _call_rec(tok, fam, n_prompt, "keeper-sorted", "Keeper", SORTED_COMPACT, SORTED_SPACED),
        _call_rec(tok, fam, n_prompt, "keeper1", "Keeper", keeper_args),
        _call_rec(tok, fam, n_prompt, "keeper2", "Keeper", keeper_args),
        _rec("plain-k", "Keeper", " r", " ok", _true_len(tok, fam, " r", " ok"), n_prompt),
    ])
    for rid in ("sorter1", "sorter2"):
        row = rows[rid]
        assert row["verdict"] == "mismatch" and not row["train"], row["reasons"]
        assert "tool_arguments_order_unproven" in row["reasons"] and "tool_arguments_respaced" not in row["reasons"]
        assert "completion_count_mismatch" in row["reasons"] and row["completion_diff"] != 0
        args = [s for s in json.loads(row["segments"]) if s["kind"] == "tool_arguments"]
        assert args[0]["text"] == SORTED_COMPACT  # the returned text, never the candidate
        assert json.loads(row["repair"])["status"] == "unique"  # the candidate stays evidence
    for rid in ("keeper-sorted", "keeper1"):
        assert rows[rid]["verdict"] == "repaired" and "tool_arguments_respaced" in rows[rid]["reasons"]
    assert "key_order_kept" not in manifest["conventions"]["Sorter"].get("transformations_seen", {})


def test_key_order_decision():
    from eagledata.tokens.repairs import key_order_in_question, shows_key_order_kept

    def parsed(*arguments):
        calls = [ToolCall(f"functions.f:{i}", "f", a, i) for i, a in enumerate(arguments)]
        return ParsedResponse(streamed=False, reasoning=None, content=None, tool_calls=calls, finish_reason="tool_calls")

    # nothing a sorter could have reordered: no object with two keys, or no JSON at all
    for args in ('{"b": 1}', '{"b": {"z": [1, {"y": 2}]}}', '[1, 2]', '{"b": ', ''):
        assert not key_order_in_question(parsed(args), order_kept=False), args
        assert not shows_key_order_kept(parsed(args)), args
    # sorted at every level (nested objects too): in question unless the provider is proven to keep order
    for args in ('{"a": 1, "b": 2}', '{"x": {"a": 1, "b": 2}}', '{"a": {"k": 1}, "b": [{"c": 1, "d": 2}]}'):
        assert key_order_in_question(parsed(args), order_kept=False), args
        assert not key_order_in_question(parsed(args), order_kept=True), args
        assert not shows_key_order_kept(parsed(args)), args
    # an unsorted object anywhere in the response proves this response was not key-sorted
    for args in (('{"b": 1, "a": 2}',), ('{"a": 1, "b": {"d": 1, "c": 2}}',), ('{"a": 1, "b": 2}', '{"q": 1, "p": 2}')):
        assert not key_order_in_question(parsed(*args), order_kept=False), args
        assert shows_key_order_kept(parsed(*args)), args
    # integer-like keys: JavaScript's JSON puts them first, so their order proves nothing
    assert key_order_in_question(parsed('{"2": 1, "10": 2}'), order_kept=False)
    assert not shows_key_order_kept(parsed('{"b": 1, "1": 2}'))


class _CountingTokenizer:
    """A tokenizer that counts the plain texts it is asked to encode."""

    def __init__(self, tok):
        self.tok, self.asked = tok, []

    def encode_plain(self, text):
        self.asked.append(text)
        return self.tok.encode_plain(text)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def _reference_candidates(answer, tok, fam, only):
    """(label, reconstruction) of every candidate a repair search of ``answer`` should try, built here from
    the transformations' definitions: a whitespace prefix put back before the reasoning or the content,
    the tool-call arguments re-serialized with the standard library's spacing."""
    from itertools import combinations, product

    from eagledata.tokens.repairs import (ARGUMENTS_RESPACED, WHITESPACE_CONTENT, WHITESPACE_PREFIXES,
                                          WHITESPACE_REASONING)

    def spaced(arguments):
        return json.dumps(json.loads(arguments))

    applies = {WHITESPACE_REASONING: not answer.reasoning[0].isspace(), WHITESPACE_CONTENT: not answer.content[0].isspace(),
               ARGUMENTS_RESPACED: any(spaced(c.arguments) != c.arguments for c in answer.tool_calls)}
    options = [t for t, ok in applies.items() if ok and (only is None or t in only)]
    for r in range(1, len(options) + 1):
        for combo in combinations(options, r):
            for variant in product(*((WHITESPACE_PREFIXES if t != ARGUMENTS_RESPACED else ("",)) for t in combo)):
                reasoning, content, calls = answer.reasoning, answer.content, answer.tool_calls
                for t, prefix in zip(combo, variant):
                    if t == WHITESPACE_REASONING:
                        reasoning = prefix + reasoning
                    elif t == WHITESPACE_CONTENT:
                        content = prefix + content
                    else:
                        calls = [ToolCall(c.id, c.name, spaced(c.arguments), c.index) for c in calls]
                label = [f"{t}={p!r}" if p else t for t, p in zip(combo, variant)]
                yield label, reconstruct_completion(ParsedResponse(streamed=False, reasoning=reasoning, content=content,
                                                                   tool_calls=calls, finish_reason=answer.finish_reason), tok, fam)


def test_one_samples_searches_share_its_candidates_and_find_what_a_fresh_search_finds(k25):
    """The judge searches a sample several times (each transformation alone, then its provider's known
    ones): searches through one SampleCandidates try, candidate for candidate, what the transformations
    define (built independently here), choose what a count check of those chooses, and encode each
    distinct text segment once however many candidates and searches hold it."""
    from eagledata.tokens.repairs import (ARGUMENTS_RESPACED, WHITESPACE_CONTENT, WHITESPACE_REASONING,
                                          SampleCandidates, search_repairs)

    tok, fam = k25
    calls = [ToolCall("functions.f:0", "f", '{"a":1,"b":[true,null]}', 0), ToolCall("functions.g:1", "g", '{"q":"x y"}', 1)]
    answer = ParsedResponse(streamed=False, reasoning="Thinking it over.", content="Calling.", tool_calls=calls,
                            finish_reason="tool_calls")
    # billed: the model's spacing and a space before the content (the one unique candidate), and one off it
    truth = len(reconstruct_completion(ParsedResponse(streamed=False, reasoning="Thinking it over.", content=" Calling.",
                                                      tool_calls=[ToolCall(c.id, c.name, json.dumps(json.loads(c.arguments)), c.index)
                                                                  for c in calls], finish_reason="tool_calls"), tok, fam).ids)
    searches = [(WHITESPACE_REASONING,), (WHITESPACE_CONTENT,), (ARGUMENTS_RESPACED,), None,
                (WHITESPACE_CONTENT, ARGUMENTS_RESPACED)]
    counting = _CountingTokenizer(tok)
    sample = SampleCandidates(answer)
    statuses = set()
    assert sample.applicable == [WHITESPACE_REASONING, WHITESPACE_CONTENT, ARGUMENTS_RESPACED]
    for billed in (truth, truth + 1):
        for only in searches:
            shared = search_repairs(sample, counting, fam, billed, None, "counts_eot", only=only)
            reference = list(_reference_candidates(answer, tok, fam, only))
            assert [(e["transforms"], e["completion_diff"], e["reasoning_tokens"], e["matches"]) for e in shared.evidence] == \
                [(label, len(rc.ids) - billed, rc.reasoning_tokens, len(rc.ids) == billed) for label, rc in reference]
            matching = [(label, rc) for label, rc in reference if len(rc.ids) == billed]
            expected = "unique" if len(matching) == 1 else "ambiguous" if matching else "none"
            assert shared.status == expected
            statuses.add(shared.status)
            if expected == "unique":
                assert list(shared.transforms) == matching[0][0]
                assert (shared.chosen.ids, shared.chosen.segments) == (matching[0][1].ids, matching[0][1].segments)
    assert statuses == {"unique", "ambiguous", "none"}  # (the whole search: a newline restored counts alike)
    assert len(counting.asked) == len(set(counting.asked))  # each distinct text once, for every search above
    assert "Thinking it over." in counting.asked and " Calling." in counting.asked
    assert answer.tool_calls == calls and answer.content == "Calling."  # the answer itself is left as it came

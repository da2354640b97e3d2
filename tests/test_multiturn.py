"""``turns: all``: conversations regenerated turn by turn against the stand-in (history = the model's
own replies of the same run, tool results spliced only on a matching call), resumed after kill -9
between turns with no turn paid twice; ShareGPT-style prompt lines; dedup; the plan's turn counts."""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from eagledata.generate.conversation import ConversationEnd, Reply, turn_request
from eagledata.generate.job import generate_dataset
from eagledata.generate.plan import plan_dataset
from eagledata.generate.prompts import PromptFileError, read_prompts
from eagledata.generate.requests import dataset_work
from eagledata.standin.server import prompt_hash
from eagledata.text.history import ToolCallText, assistant_message
from eagledata.tokens.responses import parse_response
from gen_helpers import API_KEY, StandInProcess, cache_lines, generate_cmd, make_config, quiet, read_jsonl, spawn


pytestmark = pytest.mark.timing  # runs alone under xdist (tests/conftest.py)


TOOL = [{"type": "function", "function": {"name": "status", "parameters": {
    "type": "object", "properties": {"region": {"type": "string", "enum": ["eu"]}}, "required": ["region"]}}}]


def conversation(cid: str, n_users: int, system: bool = True) -> dict:
    msgs = [{"role": "system", "content": "Be brief."}] if system else []
    for i in range(n_users):
        msgs.append({"role": "user", "content": f"{cid}: question {i}?"})
        if i < n_users - 1:
            msgs.append({"role": "assistant", "content": f"original answer {i} (another model's)"})
    return {"id": cid, "messages": msgs}


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def multiturn_config(tmp: Path, prompts: Path, tokenizer: str, backend: str = "simulator", **kw) -> dict:
    cfg = make_config(tmp, prompts, tokenizer, backend=backend, **kw)
    cfg["datasets"]["d"]["turns"] = "all"
    return cfg


def reply(raw: str) -> Reply:
    p = parse_response(raw)
    return Reply(p.reasoning, p.content, tuple(ToolCallText(c.name, c.arguments) for c in p.tool_calls))


def test_history_is_exactly_the_models_own_earlier_replies(k25, tmp_path):
    prompts = write(tmp_path / "p.jsonl", [conversation("a", 3), conversation("b", 2, system=False)])
    cfg = multiturn_config(tmp_path, prompts, k25[0].source)
    out = tmp_path / "out.jsonl"
    summary = generate_dataset(cfg, "d", out, log=quiet)
    recs = read_jsonl(out)
    assert [(r["id"], r["conversation"], r["turn"]) for r in recs] == [
        ("a#t0", "a", 0), ("a#t1", "a", 1), ("a#t2", "a", 2), ("b#t0", "b", 0), ("b#t1", "b", 1)]
    assert summary["conversations"]["complete"] == 2 and summary["conversations"]["ended_early"] == []
    for cid in ("a", "b"):
        turns = [r for r in recs if r["conversation"] == cid]
        for k, rec in enumerate(turns):
            history = [m for m in rec["request"]["messages"] if m["role"] == "assistant"]
            expected = [assistant_message(*(lambda r: (r.reasoning, r.content, r.tool_calls))(reply(t["response_raw"])),
                                          k25[1]) for t in turns[:k]]
            assert history == expected, (cid, k)
            assert not any("original answer" in (m.get("content") or "") for m in history)
            assert rec["request"]["messages"][-1] == {"role": "user", "content": f"{cid}: question {k}?"}
    # a rerun is all cache hits and writes the same records
    again = generate_dataset(cfg, "d", tmp_path / "again.jsonl", log=quiet)
    assert again["requested"] == 0 and read_jsonl(tmp_path / "again.jsonl") == recs


def test_tool_result_spliced_with_native_ids_when_the_call_matches(k25):
    fam = k25[1]
    record = [{"role": "user", "content": "status?"},
              {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                                   "function": {"name": "status", "arguments": {"region": "eu"}}}]},
              {"role": "tool", "tool_call_id": "c1", "content": "up"},
              {"role": "assistant", "content": "It is up."},
              {"role": "user", "content": "thanks"}]
    call = Reply("thinking", "", (ToolCallText("status", '{"region":  "eu"}'),))
    nxt = turn_request(record, [call], fam)
    native = fam.native_tool_call_id("status", 0)
    assert nxt[-1] == {"role": "tool", "tool_call_id": native, "content": "up"}
    assert nxt[-2]["tool_calls"][0]["id"] == native and nxt[-2]["tool_calls"][0]["function"]["arguments"] == '{"region":  "eu"}'
    after = turn_request(record, [call, Reply(None, "ok", ())], fam)
    assert after[-1] == {"role": "user", "content": "thanks"} and len(after) == 5
    other = turn_request(record, [Reply(None, "", (ToolCallText("status", '{"region": "us"}'),))], fam)
    assert isinstance(other, ConversationEnd) and not other.complete and "other arguments" in other.reason
    none = turn_request(record, [Reply(None, "no call", ())], fam)
    assert isinstance(none, ConversationEnd) and "without one" in none.reason


def test_tool_results_answer_the_calls_one_to_one_or_the_conversation_ends(k25):
    """Two calls sharing one id (or a result naming a call that is not there): one result was given to
    both calls and the other dropped, so the model's next answer was paid for and trained on wrong
    tool results. Results renamed wholesale (no id matches a call) still go by position."""
    fam = k25[1]

    def record(call_ids, result_ids):
        calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": '{"region": "eu"}'}}
                 for i, n in zip(call_ids, "fg")]
        return [{"role": "user", "content": "check"}, {"role": "assistant", "content": "", "tool_calls": calls},
                *[{"role": "tool", "tool_call_id": i, "content": f"result {k} ({i})"} for k, i in enumerate(result_ids)],
                {"role": "assistant", "content": "done"}, {"role": "user", "content": "thanks"}]

    model = Reply(None, "", (ToolCallText("f", '{"region": "eu"}'), ToolCallText("g", '{"region": "eu"}')))
    native = [fam.native_tool_call_id(n, i) for i, n in enumerate("fg")]
    for calls, results in ((["call", "call"], ["call", "call"]), (["c1", "c2"], ["zz", "c1"]), (["c1", "c2"], ["c1", "c1"])):
        end = turn_request(record(calls, results), [model], fam)
        assert isinstance(end, ConversationEnd) and "one to one" in end.reason, (calls, results)
    for results, expected in ((["c2", "c1"], ["result 1 (c1)", "result 0 (c2)"]),  # by id
                              (["x1", "x2"], ["result 0 (x1)", "result 1 (x2)"])):  # renamed: by position
        nxt = turn_request(record(["c1", "c2"], results), [model], fam)
        assert [(m["tool_call_id"], m["content"]) for m in nxt if m["role"] == "tool"] == list(zip(native, expected))


def test_a_tool_call_left_as_markup_in_the_text_is_a_call_in_the_next_turn(k25):
    """A provider that returns the model's tool call as raw markup inside content (or reasoning): the
    next turn reads it as the tokens stage does, a call answered by the original's tool result, not
    text followed by the next user message (which paid for turns on an unanswered call)."""
    from eagledata.generate.turns import reply_of

    fam = k25[1]
    record = [{"role": "user", "content": "status?"},
              {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                                   "function": {"name": "status", "arguments": '{"region": "eu"}'}}]},
              {"role": "tool", "tool_call_id": "c1", "content": "up"},
              {"role": "assistant", "content": "It is up."},
              {"role": "user", "content": "thanks"}]
    markup = (f"Checking.{fam.tool_section_begin}{fam.tool_call_begin}functions.status:0{fam.tool_argument_begin}"
              f'{{"region": "eu"}}{fam.tool_call_end}{fam.tool_section_end}')

    def rec(**message):
        body = {"id": "g", "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", **message}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 9}}
        return {"status": 200, "request": {"messages": record[:1]}, "response_raw": json.dumps(body)}

    for where in ("content", "reasoning"):
        got = reply_of(rec(**{where: markup}), fam)
        assert got.tool_calls == (ToolCallText("status", '{"region": "eu"}'),), where
        assert (got.content if where == "content" else got.reasoning) == "Checking."
        nxt = turn_request(record, [got], fam)
        assert nxt[-1] == {"role": "tool", "tool_call_id": fam.native_tool_call_id("status", 0), "content": "up"}, where
    plain = reply_of(rec(content="", reasoning="r"), fam)  # nothing misplaced: as returned ("" is not None)
    assert plain == Reply("r", "", ())


def test_a_mismatching_tool_call_ends_the_conversation_with_the_reason_and_keeps_its_turns(k25, tmp_path):
    """The model's call (or no call) cannot match an original with arguments outside the enum."""
    msgs = [{"role": "user", "content": "Check the status."},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "status", "arguments": '{"region": "mars"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "up"},
            {"role": "assistant", "content": "Up."},
            {"role": "user", "content": "Next?"}]
    prompts = write(tmp_path / "p.jsonl", [{"id": "t", "messages": msgs, "tools": TOOL}])
    cfg = multiturn_config(tmp_path, prompts, k25[0].source, tool_choice="required")
    logs: list[str] = []
    summary = generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=logs.append)
    recs = read_jsonl(tmp_path / "out.jsonl")
    assert [r["id"] for r in recs] == ["t#t0"]
    (early,) = summary["conversations"]["ended_early"]
    assert early["conversation"] == "t" and early["turns_answered"] == 1 and "other arguments" in early["reason"]
    saved = json.loads((tmp_path / "cache" / "d" / "generation_summary.json").read_text())
    assert saved["conversations"]["ended_early"] == [early]
    assert any("conversation t ended after 1 turn(s)" in m for m in logs)


def test_kill_9_between_turns_resumes_at_the_next_turn_and_pays_no_turn_twice(k25, tmp_path):
    sim = StandInProcess(k25[0].source, tmp_path, latency_ms=150)
    try:
        n = 6
        prompts = write(tmp_path / "p.jsonl", [conversation(f"c{i}", 3) for i in range(n)])
        cfg = multiturn_config(tmp_path, prompts, k25[0].source, backend="openrouter", api_base=sim.base_url,
                               concurrency=n)
        cmd = generate_cmd(cfg, tmp_path)
        proc = spawn(cmd, tmp_path / "run1.log")
        t0 = time.monotonic()
        while len(cache_lines(tmp_path)) < n and time.monotonic() - t0 < 30:  # every first turn answered
            assert proc.poll() is None, (tmp_path / "run1.log").read_text()
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        time.sleep(0.05)
        cached = cache_lines(tmp_path)
        before = sim.counters()["requests_per_prompt"]
        cached_hashes = {prompt_hash(r["request"]) for r in cached}
        assert len(cached) < 3 * n and {r["id"].split("#")[1] for r in cached} >= {"t0"}
        proc = spawn(cmd, tmp_path / "run2.log")
        assert proc.wait(60) == 0, (tmp_path / "run2.log").read_text()
        final = sim.counters()["requests_per_prompt"]
        assert len(final) == 3 * n
        for h in cached_hashes:  # answered before the kill: never requested again
            assert final[h] == before[h] == 1
        in_flight = {h for h, c in before.items() if h not in cached_hashes}
        assert all(c == 1 or (h in in_flight and c == 2) for h, c in final.items())
        assert f"{len(cached)} cached" in (tmp_path / "run2.log").read_text()
        recs = read_jsonl(tmp_path / "results" / "d" / "responses.jsonl")
        assert len(recs) == 3 * n and all(r["status"] == 200 for r in recs)
        by_id = {r["id"]: r for r in recs}
        for i in range(n):  # the history after the resume is still the model's own earlier replies
            last = by_id[f"c{i}#t2"]["request"]["messages"]
            assert last[2]["content"] == (parse_response(by_id[f"c{i}#t0"]["response_raw"]).content or "")
    finally:
        sim.stop()


def test_sharegpt_lines_convert_and_errors_name_file_line_field(tmp_path):
    good = write(tmp_path / "g.jsonl", [{"id": "s", "conversations": [
        {"from": "system", "value": "S"}, {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
        {"from": "human", "value": "bye"}]}])
    (p,) = read_prompts(good)
    assert p.messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    cases = [({"conversations": [{"from": "human", "value": "a"}, {"from": "alien", "value": "b"}]}, "conversations[1].from"),
             ({"conversations": [{"from": "human", "value": 3}]}, "conversations[0].value"),
             ({"conversations": [{"value": "x"}]}, "conversations[0].from"),
             ({"conversations": []}, ":conversations:"),
             ({"conversations": [{"from": "human", "value": "a"}], "messages": []}, ":conversations:")]
    for obj, field in cases:
        path = tmp_path / "bad.jsonl"
        path.write_text('{"conversations": [{"from": "human", "value": "fine"}]}\n' + json.dumps(obj) + "\n")
        with pytest.raises(PromptFileError) as exc:
            read_prompts(path)
        assert str(exc.value).startswith(f"{path}:2:") and field in str(exc.value), str(exc.value)


def test_turns_that_conversations_share_are_paid_and_output_once(k25, tmp_path):
    """Conversations that open alike (or differ only in original replies, which are never sent) send
    one request for their shared turn: it is paid once and output once, not one training row per
    conversation; with dedup off every conversation keeps its own row."""
    def opening(cid, second, original="original"):
        return {"id": cid, "messages": [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": original},
                                        {"role": "user", "content": second}]}

    prompts = write(tmp_path / "p.jsonl", [opening("h0", "one?"), opening("h1", "two?"), opening("h2", "one?", "other")])
    cfg = multiturn_config(tmp_path, prompts, k25[0].source)
    summary = generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    ids = [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")]
    assert ids == ["h0#t0", "h0#t1", "h1#t1"], ids  # h2 sends h0's requests: both of its turns are h0's
    assert summary["dedup"]["shared_turns"] == ["h1#t0", "h2#t0", "h2#t1"] and summary["requested"] == 3
    cfg["datasets"]["d"]["dedup"] = False
    again = generate_dataset(cfg, "d", tmp_path / "all.jsonl", log=quiet)
    assert again["requested"] == 0 and len(read_jsonl(tmp_path / "all.jsonl")) == 6


def test_dedup_within_and_across_datasets_first_listed_keeps_it(k25, tmp_path):
    same = [{"role": "user", "content": "the same question"}]
    a = write(tmp_path / "a.jsonl", [{"id": "x1", "messages": same}, {"id": "x2", "messages": same},
                                     {"id": "x3", "messages": [{"role": "user", "content": "other"}]}])
    b = write(tmp_path / "b.jsonl", [{"id": "y1", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "the same question"}]}]}, {"id": "y2", "messages": [{"role": "user", "content": "new"}]}])
    cfg = make_config(tmp_path, a, k25[0].source, backend="simulator")
    cfg["datasets"] = {"a": {"prompts": str(a), "model": "m", "backend": "simulator"},
                       "b": {"prompts": str(b), "model": "m", "backend": "simulator"}}
    wa, wb = dataset_work(cfg, "a"), dataset_work(cfg, "b")
    assert [p.id for p in wa.prompts] == ["x1", "x3"] and [d.to_dict() for d in wa.duplicates] == [
        {"id": "x2", "line": 2, "duplicate_of": "a:x1"}]
    assert [p.id for p in wb.prompts] == ["y2"] and wb.duplicates[0].duplicate_of == "a:x1"
    logs: list[str] = []
    summary = generate_dataset(cfg, "b", tmp_path / "b-out.jsonl", log=logs.append)
    assert summary["samples"] == 1 and summary["dedup"] == {"enabled": True, "dropped": [
        {"id": "y1", "line": 1, "duplicate_of": "a:x1"}]}
    assert any("'y1' left out, a duplicate of a:x1" in m for m in logs)
    cfg["datasets"]["b"]["dedup"] = False
    assert [p.id for p in dataset_work(cfg, "b").prompts] == ["y1", "y2"]
    cfg["datasets"]["b"]["dedup"] = True
    cfg["datasets"]["b"]["turns"] = "all"  # other work than a's single requests: not deduplicated against a
    assert [p.id for p in dataset_work(cfg, "b").prompts] == ["y1", "y2"]
    cfg["datasets"]["b"]["turns"] = "last"
    # a rehearsal on the stand-in listed first never empties a paid dataset: other requests, other answers
    cfg["datasets"]["b"] = {**cfg["datasets"]["b"], "backend": "openrouter"}
    assert [p.id for p in dataset_work(cfg, "b").prompts] == ["y1", "y2"]
    cfg["datasets"]["b"] = {**cfg["datasets"]["b"], "backend": "simulator", "generation": {"max_tokens": 99}}
    assert [p.id for p in dataset_work(cfg, "b").prompts] == ["y1", "y2"]  # other output settings: other work


def test_plan_counts_turns_and_bounds_the_growing_history(k25, tmp_path):
    prompts = write(tmp_path / "p.jsonl", [conversation("a", 3), conversation("b", 2)])
    last = make_config(tmp_path, prompts, k25[0].source, backend="simulator", max_tokens=2000)
    cfg = multiturn_config(tmp_path, prompts, k25[0].source, max_tokens=2000)
    row = plan_dataset(cfg, "d")
    assert (row["samples"], row["cached"], row["to_request"]) == (5, 0, 5)
    assert row["turns"]["conversations"] == 2
    single = plan_dataset(last, "d")
    assert single["samples"] == 2 and row["cost_worst"] > single["cost_worst"] * 2
    # each later turn's worst case carries max_tokens (+ markup) per earlier reply
    assert row["cost_worst"] - single["cost_worst"] * 2.5 > 0
    generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    after = plan_dataset(cfg, "d")
    assert (after["samples"], after["cached"], after["to_request"], after["cost_worst"]) == (5, 5, 0, 0)


def test_each_sample_of_a_conversation_reserves_for_its_own_history(k25, tmp_path):
    """With samples_per_prompt > 1 every sample's later turns hold its own earlier replies (the
    stand-in answers each differently): each turn's reservation must bound its own prompt, or the
    budget cap can be passed."""
    import sqlite3

    prompts = write(tmp_path / "p.jsonl", [conversation(f"c{i}", 3) for i in range(4)])
    # a sampling seed in the body: the stand-in answers each sample of a prompt differently
    cfg = multiturn_config(tmp_path, prompts, k25[0].source, max_tokens=300, samples_per_prompt=3, concurrency=1, seed=1)
    cfg["models"]["m"]["price_per_mtok"] = {"prompt": 10.0, "completion": 0.0}  # any prompt overrun shows
    generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    db = sqlite3.connect(str(tmp_path / "cache" / "budget.sqlite"))
    rows = db.execute("SELECT item, reserved, cost FROM reservations WHERE state='settled'").fetchall()
    db.close()
    assert len(rows) == 4 * 3 * 3
    assert len({round(r[2], 9) for r in rows if r[0].startswith("c0#") and r[0].endswith("#t2")}) > 1  # own histories
    assert [r for r in rows if r[2] > r[1] + 1e-12] == []

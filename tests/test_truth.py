"""The product's promise, checked against ground truth: for every provider behaviour the stand-in
reproduces, no sample is called exact or repaired unless its ids equal the ids the model produced."""
from __future__ import annotations

import json

import pytest
from conftest import ask_stand_in, demo_prompts

from eagledata.standin.profiles import PROFILES
from eagledata.standin.server import SimulatorServer
from eagledata.tokens.shards import build_token_shards, read_shards

SEED = 11

#: What each stand-in provider profile must end as (beyond "never wrongly exact").
EXPECTED = {
    "exact": {"exact"},
    "no-eot": {"exact"},
    "call-ids": {"exact", "repaired"},
    "markup-in-content": {"exact", "repaired"},
    "strip-whitespace": {"exact", "repaired", "mismatch"},
    "drop-reasoning": {"mismatch"},
    "noncanonical": {"exact", "mismatch"},
    "truncating": {"exact", "mismatch"},
}


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_verdicts_never_bless_wrong_ids(profile, demo_tok, tmp_path):
    tok, fam = demo_tok
    records, truths = ask_stand_in(tok, fam, profile, SEED)
    path = tmp_path / "responses.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    build_token_shards(path, tmp_path / "tokens", tok, fam, profile, shard_size=16)
    rows = {r["id"]: r for r in read_shards(tmp_path / "tokens").iter_rows(named=True)}
    verdicts = set()
    for rec in records:
        row = rows[rec["id"]]
        truth = truths[rec["id"]]
        verdicts.add(row["verdict"])
        if row["verdict"] in ("exact", "repaired"):
            assert row["input_ids"] == truth.prompt_ids + truth.ids, (profile, rec["id"], row["reasons"])
        # each side on its own: proven only when that side's ids are the truth
        if row["completion_verdict"] in ("exact", "repaired"):
            assert row["input_ids"][row["prompt_len"]:] == truth.ids, (profile, rec["id"], row["reasons"])
        if row["prompt_verdict"] == "exact":
            assert row["input_ids"][: row["prompt_len"]] == truth.prompt_ids, (profile, rec["id"])
    assert verdicts <= EXPECTED.get(profile, {"exact", "repaired", "mismatch"}), (profile, verdicts)
    if profile in ("exact", "no-eot"):
        assert verdicts == {"exact"}


def test_engine_token_ids_are_the_tokens_and_the_text_path_is_measured(demo_tok, tmp_path, monkeypatch):
    """Backend sglang: the ids the engine returned are used as they are (no reconstruction); the text
    path is still reconstructed and compared, as a measurement."""
    from eagledata.generate.job import generate_dataset

    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    tok, fam = demo_tok
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in demo_prompts()[:12]))
    with SimulatorServer(tok, fam, seed=SEED, api="sglang") as sim:
        for endpoint in ("chat", "generate"):
            cfg = {"cache_dir": str(tmp_path / f"cache-{endpoint}"), "results_dir": str(tmp_path / "results"),
                   "models": {"m": {"family": "kimi-k2.5", "tokenizer": tok.source}},
                   "generation": {"api_base": sim.root_url + "/v1", "max_tokens": 4096, "sglang_endpoint": endpoint},
                   "datasets": {"d": {"prompts": str(prompts), "model": "m", "backend": "sglang"}}}
            out = tmp_path / f"{endpoint}.jsonl"
            generate_dataset(cfg, "d", out, log=lambda _m: None)
            records = [json.loads(x) for x in out.read_text().splitlines()]
            build_token_shards(out, tmp_path / f"tokens-{endpoint}", tok, fam, "d")
            rows = {r["id"]: r for r in read_shards(tmp_path / f"tokens-{endpoint}").iter_rows(named=True)}
            for rec in records:
                row = rows[rec["id"]]
                truth = sim.truth(rec["generation_id"]) or sim.truth("gen-" + rec["generation_id"])
                assert row["input_ids"][row["prompt_len"]:] == truth["ids"] == rec["token_ids"]
                assert row["input_ids"][: row["prompt_len"]] == truth["prompt_ids"]
                assert "ground_truth_ids" in row["reasons"], row["reasons"]
                assert row["verdict"] == "exact", (endpoint, row["reasons"])
                kinds = [s["kind"] for s in json.loads(row["segments"])]
                assert kinds[-1] == "end_of_turn" and "think_close" in kinds
                if endpoint == "chat":  # the stand-in's text decodes the ids faithfully
                    assert "text_path_differs" not in row["reasons"]


@pytest.mark.parametrize("reasoning", [None, {"enabled": False}])
def test_native_generate_records_are_read_through_their_chat_request(reasoning, demo_tok, tmp_path, monkeypatch):
    """A record of SGLang's native /generate holds the native body as its request (input_ids,
    sampling_params: no messages); the tokens stage reads the messages, tools and thinking setting
    from its chat_request. Read from the native body, a request with thinking off was taken as
    thinking (K2.5's default): all 12 samples a mismatch (think_close_count); and every prompt was
    flagged prompt_path_differs (our rendering of no messages against the input_ids sent)."""
    from eagledata.generate.job import generate_dataset

    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    tok, fam = demo_tok
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in demo_prompts()[:12]))
    with SimulatorServer(tok, fam, seed=SEED, api="sglang") as sim:
        gen = {"api_base": sim.root_url, "max_tokens": 4096, "sglang_endpoint": "generate", "reasoning": reasoning}
        cfg = {"cache_dir": str(tmp_path / "cache"), "results_dir": str(tmp_path / "results"),
               "models": {"m": {"family": "kimi-k2.5", "tokenizer": tok.source}}, "generation": gen,
               "datasets": {"d": {"prompts": str(prompts), "model": "m", "backend": "sglang"}}}
        out = tmp_path / "out.jsonl"
        generate_dataset(cfg, "d", out, log=lambda _m: None)
        records = [json.loads(x) for x in out.read_text().splitlines()]
        build_token_shards(out, tmp_path / "tokens", tok, fam, "d")
        rows = {r["id"]: r for r in read_shards(tmp_path / "tokens").iter_rows(named=True)}
        for rec in records:
            row, truth = rows[rec["id"]], sim.truth("gen-" + rec["generation_id"])
            assert "messages" not in rec["request"] and rec["chat_request"]["messages"]
            assert row["input_ids"] == truth["prompt_ids"] + truth["ids"]
            assert row["verdict"] == "exact", row["reasons"]
            assert "prompt_path_differs" not in row["reasons"]
            kinds = [s["kind"] for s in json.loads(row["segments"])]
            assert ("think_close" in kinds) is (reasoning is None)


@pytest.mark.parametrize("endpoint", ["chat", "generate"])
def test_ids_stored_with_the_engines_prompt_echo_are_cut_in_the_tokens_stage(endpoint, demo_tok, tmp_path, monkeypatch):
    """Records generated before eagledata cut it hold SGLang's echo of the prompt's last 5 ids before
    the completion (releases whose detokenizer returned its decode window: sglang issues #10896,
    #17240): all 12 a mismatch, the GPU time spent on them lost. The tokens stage cuts the ids too
    many by the engine's own completion count when they are exactly the prompt's end (repaired,
    ``engine_prompt_echo``), and never ids that are not."""
    from eagledata.generate.job import generate_dataset

    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    tok, fam = demo_tok
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in demo_prompts()[:12]))
    with SimulatorServer(tok, fam, seed=SEED, api="sglang") as sim:
        cfg = {"cache_dir": str(tmp_path / "cache"), "results_dir": str(tmp_path / "results"),
               "models": {"m": {"family": "kimi-k2.5", "tokenizer": tok.source}},
               "generation": {"api_base": sim.root_url, "max_tokens": 4096, "sglang_endpoint": endpoint},
               "datasets": {"d": {"prompts": str(prompts), "model": "m", "backend": "sglang"}}}
        out = tmp_path / "out.jsonl"
        generate_dataset(cfg, "d", out, log=lambda _m: None)
        truths = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    old = tmp_path / "old.jsonl"  # as stored before: the echo kept; one record's extra ids are not the prompt's
    with old.open("w") as fh:
        for i, rec in enumerate(truths.values()):
            prompt = rec.get("prompt_token_ids") or rec["request"]["input_ids"]
            fh.write(json.dumps({**rec, "token_ids": (prompt[-5:] if i else [7] * 5) + rec["token_ids"]}) + "\n")
    build_token_shards(old, tmp_path / "tokens", tok, fam, "d")
    rows = {r["id"]: r for r in read_shards(tmp_path / "tokens").iter_rows(named=True)}
    for i, (rid, rec) in enumerate(truths.items()):
        row = rows[rid]
        if i == 0:
            assert row["verdict"] == "mismatch" and "engine_prompt_echo" not in row["reasons"]
            continue
        assert row["verdict"] == "repaired" and "engine_prompt_echo" in row["reasons"], row["reasons"]
        assert row["input_ids"][row["prompt_len"]:] == rec["token_ids"]


@pytest.mark.parametrize("model", ["k2", "k25"])
def test_a_compacting_provider_teaches_no_wrong_count_convention(model, request, tmp_path):
    """Stand-in provider ``no-eot-compact-args`` re-serializes tool arguments as compact JSON and bills
    the model's spaced text without <|im_end|>. A call whose compaction saved exactly one token agrees
    under counts_eot with the compact ids; those answers once outvoted the rest of the tool_calls group,
    which then admitted them as exact with ids the model never produced (7 of 96 on K2, 22 on K2.5)
    and never tried the respacing repair. Over the real tokenizers, no answer is admitted with other
    ids than the model's, and the respacing repair (proven on the provider's samples) restores most."""
    tok, fam = request.getfixturevalue(model)
    records, truths = [], {}
    for seed in range(6):
        prompts = [dict(p, id=f"{p['id']}-s{seed}") for p in demo_prompts(("tools",))]
        r, t = ask_stand_in(tok, fam, "no-eot-compact-args", seed, prompts)
        records += r
        truths.update(t)
    path = tmp_path / "responses.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    manifest = build_token_shards(path, tmp_path / "tokens", tok, fam, "compact", shard_size=32).manifest
    rows = read_shards(tmp_path / "tokens").to_dicts()
    wrong = [r["id"] for r in rows if r["completion_verdict"] in ("exact", "repaired")
             and r["input_ids"][r["prompt_len"]:] != truths[r["id"]].ids]
    assert wrong == []
    learned = manifest["conventions"]["Simulator"]
    assert learned["convention"] == "excludes_eot"
    assert learned["by_finish"].get("tool_calls", {"convention": "excludes_eot"})["convention"] == "excludes_eot"
    calls = [r for r in rows if r["finish_reason"] == "tool_calls"]
    respaced = [r for r in calls if "tool_arguments_respaced" in r["reasons"]]
    assert len(respaced) > len(calls) * 3 // 4 and all(r["completion_verdict"] == "repaired" for r in respaced)


#: A tool whose required arguments the stand-in's model writes in schema order, not sorted.
FLIGHTS = {"type": "function", "function": {"name": "search_flights", "description": "Search flights.",
           "parameters": {"type": "object", "properties": {
               "origin": {"type": "string"}, "destination": {"type": "string"}, "date": {"type": "string"},
               "passengers": {"type": "integer"}, "cabin": {"type": "string", "enum": ["economy", "business"]}},
               "required": ["origin", "destination", "date", "passengers", "cabin"]}}}


@pytest.mark.parametrize("profile", ["compact-args", "sorted-compact-args"])
def test_re_serialized_arguments_never_admit_a_reordering(profile, k25, tmp_path):
    """Providers re-serializing tool-call arguments, with the real K2.5 tokenizer (whose counts do not
    see key order): no completion is admitted whose ids differ from the model's; a provider that keeps
    key order (its arguments show unsorted keys) is still repaired."""
    tok, fam = k25
    prompts = [{"id": f"fl-{i:03d}", "messages": [{"role": "user", "content": f"Find me flight number {i} please."}],
                "tools": [FLIGHTS]} for i in range(24)]
    records, truths = ask_stand_in(tok, fam, profile, SEED, prompts)
    path = tmp_path / "responses.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    build_token_shards(path, tmp_path / "tokens", tok, fam, profile, shard_size=8)
    rows = {r["id"]: r for r in read_shards(tmp_path / "tokens").iter_rows(named=True)}
    admitted, calls = [], 0
    for rec in records:
        row, truth = rows[rec["id"]], truths[rec["id"]]
        calls += any(s.kind == "tool_arguments" for s in truth.segments)
        if row["completion_verdict"] in ("exact", "repaired"):
            admitted.append(row)
            assert row["input_ids"][row["prompt_len"]:] == truth.ids, (profile, rec["id"], row["reasons"])
    assert calls >= 10
    with_calls = [r for r in rows.values() if '"tool_arguments"' in r["segments"]]
    if profile == "compact-args":
        assert all(r["completion_verdict"] == "repaired" and "tool_arguments_respaced" in r["reasons"] for r in with_calls)
    else:
        assert all(r["completion_verdict"] == "mismatch" and "tool_arguments_order_unproven" in r["reasons"]
                   for r in with_calls)


def test_a_loss_shared_by_one_finish_reason_never_teaches_it_to_count_end_of_turn(k25, tmp_path):
    """A provider that strips leading whitespace and bills without <|im_end|>: tool-call answers whose
    stripped ``\\n\\n`` after </think> was one token agree under counts_eot, and in this dataset they
    outvote their tool_calls group (7 to 2). The group may not count <|im_end|> where its provider does
    not (group_convention), so none of them is admitted with the token missing (7 were)."""
    from eagledata.generate.conversation import sharegpt_messages

    tok, fam = k25
    prompts = demo_prompts(("chat", "tools", "multiturn"))
    for p in prompts:
        if "conversations" in p:
            p["messages"] = sharegpt_messages(p.pop("conversations"), "x")
    records, truths = ask_stand_in(tok, fam, "no-eot-strip-whitespace", 2, prompts)
    path = tmp_path / "responses.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    manifest = build_token_shards(path, tmp_path / "tokens", tok, fam, "strip").manifest
    support = manifest["conventions"]["Simulator"]["by_finish"]["tool_calls"]["support"]
    assert support["counts_eot"] > support.get("excludes_eot", 0)  # the shared loss outvotes the group
    rows = read_shards(tmp_path / "tokens").to_dicts()
    wrong = [r["id"] for r in rows if r["completion_verdict"] in ("exact", "repaired")
             and r["input_ids"][r["prompt_len"]:] != truths[r["id"]].ids]
    assert wrong == []
    assert sum(r["completion_verdict"] in ("exact", "repaired") for r in rows) >= len(rows) // 2

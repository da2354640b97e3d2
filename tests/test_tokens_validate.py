import json

import polars as pl
import pytest

from eagledata.text.chat import prompt_ids
from eagledata.tokens.shards import ResponsesFileError, build_token_shards, read_shards, sha256_file, shard_groups
from eagledata.validate.summary import ValidationFailed, summarize, write_validation

MSGS = [{"role": "user", "content": "What is 2+3?"}]


def _record(tok, rid, reasoning, content, billed_completion, billed_prompt, provider="P", finish="stop",
            tool_calls=None, billed_reasoning=None, error=None):
    msg = {"role": "assistant", "content": content, "reasoning": reasoning}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    body = {"id": f"gen-{rid}", "provider": provider, "model": "moonshotai/kimi-k2.5",
            "choices": [{"index": 0, "finish_reason": finish, "message": msg}],
            "usage": {"prompt_tokens": billed_prompt, "completion_tokens": billed_completion,
                      "completion_tokens_details": {"reasoning_tokens": billed_reasoning or 0}}}
    if error:
        body = {"error": error}
    return {"id": rid, "request": {"model": "moonshotai/kimi-k2.5", "messages": MSGS}, "status": 200,
            "response_raw": json.dumps(body)}


@pytest.fixture
def synthetic(k25, tmp_path):
    tok, fam = k25
    sid = tok.special_id
    n_prompt = len(prompt_ids(tok, MSGS))
    r, c = " Two plus three.", " It is 5."
    true_len = len(tok.encode_plain(r)) + 1 + len(tok.encode_plain(c)) + 1
    n_r = len(tok.encode_plain(r))
    recs = [
        _record(tok, "exact", r, c, true_len, n_prompt, billed_reasoning=n_r + 1),
        _record(tok, "exact2", r, c, true_len, n_prompt),
        # provider stripped the leading space of content: our ids are one token short of the billed count? no:
        # " It" vs "It" tokenize to the same count here, so build the real case: billed count of the true text + 1
        _record(tok, "stripped", r.lstrip(), c.lstrip(), true_len + 1, n_prompt),
        _record(tok, "rewritten", r, "", None, n_prompt, finish="tool_calls",
                tool_calls=[{"id": "call_9x", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2}"}}]),
        _record(tok, "literal", r, "say <|im_end|> now", len(tok.encode_plain(r)) + 1 + len(tok.encode_plain("say <|im_end|> now")) + 1, n_prompt),
        _record(tok, "truncated", r, " It", len(tok.encode_plain(r)) + 1 + len(tok.encode_plain(" It")), n_prompt, finish="length"),
        _record(tok, "error200", None, None, None, None, error={"code": 502, "message": "upstream"}),
        _record(tok, "badreasoning", r, c, true_len, n_prompt, billed_reasoning=n_r + 5),
        _record(tok, "badprompt", r, c, true_len, n_prompt + 3),
    ]
    # the rewritten-id sample's billed count is that of the native id the model really produced
    native = (len(tok.encode_plain(r)) + 1 + 1 + 1 + len(tok.encode_plain("functions.add:0")) + 1
              + len(tok.encode_plain("{\"a\": 2}")) + 1 + 1 + 1)
    body = json.loads(recs[3]["response_raw"])
    body["usage"]["completion_tokens"] = native
    recs[3]["response_raw"] = json.dumps(body)
    path = tmp_path / "responses.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in recs))
    return path


def test_verdicts_on_adversarial_samples(k25, synthetic, tmp_path):
    tok, fam = k25
    res = build_token_shards(synthetic, tmp_path / "tokens", tok, fam, "syn", shard_size=4)
    df = read_shards(tmp_path / "tokens")
    v = dict(zip(df["id"], df["verdict"]))
    reasons = dict(zip(df["id"], df["reasons"].to_list()))
    assert v["exact"] == v["exact2"] == "exact"
    assert v["literal"] == "exact"
    assert v["rewritten"] == "repaired" and "tool_id_rebuilt" in reasons["rewritten"]
    assert v["stripped"] == "mismatch" and "completion_count_mismatch" in reasons["stripped"]
    assert v["truncated"] == "mismatch" and "truncated" in reasons["truncated"]
    assert v["error200"] == "error" and "error_in_body" in reasons["error200"]
    assert "reasoning_count_mismatch" in reasons["badreasoning"]
    assert "prompt_count_mismatch" in reasons["badprompt"]
    # both verdicts: the differing prompt is reported, its proven completion kept (default policy)
    cv, pv = dict(zip(df["id"], df["completion_verdict"])), dict(zip(df["id"], df["prompt_verdict"]))
    assert v["badprompt"] == "mismatch" and cv["badprompt"] == "exact" and pv["badprompt"] == "differs"
    assert {k for k, p in pv.items() if p == "differs"} == {"badprompt"}
    assert cv["rewritten"] == "repaired" and cv["error200"] == "error" and cv["stripped"] == "mismatch"
    admitted = ("exact", "exact2", "literal", "rewritten", "badprompt")
    assert dict(zip(df["id"], df["train"])) == {k: k in admitted for k in v}
    assert res.manifest["policy"] == "default"
    strict = build_token_shards(synthetic, tmp_path / "strict", tok, fam, "syn", policy="strict")
    kept = set(read_shards(tmp_path / "strict").filter(pl.col("train"))["id"])
    assert strict.manifest["policy"] == "strict" and kept == {"exact", "exact2", "literal"}
    # shards by id (eagledata.tokens.shards: content-defined), not by line: [2, 4, 3] for these ids
    groups = shard_groups(list(v), 4)
    assert [s["rows"] for s in res.manifest["shards"]] == [len(g) for g in groups] == [2, 4, 3]
    assert [s["first_id"] for s in res.manifest["shards"]] == [g[0] for g in groups]
    assert list(df["id"]) == sorted(v)
    for s in res.manifest["shards"]:
        assert sha256_file(tmp_path / "tokens" / s["file"]) == s["sha256"]
    assert res.manifest["tokenizer_fingerprint"] == tok.fingerprint
    row = df.filter(pl.col("id") == "exact").row(0, named=True)
    assert row["input_ids"][: row["prompt_len"]] == prompt_ids(tok, MSGS)
    assert row["input_ids"][-1] == tok.special_id("<|im_end|>")


def test_validation_report_and_threshold(k25, synthetic, tmp_path):
    tok, fam = k25
    build_token_shards(synthetic, tmp_path / "tokens", tok, fam, "syn")
    rep = summarize(tmp_path / "tokens", 1.0)
    assert rep["counts"] == {"total": 9, "exact": 3, "repaired": 1, "mismatch": 4, "error": 1, "excluded": 4, "included": 5,
                             "completion": {"exact": 4, "repaired": 1, "mismatch": 3, "error": 1},
                             "prompt": {"exact": 7, "unproven": 0, "differs": 1, "unbilled": 1, "error": 0},
                             "admitted_with_prompt_differs": 1, "admitted_with_prompt_unproven": 0}
    assert rep["reasons"]["truncated"]["ids"] == ["truncated"]
    # the gate counts bad completions (4 of 9) by default, the joint verdicts (5 of 9) with bad_counts: both
    assert rep["bad_fraction"] == round(4 / 9, 6)
    with pytest.raises(ValidationFailed, match="55.56%"):
        write_validation(tmp_path / "tokens", tmp_path / "v2.json", tmp_path / "v2.txt", 0.10, bad_counts="both")
    with pytest.raises(ValidationFailed, match="44.44%"):
        write_validation(tmp_path / "tokens", tmp_path / "v.json", tmp_path / "v.txt", 0.10)
    assert json.loads((tmp_path / "v.json").read_text())["passed"] is False
    assert "FAILED" in (tmp_path / "v.txt").read_text()


def test_one_sample_provider_shows_no_convention_and_the_failure_names_the_remedy(k25, tmp_path):
    """A provider seen once is judged under no convention (its own count cannot prove one): the summary
    shows it as unknown (not the convention its own vote picked), and the gate's failure names the
    reason and what fixes it; a second sample gives each a convention to be judged under."""
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    r, c = " Two plus three.", " It is 5."
    true_len = len(tok.encode_plain(r)) + 1 + len(tok.encode_plain(c)) + 1
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(_record(tok, "only", r, c, true_len, n_prompt)) + "\n")
    build_token_shards(one, tmp_path / "t1", tok, fam, "one")
    with pytest.raises(ValidationFailed, match=r"most often unknown_count_convention \(x1\).*at least two samples"):
        write_validation(tmp_path / "t1", tmp_path / "v.json", tmp_path / "v.txt", 0.05)
    assert json.loads((tmp_path / "v.json").read_text())["providers"]["P"]["convention"] == "unknown"
    assert " unknown " in (tmp_path / "v.txt").read_text().splitlines()[5]
    two = tmp_path / "two.jsonl"
    two.write_text("".join(json.dumps(_record(tok, rid, r, c, true_len, n_prompt)) + "\n" for rid in ("a", "b")))
    build_token_shards(two, tmp_path / "t2", tok, fam, "two")
    rep = write_validation(tmp_path / "t2", tmp_path / "v2.json", tmp_path / "v2.txt", 0.05)
    assert rep["providers"]["P"]["convention"] == "counts_eot" and rep["counts"]["completion"]["exact"] == 2


def test_conventions_learned_on_recorded(k2, recorded, tmp_path):
    tok, fam = k2
    path = tmp_path / "rec.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recorded))
    res = build_token_shards(path, tmp_path / "tokens", tok, fam, "recorded", shard_size=100)
    conv = {p: c["convention"] for p, c in res.manifest["conventions"].items()}
    assert conv["DeepInfra"] == conv["SiliconFlow"] == "excludes_eot"
    assert conv["Fireworks"] == conv["BaseTen"] == conv["Moonshot AI"] == "counts_eot"
    rep = summarize(tmp_path / "tokens", 1.0)
    assert rep["counts"]["total"] == len(recorded)
    assert sum(rep["counts"][k] for k in ("exact", "repaired", "mismatch", "error")) == len(recorded)
    print("\n" + json.dumps({p: {k: d[k] for k in ("total", "exact", "repaired", "convention", "completion_diff")}
                              for p, d in rep["providers"].items()}, indent=1))


def test_bad_responses_file_names_file_line_field(k25, tmp_path):
    tok, fam = k25
    path = tmp_path / "r.jsonl"
    path.write_text('{"request": {}, "response_raw": "{}"}\n{"request": {}}\n')
    with pytest.raises(ResponsesFileError, match=r"r\.jsonl:2:response_raw: missing"):
        build_token_shards(path, tmp_path / "t", tok, fam, "x")
    path.write_text('{"request": {}, "response_raw": "{}"}\nnot json\n')
    with pytest.raises(ResponsesFileError, match=r"r\.jsonl:2:\(json\): invalid JSON"):
        build_token_shards(path, tmp_path / "t", tok, fam, "x")


def test_fidelity_profiles_accumulate_across_runs_without_double_counting(k25, synthetic, tmp_path):
    """A dataset validated again (the same responses under any tokenizer, or its file grown) replaces
    its entries; another dataset, or the same name over another file, adds its own."""
    from eagledata.validate.profiles import accumulated_profiles, record_validation

    tok, fam = k25
    res = build_token_shards(synthetic, tmp_path / "tokens", tok, fam, "syn")
    rep = summarize(tmp_path / "tokens", 1.0)
    hist = tmp_path / "hist.jsonl"
    record_validation(hist, rep, res.manifest)
    record_validation(hist, rep, res.manifest)  # the same data validated again: replaced, not added
    assert accumulated_profiles(hist)["P"]["total"] == 8  # the error body names no provider
    other = dict(rep, dataset="syn2")
    record_validation(hist, other, res.manifest)  # a second dataset: added
    prof = accumulated_profiles(hist)["P"]
    assert prof["total"] == 16 and prof["exact"] == 6 and prof["datasets"] == ["syn", "syn2"]
    assert prof["convention"] == "counts_eot" and prof["transformations_seen"] == {"tool_id_rebuilt": 2}
    # the same responses under another tokenizer, then the same file grown (another sha256): replaced
    record_validation(hist, dict(rep, tokenizer_fingerprint="another"), res.manifest)
    assert accumulated_profiles(hist)["P"]["total"] == 16
    record_validation(hist, rep, dict(res.manifest, source_sha256="grown"))
    assert accumulated_profiles(hist)["P"]["total"] == 16
    # the same dataset name in another workflow (another file, other responses): added
    record_validation(hist, rep, dict(res.manifest, source_sha256="elsewhere", source=str(tmp_path / "other.jsonl")))
    assert accumulated_profiles(hist)["P"]["total"] == 24
    # the same file left with no sample (its providers gone): its entries go too
    record_validation(hist, dict(rep, providers={}), dict(res.manifest, source_sha256="emptied"))
    assert accumulated_profiles(hist)["P"]["total"] == 16


def _record_many(hist: str, dataset: str, n: int) -> None:
    from eagledata.validate.profiles import record_validation

    report = {"dataset": dataset, "tokenizer_fingerprint": "t", "providers": {"P": {"total": 1}}}
    for i in range(n):
        record_validation(hist, report, {"source_sha256": f"{dataset}-{i}", "source": f"/data/{dataset}-{i}.jsonl"})


def test_validate_jobs_recording_at_once_lose_no_entry(tmp_path):
    """Several datasets' validate jobs write the history at the same time (--cores N): each read,
    edit and write is under a lock, so no job's entries are lost to another's write."""
    import multiprocessing

    from eagledata.validate.profiles import accumulated_profiles

    hist = str(tmp_path / "hist.jsonl")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_record_many, args=(hist, f"d{k}", 25)) for k in range(6)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    assert all(proc.exitcode == 0 for proc in procs)
    assert accumulated_profiles(hist)["P"]["total"] == 6 * 25


def test_plain_openrouter_log_lines_import_like_recordings(k2, recorded, tmp_path):
    """A log of parsed responses (request beside response, or the response with its request inside)
    goes through the same stages; the records say their bodies were re-serialized."""
    from eagledata.generate.imports import read_response_records

    tok, fam = k2
    plain = [r for r in recorded if not r["request"].get("stream")][:6]
    lines = []
    for i, r in enumerate(plain):
        body = json.loads(r["response_raw"])
        lines.append({"request": r["request"], "response": body} if i % 2 else {**body, "request": r["request"]})
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    orig = tmp_path / "orig.jsonl"
    orig.write_text("".join(json.dumps(r) + "\n" for r in plain))
    imported = list(read_response_records(log, "log"))
    assert all(r["response_raw_reserialized"] and r["status"] == 200 for r in imported)
    build_token_shards(log, tmp_path / "t-log", tok, fam, "log")
    build_token_shards(orig, tmp_path / "t-orig", tok, fam, "orig")
    a, b = read_shards(tmp_path / "t-log"), read_shards(tmp_path / "t-orig")
    assert a["input_ids"].to_list() == b["input_ids"].to_list()
    assert a["verdict"].to_list() == b["verdict"].to_list()


def test_explain_prints_both_verdicts_and_admission_and_refuses_bad_input_without_a_traceback(tmp_path, recorded, k2,
                                                                                               capsys):
    """`eagledata explain` on recorded samples: the combined verdict with the completion's and the
    prompt's and whether the sample is in training; an unknown dataset and a config that is missing
    or invalid are one-line errors (exit 2), not tracebacks."""
    import yaml

    from eagledata.cli import main as cli_main
    from eagledata.tokens.shards import build_token_shards, read_shards

    src = tmp_path / "rec.jsonl"
    src.write_text("".join(json.dumps({**r, "id": f"r{i:03d}"}) + "\n" for i, r in enumerate(recorded[:30])))
    build_token_shards(src, tmp_path / "results" / "rec" / "tokens", k2[0], k2[1], "rec")
    row = next(read_shards(tmp_path / "results" / "rec" / "tokens").iter_rows(named=True))
    cfg = {"results_dir": str(tmp_path / "results"), "cache_dir": str(tmp_path / "cache"),
           "models": {"k2": {"family": "kimi-k2", "tokenizer": str(k2[0].source)}},
           "datasets": {"rec": {"responses": str(src), "model": "k2"}}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli_main(["explain", row["id"], "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert (f"verdict: {row['verdict']} (completion {row['completion_verdict']}, prompt {row['prompt_verdict']}); "
            f"{'in training' if row['train'] else 'not in training'}") in out, out
    assert cli_main(["explain", row["id"], "--dataset", "nosuch", "--config", str(path)]) == 2
    assert "unknown dataset 'nosuch'" in capsys.readouterr().err
    for command in (["explain", row["id"]], ["profiles"], ["budget"]):
        assert cli_main([*command, "--config", str(tmp_path / "missing.yaml")]) == 2
        assert "No such file or directory" in capsys.readouterr().err
        path.write_text(yaml.safe_dump({**cfg, "budgett_usd": 1}))
        assert cli_main([*command, "--config", str(path)]) == 2
        assert "budgett_usd: unknown key" in capsys.readouterr().err
        path.write_text(yaml.safe_dump(cfg))


def test_history_entries_of_per_shard_manifests_match_by_records_not_by_a_missing_file_digest(tmp_path):
    """The per-shard manifest names its source by the records' digest (no file sha256): two files of
    one dataset name in two workflows are two entries, the same records (lines moved, another path)
    replace theirs."""
    from eagledata.validate.profiles import accumulated_profiles, record_validation

    hist = tmp_path / "hist.jsonl"
    report = {"dataset": "d", "tokenizer_fingerprint": "t", "providers": {"P": {"total": 1}}}
    record_validation(hist, report, {"source_records_sha256": "r1", "source": "/a/responses.jsonl"})
    record_validation(hist, report, {"source_records_sha256": "r2", "source": "/b/responses.jsonl"})
    assert accumulated_profiles(hist)["P"]["total"] == 2
    record_validation(hist, report, {"source_records_sha256": "r1", "source": "/moved/responses.jsonl"})
    assert accumulated_profiles(hist)["P"]["total"] == 2


def test_every_billed_prompt_differing_with_no_variant_is_warned_of(k25, tmp_path):
    """A wrong chat template (models.k25.tokenizer pointing at Kimi K2 Thinking's directory for K2.5:
    user audit r3) made every prompt differ (+17 / -1), yet validation said PASSED with no word of it
    and admitted all 28 samples with prompt ids the model never saw. The summary now warns, naming
    what to check; one exact prompt, or a learned variant, is no such sign."""
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    r, c = " Two plus three.", " It is 5."
    true_len = len(tok.encode_plain(r)) + 1 + len(tok.encode_plain(c)) + 1
    off = tmp_path / "off.jsonl"
    off.write_text("".join(json.dumps(_record(tok, f"s{i}", r, c, true_len, n_prompt + (17 if i % 3 else -1))) + "\n"
                           for i in range(6)))
    build_token_shards(off, tmp_path / "t1", tok, fam, "off")
    rep = write_validation(tmp_path / "t1", tmp_path / "v.json", tmp_path / "v.txt", 0.05)
    assert rep["passed"] and rep["counts"]["prompt"]["differs"] == 6
    text = (tmp_path / "v.txt").read_text()
    assert "warning: none of the 6 billed prompts has our rendering's token count" in text
    assert "check the model's tokenizer, chat_template and family" in text and "6 sample(s) are admitted" in text
    good = tmp_path / "good.jsonl"  # one exact prompt among them: a provider's own rendering, reported per provider
    good.write_text(off.read_text() + json.dumps(_record(tok, "s9", r, c, true_len, n_prompt)) + "\n")
    build_token_shards(good, tmp_path / "t2", tok, fam, "good")
    write_validation(tmp_path / "t2", tmp_path / "v2.json", tmp_path / "v2.txt", 0.05)
    assert "warning:" not in (tmp_path / "v2.txt").read_text()

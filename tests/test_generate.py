"""Prompt files, request bodies, and the generation client against the simulator on loopback:
retries, final errors, resumability (rerun, killed run, torn cache line), imports, secrets."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from eagledata.config import dataset_settings, validate_config
from eagledata.generate.errors import GenerationError, JobStopped
from eagledata.generate.imports import import_responses
from eagledata.generate.job import generate_dataset, generate_dataset_async
from eagledata.generate.requests import build_request, cache_key, request_params, work_items
from eagledata.io import ResponsesFileError
from eagledata.generate.prompts import PromptFileError, read_prompts
from eagledata.tokens.responses import parse_response
from eagledata.standin.server import SimulatorServer, prompt_hash

from gen_helpers import API_KEY, TOOLS, make_config, write_prompts  # noqa: E402


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv("OPENROUTER_API_KEY", API_KEY)
    return API_KEY


@pytest.fixture
def setup(tmp_path, k25, key):
    """A simulator on loopback, a prompts file and a config whose openrouter api_base is the simulator."""
    tok, fam = k25
    prompts = write_prompts(tmp_path / "prompts.jsonl", 12)

    def make(faults=None, latency_ms=0, **generation):
        sim = SimulatorServer(tok, fam, seed=2, faults=faults, latency_ms=latency_ms).start()
        cfg = make_config(tmp_path, prompts, str(tok.source), api_base=sim.base_url, **generation)
        servers.append(sim)
        return sim, cfg

    servers: list[SimulatorServer] = []
    yield make
    for s in servers:
        s.stop()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def quiet(_msg: str) -> None:
    pass


# --------------------------------------------------------------------------------------------
# prompt files


def test_read_prompts_ids_and_blank_lines(tmp_path):
    p = tmp_path / "p.jsonl"
    msgs = [{"role": "user", "content": "hi"}]
    p.write_text(json.dumps({"messages": msgs}) + "\n\n" + json.dumps({"id": 7, "messages": msgs, "tools": TOOLS}) + "\n")
    a, b = read_prompts(p)
    assert a.id.startswith("p-") and len(a.id) == 18 and a.line == 1 and a.tools is None
    assert read_prompts(p)[0].id == a.id  # stable
    assert b.id == "7" and b.line == 3 and b.tools == TOOLS


@pytest.mark.parametrize("lines, where", [
    (['{"messages": [{"role": "user", "content": "a"}]}', "{not json"], ":2:(json)"),
    (['{"id": "x"}'], ":1:messages"),
    (['{"messages": []}'], ":1:messages"),
    (['{"messages": [{"content": "a"}]}'], ":1:messages[0].role"),
    (['{"messages": [{"role": "robot", "content": "a"}]}'], ":1:messages[0].role"),
    (['{"messages": [{"role": "user"}]}'], ":1:messages[0].content"),
    (['{"messages": [{"role": "tool", "content": "5"}]}'], ":1:messages[0].tool_call_id"),
    (['{"id": "a", "messages": [{"role": "user", "content": "x"}]}', "",
      '{"id": "a", "messages": [{"role": "user", "content": "y"}]}'], ":3:id"),
    (['{"messages": [{"role": "user", "content": "x"}]}', '{"messages": [{"role": "user", "content": "x"}]}'], ":2:id"),
    (['{"id": "a#1", "messages": [{"role": "user", "content": "x"}]}'], ":1:id"),
    (['{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {}}]}'],
     ":1:tools[0].function.name"),
    (['{"message": [{"role": "user", "content": "x"}]}'], ":1:message"),
    (['[1, 2]'], ":1"),
    (['{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", '
      '"parameters": ' + "[" * 990 + "]" * 990 + "}}]}"], ":1:(line): nested too deeply"),
    (['{"messages": [{"role": "user", "content": "x \\ud800 y"}]}'], ":1:messages[0].content: a string holds a lone surrogate"),
    (['{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", '
      '"parameters": {"type": "object", "properties": {"a": {"type": "number", "maximum": NaN}}}}}]}'],
     ":1:tools[0].function.parameters.properties.a.maximum: nan is no JSON number"),
])
def test_malformed_prompt_files_name_file_line_field(tmp_path, lines, where):
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(PromptFileError) as exc:
        read_prompts(p)
    assert str(exc.value).startswith(f"{p}{where}"), str(exc.value)


def test_empty_or_missing_prompt_file(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n  \n")
    with pytest.raises(PromptFileError, match="no prompts"):
        read_prompts(tmp_path / "e.jsonl")
    with pytest.raises(PromptFileError, match="cannot read"):
        read_prompts(tmp_path / "missing.jsonl")


# --------------------------------------------------------------------------------------------
# request bodies and cache keys


def test_build_request_and_cache_key(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 3)
    cfg = validate_config(make_config(tmp_path, prompts, "tok", temperature=0.6, seed=10, samples_per_prompt=2,
                                      reasoning={"effort": "high"}))
    s = dataset_settings(cfg, "d")
    p0 = read_prompts(prompts)[0]
    b0, b1 = build_request(p0, s, 0), build_request(p0, s, 1)
    assert b0 == {"model": "moonshotai/kimi-k2.5", "messages": p0.messages, "tools": TOOLS, "max_tokens": 300,
                  "temperature": 0.6, "seed": 10, "reasoning": {"effort": "high"}, "stream": False,
                  "usage": {"include": True}}
    assert b1["seed"] == 11 and cache_key(b0) != cache_key(b1, 1)
    items = work_items(read_prompts(prompts), s)
    assert [it.id for it in items[:2]] == ["q000#0", "q000#1"] and len(items) == 6
    # without a seed, samples still get distinct keys (same body, another draw)
    cfg2 = validate_config(make_config(tmp_path, prompts, "tok", samples_per_prompt=2))
    it2 = work_items(read_prompts(prompts), dataset_settings(cfg2, "d"))
    assert it2[0].request == it2[1].request and it2[0].cache_key != it2[1].cache_key
    assert "top_p" not in it2[0].request and "seed" not in it2[0].request
    # output-shaping settings change the key; client settings do not
    base = dataset_settings(validate_config(make_config(tmp_path, prompts, "tok")), "d")
    for change, same in [({"max_tokens": 301}, False), ({"stream": True}, False), ({"top_p": 0.9}, False),
                         ({"concurrency": 99, "timeout_s": 5, "max_attempts": 2}, True)]:
        other = dataset_settings(validate_config(make_config(tmp_path, prompts, "tok", **change)), "d")
        assert (cache_key(build_request(p0, other)) == cache_key(build_request(p0, base))) is same, change
        assert (request_params(other, {}) == request_params(base, {})) is same, change


# --------------------------------------------------------------------------------------------
# generation against the simulator


def test_generate_writes_exact_records_in_prompt_order(setup, tmp_path, key):
    sim, cfg = setup()
    out = tmp_path / "results" / "d" / "responses.jsonl"
    logs: list[str] = []
    summary = generate_dataset(cfg, "d", out, log=logs.append)
    recs = read_jsonl(out)
    assert [r["id"] for r in recs] == [f"q{i:03d}" for i in range(12)]
    assert summary["requested"] == 12 and summary["cached"] == 0 and summary["http_requests"] == 12
    assert sim.requests_total == 12 and sim.authorizations == {f"Bearer {key}": 12}
    for r in recs:
        assert set(r) == {"id", "prompt_id", "sample_index", "request", "status", "response_raw", "url", "cache_key",
                          "backend", "started_at", "elapsed_s", "attempts", "generation_id", "token_ids"}
        assert r["token_ids"] is None and r["generation_id"] == parse_response(r["response_raw"]).generation_id
        assert r["status"] == 200 and r["attempts"] == 1 and r["backend"] == "openrouter"
        assert r["url"] == sim.base_url + "/chat/completions"
        assert r["cache_key"] == cache_key(r["request"], 0, {"endpoint": sim.base_url})  # not OpenRouter's: salted
        assert r["response_raw"].startswith("\n")  # exact body, padding included
        assert parse_response(r["response_raw"]).ok
    assert recs[0]["request"]["tools"] == TOOLS and "tools" not in recs[1]["request"]
    assert not list(out.parent.glob(".*tmp*"))


@pytest.mark.parametrize("stream, faults", [
    (False, {1: "429", 2: "502", 3: "error-in-200", 5: "503", 6: "disconnect"}),
    (True, {1: "mid-stream", 2: "429:0.05", 4: "error-in-200", 7: "500"}),
])
def test_retries_end_in_success(setup, tmp_path, stream, faults):
    sim, cfg = setup(faults=faults, stream=stream)
    out = tmp_path / "out.jsonl"
    logs: list[str] = []
    t0 = time.monotonic()
    summary = generate_dataset(cfg, "d", out, log=logs.append)
    recs = read_jsonl(out)
    assert all(r["status"] == 200 and parse_response(r["response_raw"]).ok for r in recs)
    assert sum(r["attempts"] for r in recs) == 12 + len(faults) == summary["http_requests"] == sim.requests_total
    assert sum(r["attempts"] > 1 for r in recs) >= 1
    assert sum("retrying" in m for m in logs) == len(faults)
    if stream:
        assert all(parse_response(r["response_raw"]).streamed for r in recs)
        assert time.monotonic() - t0 >= 0.05  # Retry-After honoured


def test_final_4xx_is_recorded_not_retried_and_cached(setup, tmp_path):
    sim, cfg = setup(faults={1: "400", 2: "403"}, concurrency=1)
    out = tmp_path / "out.jsonl"
    logs: list[str] = []
    summary = generate_dataset(cfg, "d", out, log=logs.append)
    recs = read_jsonl(out)
    bad = [r for r in recs if r["status"] != 200]
    assert sorted(r["status"] for r in bad) == [400, 403] and all(r["attempts"] == 1 for r in bad)
    assert all(json.loads(r["response_raw"])["error"]["code"] == r["status"] for r in bad)
    assert sim.requests_total == 12 and summary["final_errors"] == 2
    assert any("final" in m for m in logs)
    generate_dataset(cfg, "d", out, log=quiet)
    assert sim.requests_total == 12  # final errors are cached too


def test_failing_prompt_exits_nonzero_after_caching_the_rest(setup, tmp_path):
    doomed = {"messages": [{"role": "user", "content": "Prompt q4: explain item 4."}], "tools": None}

    def faults(n, body):
        return "502" if prompt_hash(body) == prompt_hash(doomed) else None

    sim, cfg = setup(faults=faults)
    out = tmp_path / "out.jsonl"
    with pytest.raises(GenerationError, match="q004") as exc:
        generate_dataset(cfg, "d", out, log=quiet)
    assert "1 request(s) still failing after 4 attempts" in str(exc.value)
    assert not out.exists()
    assert len(read_jsonl(tmp_path / "cache" / "d" / "responses.jsonl")) == 11
    assert sim.request_counts[prompt_hash(doomed)] == 4
    sim.faults = None
    before = sim.requests_total
    generate_dataset(cfg, "d", out, log=quiet)
    assert sim.requests_total - before == 1 and len(read_jsonl(out)) == 12


def test_rerun_after_deleting_output_sends_nothing(setup, tmp_path):
    sim, cfg = setup()
    out = tmp_path / "out.jsonl"
    generate_dataset(cfg, "d", out, log=quiet)
    first = out.read_text()
    counts = dict(sim.request_counts)
    out.unlink()
    summary = generate_dataset(cfg, "d", out, log=quiet)
    assert summary["requested"] == 0 and summary["cached"] == 12
    assert dict(sim.request_counts) == counts and out.read_text() == first
    # client settings do not invalidate the cache; an output-shaping one does
    cfg["generation"]["concurrency"] = 1
    assert generate_dataset(cfg, "d", out, log=quiet)["requested"] == 0
    cfg["generation"]["max_tokens"] = 64
    assert generate_dataset(cfg, "d", out, log=quiet)["requested"] == 12


def test_killed_run_resumes_without_rerequesting_cached(setup, tmp_path):
    sim, cfg = setup(latency_ms=60, concurrency=2)
    out = tmp_path / "out.jsonl"
    cache = tmp_path / "cache" / "d" / "responses.jsonl"

    async def run_and_kill() -> None:
        task = asyncio.create_task(generate_dataset_async(cfg, "d", out, log=quiet))
        while not (cache.exists() and len(cache.read_bytes().splitlines()) >= 4):
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run_and_kill())
    assert not out.exists()
    cached = read_jsonl(cache)
    assert 4 <= len(cached) < 12
    summary = generate_dataset(cfg, "d", out, log=quiet)
    assert summary["cached"] == len(cached)
    assert summary["requested"] == summary["http_requests"] == 12 - len(cached)
    for rec in cached:  # requested exactly once, by the killed run
        assert sim.request_counts[prompt_hash(rec["request"])] == 1
    assert set(sim.request_counts) == {prompt_hash(r["request"]) for r in read_jsonl(out)}
    assert len(read_jsonl(out)) == 12


def test_prompts_appended_while_the_job_runs_fail_it_and_the_rerun_requests_only_them(setup, tmp_path):
    """Snakemake records a job's input checksums when it ends: an output written from the prompts file
    as the job read it passed for the file as it was then, so prompts appended meanwhile were left
    out and every later dry run said "nothing to be done" (user audit r3: 4 of 20 prompts missing).
    The job fails instead, its answers cached; the rerun requests the new prompts only."""
    sim, cfg = setup(concurrency=2)
    out = tmp_path / "out.jsonl"
    prompts = Path(cfg["datasets"]["d"]["prompts"])
    appended = []

    def log(message: str) -> None:
        if " to request " in message and not appended:  # the job has read the file and is about to send
            extra = {"id": "late", "messages": [{"role": "user", "content": "appended while the job ran"}]}
            with prompts.open("a", encoding="utf-8") as f:
                f.write(json.dumps(extra) + "\n")
            appended.append(extra)

    with pytest.raises(GenerationError, match=r"prompts.jsonl changed while the job ran \(it read 12 prompt"):
        generate_dataset(cfg, "d", out, log=log)
    assert appended and not out.exists()
    assert sim.requests_total == 12
    summary = generate_dataset(cfg, "d", out, log=quiet)
    assert (summary["cached"], summary["requested"]) == (12, 1) and sim.requests_total == 13
    assert [r["id"] for r in read_jsonl(out)][-1] == "late" and len(read_jsonl(out)) == 13
    generate_dataset(cfg, "d", out, log=quiet)  # the file unchanged (a touch is no change): no error, nothing sent
    assert sim.requests_total == 13


def test_torn_last_cache_line_is_ignored_and_repaired(setup, tmp_path):
    sim, cfg = setup()
    out = tmp_path / "out.jsonl"
    generate_dataset(cfg, "d", out, log=quiet)
    cache = tmp_path / "cache" / "d" / "responses.jsonl"
    lines = cache.read_bytes().splitlines(keepends=True)
    cache.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # crash mid-write
    before = sim.requests_total
    summary = generate_dataset(cfg, "d", out, log=quiet)
    assert summary["requested"] == 1 and sim.requests_total - before == 1
    assert len(read_jsonl(cache)) == 12  # torn fragment cut off, every line valid JSON
    assert len(read_jsonl(out)) == 12


@pytest.mark.parametrize("status", [401, 402])
def test_401_402_stop_the_job_and_keep_the_cache(setup, tmp_path, status):
    sim, cfg = setup(faults={4: str(status)}, concurrency=1)
    with pytest.raises(JobStopped, match=str(status)) as exc:
        generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    assert "3 of its 12 samples are cached" in str(exc.value)
    assert sim.requests_total == 4
    assert len(read_jsonl(tmp_path / "cache" / "d" / "responses.jsonl")) == 3


def test_budget_stops_new_requests(setup, tmp_path):
    sim, cfg = setup(concurrency=1)
    cfg["budget_usd"] = 1e-9  # below any request's worst case: nothing may start
    with pytest.raises(JobStopped, match="budget"):
        generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    assert sim.requests_total == 0


def test_api_key_is_sent_but_never_written(setup, tmp_path, key):
    sim, cfg = setup(faults={2: "429", 3: "400"})
    logs: list[str] = []
    generate_dataset(cfg, "d", tmp_path / "results" / "d" / "responses.jsonl", log=logs.append)
    assert f"Bearer {key}" in sim.authorizations
    (tmp_path / "run.log").write_text("\n".join(logs))
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) >= 4
    for p in files:
        assert key.encode() not in p.read_bytes(), p


def test_a_key_read_with_its_line_break_is_sent_trimmed_and_never_written(setup, tmp_path, key, monkeypatch):
    """A key read from a secret file keeps its trailing line break: it is sent without it, and no file
    holds the key. A key with whitespace inside is refused before anything is sent, without showing it;
    and a transport error that quotes a credential (httpx quotes a refused header) is logged redacted."""
    import httpx

    from eagledata.generate.transport import _describe

    sim, cfg = setup()
    monkeypatch.setenv("OPENROUTER_API_KEY", key + "\n")
    logs: list[str] = []
    generate_dataset(cfg, "d", tmp_path / "results" / "d" / "responses.jsonl", log=logs.append)
    assert sim.authorizations and set(sim.authorizations) == {f"Bearer {key}"}
    (tmp_path / "run.log").write_text("\n".join(logs))
    for p in (p for p in tmp_path.rglob("*") if p.is_file()):
        assert key.encode() not in p.read_bytes(), p
    monkeypatch.setenv("OPENROUTER_API_KEY", key[:8] + " " + key[8:])
    sent = len(sim.authorizations)
    cfg["generation"]["max_tokens"] = 301  # other requests: nothing cached applies
    with pytest.raises(GenerationError, match="whitespace, a control character or a non-ASCII character") as err:
        generate_dataset(cfg, "d", tmp_path / "results" / "d" / "responses.jsonl", log=quiet)
    assert key[8:] not in str(err.value) and len(sim.authorizations) == sent
    monkeypatch.setenv("OPENROUTER_API_KEY", key + "\u00e9")  # httpx would refuse it, quoting a character
    with pytest.raises(GenerationError, match="non-ASCII"):
        generate_dataset(cfg, "d", tmp_path / "results" / "d" / "responses.jsonl", log=quiet)
    assert len(sim.authorizations) == sent
    quoted = _describe(httpx.LocalProtocolError(f"Illegal header value b'Bearer {key}\\n'"))
    assert key not in quoted and "Bearer [redacted]" in quoted


def test_missing_key_and_sglang_without_server(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    cfg = make_config(tmp_path, prompts, "tok")
    with pytest.raises(GenerationError, match="OPENROUTER_API_KEY"):
        generate_dataset(cfg, "d", tmp_path / "o.jsonl", log=quiet)
    cfg["datasets"]["d"]["backend"] = "sglang"
    with pytest.raises(GenerationError, match="api_base"):
        generate_dataset(cfg, "d", tmp_path / "o.jsonl", log=quiet)


def test_simulator_backend_end_to_end_with_samples(tmp_path, k25, monkeypatch):
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)  # the simulator needs none
    tok, fam = k25
    prompts = write_prompts(tmp_path / "p.jsonl", 5)
    cfg = make_config(tmp_path, prompts, tok.source, backend="simulator", samples_per_prompt=2, seed=1, stream=True)
    out = tmp_path / "out.jsonl"
    summary = generate_dataset(cfg, "d", out, log=quiet)
    recs = read_jsonl(out)
    assert [r["id"] for r in recs][:2] == ["q000#0", "q000#1"] and len(recs) == 10
    assert [r["request"]["seed"] for r in recs[:2]] == [1, 2]
    assert all(r["backend"] == "simulator" and parse_response(r["response_raw"]).ok for r in recs)
    assert summary["requested"] == 10 and summary["samples_per_s"] > 0
    assert generate_dataset(cfg, "d", out, log=quiet)["requested"] == 0
    cfg["simulator"]["seed"] = 4  # another simulated model: nothing cached applies
    assert generate_dataset(cfg, "d", out, log=quiet)["requested"] == 10
    # another model family (here one defined in the config: same as kimi-k2.5 but not thinking) answers
    # otherwise: its own cache keys, and the rule's params change so the rule reruns
    before = request_params(dataset_settings(validate_config(cfg), "d"), validate_config(cfg))
    cfg["families"] = {"k25-quiet": {"base": "kimi-k2.5", "thinking": False}}
    cfg["models"]["m"]["family"] = "k25-quiet"
    after = request_params(dataset_settings(validate_config(cfg), "d"), validate_config(cfg))
    assert after != before and after["simulator"]["family_definition"] == cfg["families"]["k25-quiet"]
    assert generate_dataset(cfg, "d", out, log=quiet)["requested"] == 10
    # the tokenizer it answers with: a hub id has no files to declare, so its name and revision are params
    hub = {**cfg, "models": {"m": {**cfg["models"]["m"], "tokenizer": "org/tokenizer"}}}
    unpinned = request_params(dataset_settings(validate_config(hub), "d"), validate_config(hub))
    hub["models"]["m"]["tokenizer_revision"] = "a" * 40
    pinned = request_params(dataset_settings(validate_config(hub), "d"), validate_config(hub))
    assert unpinned != after and pinned != unpinned and pinned["tokenizer"]["tokenizer_revision"] == "a" * 40
    # a paid API is sent text: no tokenizer setting is a param of its generate rule
    paid = {**hub, "datasets": {"d": {**hub["datasets"]["d"], "backend": "openrouter"}}}
    assert "tokenizer" not in request_params(dataset_settings(validate_config(paid), "d"), validate_config(paid))


# --------------------------------------------------------------------------------------------
# import


def test_import_recorded_responses(tmp_path, recorded):
    src = tmp_path / "rec.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recorded[:20]) + "\n")
    out = tmp_path / "results" / "imp" / "responses.jsonl"
    summary = import_responses(src, "imp", out, log=quiet)
    recs = read_jsonl(out)
    assert summary["samples"] == 20 and recs[0]["id"] == "imp-000001" and recs[19]["id"] == "imp-000020"
    assert recs[3]["response_raw"] == recorded[3]["response_raw"] and recs[3]["request"] == recorded[3]["request"]
    assert recs[0]["source"] == recorded[0]["source"] and recs[0]["cache_key"] == cache_key(recorded[0]["request"])


@pytest.mark.parametrize("line, where", [
    ('{"status": 200, "response_raw": "{}"}', ":2:request"),
    ('{"request": {"messages": []}, "status": 200, "response_raw": "{}"}', ":2:request.messages"),
    ('{"request": {"messages": [{"role": "user", "content": "x"}]}, "status": "ok", "response_raw": "{}"}', ":2:status"),
    ('{"request": {"messages": [{"role": "user", "content": "x"}]}, "status": 200}', ":2:response_raw"),
    ('{"id": "a", "request": {"messages": [{"role": "user", "content": "x"}]}, "status": 200, "response_raw": ""}', ":2:id"),
    ("{oops", ":2:(json)"),
    ('{"request": {"messages": [{"role": "user", "content": "a\\ud800b"}]}, "status": 200, "response_raw": "{}"}',
     ":2:request.messages.0.content: a lone surrogate"),
    ('{"request": {"messages": [{"role": "user", "content": "x"}]}, "status": 200, "response_raw": "{}", "\\udfff": 1}',
     ":2:\udfff: a lone surrogate"),
])
def test_import_errors_name_file_line_field(tmp_path, line, where):
    good = '{"id": "a", "request": {"messages": [{"role": "user", "content": "x"}]}, "status": 200, "response_raw": ""}'
    src = tmp_path / "bad.jsonl"
    src.write_text(good + "\n" + line + "\n")
    out = tmp_path / "out.jsonl"
    with pytest.raises(ResponsesFileError) as exc:
        import_responses(src, "imp", out, log=quiet)
    assert str(exc.value).startswith(f"{src}{where}"), str(exc.value)
    assert not out.exists() and not list(tmp_path.glob(".out.jsonl.tmp*"))


def test_the_default_attempt_timeout_leaves_time_for_max_tokens_at_a_slow_pace():
    """An answer still arriving at the deadline is cut and asked again, and billed each time: unset,
    the deadline is 600 s or max_tokens at 10 tokens/s (plus a minute), whichever is longer; a
    timeout_s set is kept."""
    from eagledata.config import validate_config
    from eagledata.generate.retries import ClientSettings, attempt_timeout_s

    assert attempt_timeout_s({"max_tokens": 4096, "timeout_s": None}) == 600
    assert attempt_timeout_s({"max_tokens": 32768, "timeout_s": None}) == 32768 / 10 + 60
    assert attempt_timeout_s({"max_tokens": 32768, "timeout_s": 90}) == 90
    cfg = validate_config({"models": {"m": {"family": "kimi-k2", "tokenizer": "x/y"}},
                           "datasets": {"d": {"prompts": "p.jsonl", "model": "m"}},
                           "generation": {"max_tokens": 16384}})
    assert cfg["generation"]["timeout_s"] is None
    assert ClientSettings.from_generation(cfg["generation"], "u", "openrouter", {}).timeout_s == 16384 / 10 + 60

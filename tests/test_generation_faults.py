"""Generation at production grade, against the stand-in over real loopback HTTP: every fault kind,
kill -9 and SIGTERM of a real generate subprocess, job timeout, request fidelity (what regenerates
and what does not), secrets, progress, and the SGLang backend."""
from __future__ import annotations

import io
import json
import os
import random
import signal
import time

import pytest

from eagledata.generate.answers import sglang_completion_ids
from eagledata.generate.errors import GenerationError, Interrupted, JobStopped
from eagledata.generate.job import generate_dataset
from eagledata.generate.requests import dataset_work
from eagledata.generate.progress import Progress
from eagledata.tokens.responses import parse_response
from eagledata.standin.server import SimulatorServer, prompt_hash
from gen_helpers import (API_KEY, cache_lines, generate_cmd, ledger_rows, make_config, quiet, read_jsonl, spawn,
                         wait_cache_lines, write_prompts)


pytestmark = pytest.mark.timing  # runs alone under xdist (tests/conftest.py)


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv("OPENROUTER_API_KEY", API_KEY)
    return API_KEY


@pytest.fixture
def stand_in(k25):
    servers: list[SimulatorServer] = []

    def make(**kw) -> SimulatorServer:
        tok, fam = k25
        sim = SimulatorServer(tok, fam, seed=kw.pop("seed", 2), **kw).start()
        servers.append(sim)
        return sim

    yield make
    for s in servers:
        s.stop()


# --------------------------------------------------------------------------------------------
# every fault kind: success after a retry, or a clear per-prompt error


FAULTS = [("429:0.05", False), ("502", False), ("503", False), ("hang:5", False), ("error-in-200", False),
          ("malformed", False), ("disconnect", False), ("reset", False), ("mid-stream", True), ("malformed", True),
          ("error-in-200", True), ("reset", True)]


@pytest.mark.parametrize("fault, stream", FAULTS)
def test_each_fault_kind_is_retried_to_success(stand_in, tmp_path, key, fault, stream):
    prompts = write_prompts(tmp_path / "p.jsonl", 5)
    doomed = prompt_hash(json.loads(prompts.read_text().splitlines()[2]))
    hit = []

    def faults(n, body):  # the first request of prompt q002 fails
        if prompt_hash(body) == doomed and not hit:
            hit.append(n)
            return fault
        return None

    sim = stand_in(faults=faults)
    cfg = make_config(tmp_path, prompts, sim.tokenizer.source, api_base=sim.base_url, stream=stream, timeout_s=0.5,
                      concurrency=2)
    logs: list[str] = []
    t0 = time.monotonic()
    summary = generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=logs.append)
    recs = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert all(r["status"] == 200 and parse_response(r["response_raw"]).ok for r in recs.values())
    assert recs["q002"]["attempts"] == 2 and sim.request_counts[doomed] == 2
    assert summary["http_requests"] == 6 and sum("retrying" in m for m in logs) == 1
    assert len(cache_lines(tmp_path)) == 5  # the failed attempt was never stored
    if fault.startswith("429"):
        assert time.monotonic() - t0 >= 0.05  # Retry-After honoured
    if fault.startswith("hang"):
        assert any("timeout after 0.5 s" in m for m in logs)
    rows = ledger_rows(tmp_path)
    assert {r[0] for r in rows} <= {"settled", "orphaned"}
    # the ledger never counts less than the stand-in billed (a truncated or cut answer may be billed:
    # held, then settled from /generation when its id is known)
    assert sum(r[2] if r[0] == "settled" else r[1] for r in rows) >= sim.billed_usd - 1e-12


@pytest.mark.parametrize("fault", ["502", "error-in-200", "mid-stream", "hang:5", "reset", "malformed"])
def test_persistent_fault_is_a_clear_per_prompt_error(stand_in, tmp_path, key, fault):
    prompts = write_prompts(tmp_path / "p.jsonl", 4)
    doomed = prompt_hash(json.loads(prompts.read_text().splitlines()[1]))
    sim = stand_in(faults=lambda n, body: fault if prompt_hash(body) == doomed else None)
    cfg = make_config(tmp_path, prompts, sim.tokenizer.source, api_base=sim.base_url, stream=fault == "mid-stream",
                      timeout_s=0.3, max_attempts=2)
    with pytest.raises(GenerationError) as exc:
        generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    msg = str(exc.value)
    assert "1 request(s) still failing after 2 attempts" in msg and "q001:" in msg
    what = {"502": "HTTP 502", "error-in-200": "error in 200 body", "mid-stream": "error in 200 stream",
            "hang:5": "timeout after 0.3 s", "reset": "transport error", "malformed": "malformed"}[fault]
    assert what in msg.split("q001:")[1].splitlines()[0], msg
    assert len(cache_lines(tmp_path)) == 3 and sim.request_counts[doomed] == 2
    summary = json.loads((tmp_path / "cache" / "d" / "generation_summary.json").read_text())
    assert [e["id"] for e in summary["errors"]] == ["q001"] and what in summary["errors"][0]["error"]


def test_final_4xx_and_401_are_reported_per_prompt(stand_in, tmp_path, key):
    sim = stand_in(faults={2: "400", 3: "403"})
    prompts = write_prompts(tmp_path / "p.jsonl", 6)
    cfg = make_config(tmp_path, prompts, sim.tokenizer.source, api_base=sim.base_url, concurrency=1)
    summary = generate_dataset(cfg, "d", tmp_path / "out.jsonl", summary_path=tmp_path / "s.json", log=quiet)
    errors = json.loads((tmp_path / "s.json").read_text())["errors"]
    assert [(e["id"], e["status"], e["final"]) for e in errors] == [("q001", 400, True), ("q002", 403, True)]
    assert summary["final_errors"] == 2 and sim.requests_total == 6


# --------------------------------------------------------------------------------------------
# kill -9, SIGTERM, job timeout


def test_kill_9_then_rerun_loses_nothing(stand_in, tmp_path):
    sim = stand_in(latency_ms=60)
    prompts = write_prompts(tmp_path / "p.jsonl", 40)
    concurrency = 6
    cfg = make_config(tmp_path, prompts, sim.tokenizer.source, api_base=sim.base_url, concurrency=concurrency)
    cmd = generate_cmd(cfg, tmp_path)
    proc = spawn(cmd, tmp_path / "run1.log")
    wait_cache_lines(tmp_path, random.Random(os.getpid()).randint(5, 30), proc)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL
    received = cache_lines(tmp_path)
    before = dict(sim.request_counts)
    assert 5 <= len(received) < 40

    proc = spawn(cmd, tmp_path / "run2.log")
    assert proc.wait(60) == 0, (tmp_path / "run2.log").read_text()
    out = read_jsonl(tmp_path / "results" / "d" / "responses.jsonl")
    assert [r["id"] for r in out] == [f"q{i:03d}" for i in range(40)]
    assert all(r["status"] == 200 for r in out)
    for rec in received:  # every response received before the kill: requested exactly once, ever
        assert sim.request_counts[prompt_hash(rec["request"])] == 1
    resent = [h for h, n in sim.request_counts.items() if n > 1]
    assert all(before.get(h, 0) == 1 for h in resent)  # only prompts that were in flight at the kill
    assert len(resent) <= concurrency
    assert len(sim.request_counts) == 40
    # the ledger: nothing left reserved; the killed requests whose generation id was recorded are
    # reconciled from /generation; the total never under-counts what the stand-in billed
    rows = ledger_rows(tmp_path)
    assert not [r for r in rows if r[0] == "reserved"]
    assert not [r for r in rows if r[0] == "orphaned" and r[3]]
    counted = sum(r[2] if r[0] == "settled" else r[1] for r in rows)
    assert counted >= sim.billed_usd - 1e-9


def test_budget_stop_leaves_no_reservation_held(stand_in, tmp_path, key):
    """The budget stops the job: the ledger ends with exactly what the stand-in billed, within the
    cap, nothing reserved or orphaned, and every paid answer cached."""
    price = {"prompt": 1.0, "completion": 10.0}
    sim = stand_in(latency_ms=30, price_per_mtok=price)
    prompts = write_prompts(tmp_path / "p.jsonl", 40, tools_every=0)
    cfg = make_config(tmp_path, prompts, sim.tokenizer.source, api_base=sim.base_url, concurrency=4, max_tokens=40)
    cfg["models"]["m"]["price_per_mtok"] = price
    cfg["budget_usd"] = 0.006  # room for about a dozen worst cases
    with pytest.raises(GenerationError, match="stopped: budget"):
        generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    rows = ledger_rows(tmp_path)
    assert 4 <= sim.requests_total < 40
    assert [r[0] for r in rows] == ["settled"] * sim.requests_total
    assert sum(r[2] for r in rows) == pytest.approx(sim.billed_usd)
    assert sim.billed_usd <= cfg["budget_usd"] + 1e-12
    assert len(cache_lines(tmp_path)) == sim.requests_total


def test_stop_gives_back_the_reservations_asked_ahead(stand_in, tmp_path, key):
    """Each worker asks for its next reservation while its current request is in flight; when a 402
    stops the job, those never used are settled at 0 ("not sent") instead of staying held."""
    sim = stand_in(latency_ms=40, faults={10: "402"})
    prompts = write_prompts(tmp_path / "p.jsonl", 40, tools_every=0)
    cfg = make_config(tmp_path, prompts, sim.tokenizer.source, api_base=sim.base_url, concurrency=4)
    with pytest.raises(GenerationError, match="402"):
        generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    rows = ledger_rows(tmp_path)
    not_sent = [r for r in rows if (r[4] or "").startswith("not sent")]
    assert not [r for r in rows if r[0] in ("reserved", "orphaned")]
    assert len(rows) - len(not_sent) == sim.requests_total  # one reservation per request sent ...
    assert 1 <= len(not_sent) <= 4 and all(r[2] == 0 for r in not_sent)  # ... plus the workers' next ones
    assert sum(r[2] for r in rows) == pytest.approx(sim.billed_usd)


def test_a_retry_near_the_cap_never_waits_behind_its_own_next_reservation(stand_in, tmp_path, key):
    """One worker, a budget of about four worst cases, a prompt that always times out: its retries
    fill the budget with orphans (held: they may have been billed). The worker's reservation for
    its next prompt is given back before each retry asks, so the job stops for budget at once
    instead of waiting forever for room only it holds."""
    quick = stand_in()
    prompts = write_prompts(tmp_path / "p.jsonl", 3, tools_every=0)
    first = prompt_hash(json.loads(prompts.read_text().splitlines()[0]))
    measure = make_config(tmp_path / "m", prompts, quick.tokenizer.source, api_base=quick.base_url, concurrency=1)
    generate_dataset(measure, "d", tmp_path / "m.jsonl", log=quiet)
    worst = max(r[1] for r in ledger_rows(tmp_path / "m"))
    sim = stand_in(faults=lambda n, body: "hang:3" if prompt_hash(body) == first else None)
    cfg = make_config(tmp_path, prompts, sim.tokenizer.source, api_base=sim.base_url, concurrency=1, max_attempts=8,
                      timeout_s=0.3, job_timeout_s=30)
    cfg["budget_usd"] = 4.5 * worst
    t0 = time.monotonic()
    with pytest.raises(GenerationError, match="stopped: budget"):
        generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    assert time.monotonic() - t0 < 10
    rows = ledger_rows(tmp_path)
    assert not [r for r in rows if r[0] == "reserved"]
    assert [r[4] for r in rows if r[0] == "orphaned"] == ["timeout"] * 4
    assert all(r[2] == 0 for r in rows if r[0] == "settled")  # the next prompt's reservation: not sent


def test_second_sigterm_during_a_retry_after_pause_orphans_nothing_unsent(stand_in, tmp_path):
    """A 429 with Retry-After holds every worker; two SIGTERMs cancel them while they wait: their
    reservations (asked ahead, never sent) are settled at 0, not left held as orphans."""
    sim = stand_in(faults={1: "429:5"})
    prompts = write_prompts(tmp_path / "p.jsonl", 6, tools_every=0)
    cfg = make_config(tmp_path, prompts, sim.tokenizer.source, api_base=sim.base_url, concurrency=2, timeout_s=5)
    cfg["budget_usd"] = 10.0
    proc = spawn(generate_cmd(cfg, tmp_path), tmp_path / "run.log")
    t0 = time.monotonic()
    while "retrying in" not in (tmp_path / "run.log").read_text():
        assert proc.poll() is None and time.monotonic() - t0 < 30, (tmp_path / "run.log").read_text()
        time.sleep(0.02)
    time.sleep(0.3)  # the other worker has its answer too; both wait behind the Retry-After
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 128 + signal.SIGTERM, (tmp_path / "run.log").read_text()
    rows = ledger_rows(tmp_path)
    assert rows and not [r for r in rows if r[0] in ("reserved", "orphaned")], rows
    sent = [r for r in rows if not (r[4] or "").startswith("not sent")]
    assert len(sent) == sim.requests_total
    assert len(rows) > len(sent)  # reservations asked ahead were given back


def test_sigterm_drains_in_flight_and_leaves_the_cache_consistent(stand_in, tmp_path):
    sim = stand_in(latency_ms=300)
    prompts = write_prompts(tmp_path / "p.jsonl", 24)
    cfg = make_config(tmp_path, prompts, sim.tokenizer.source, api_base=sim.base_url, concurrency=4)
    cmd = generate_cmd(cfg, tmp_path)
    proc = spawn(cmd, tmp_path / "run1.log")
    wait_cache_lines(tmp_path, 4, proc)
    time.sleep(0.1)  # requests are in flight
    in_flight = sim.in_flight
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 128 + signal.SIGTERM
    log = (tmp_path / "run1.log").read_text()
    assert "received SIGTERM: draining" in log and "interrupted" in log
    cached = cache_lines(tmp_path)  # every line is a whole record (read_jsonl parses each)
    assert len(cached) == sim.requests_total  # every request sent was answered and cached: drained
    assert in_flight >= 1 and len(cached) >= 4 + 1
    rows = ledger_rows(tmp_path)
    assert rows and all(r[0] == "settled" for r in rows)
    proc = spawn(cmd, tmp_path / "run2.log")
    assert proc.wait(60) == 0
    assert sorted(sim.request_counts.values()) == [1] * 24


def test_job_timeout_drains_and_rerun_resumes(stand_in, tmp_path, key):
    sim = stand_in(latency_ms=150)
    prompts = write_prompts(tmp_path / "p.jsonl", 20)
    cfg = make_config(tmp_path, prompts, sim.tokenizer.source, api_base=sim.base_url, concurrency=2, job_timeout_s=0.4)
    with pytest.raises(Interrupted, match="job timeout") as exc:
        generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    assert exc.value.exit_code == 1
    n = len(cache_lines(tmp_path))
    assert 2 <= n < 20 and n == sim.requests_total
    cfg["generation"]["job_timeout_s"] = None
    summary = generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    assert summary["requested"] == 20 - n and sorted(sim.request_counts.values()) == [1] * 20


# --------------------------------------------------------------------------------------------
# request fidelity


def test_changed_sampling_parameter_regenerates_only_affected_prompts(stand_in, tmp_path, key):
    sim = stand_in()
    pa = write_prompts(tmp_path / "a.jsonl", 6, prefix="a")
    pb = write_prompts(tmp_path / "b.jsonl", 4, prefix="b")
    cfg = make_config(tmp_path, pa, sim.tokenizer.source, api_base=sim.base_url, temperature=0.7)
    cfg["datasets"] = {"a": {"prompts": str(pa), "model": "m", "backend": "openrouter"},
                       "b": {"prompts": str(pb), "model": "m", "backend": "openrouter",
                             "generation": {"temperature": 1.0}}}

    def run() -> dict:
        return {ds: generate_dataset(cfg, ds, tmp_path / ds / "out.jsonl", log=quiet)["requested"] for ds in ("a", "b")}

    assert run() == {"a": 6, "b": 4}
    cfg["generation"]["temperature"] = 0.8  # b overrides it: only a's prompts are affected
    assert run() == {"a": 6, "b": 0}
    cfg["generation"]["samples_per_prompt"] = 2  # sample 0 keeps its key: only the new samples
    assert run() == {"a": 6, "b": 4}
    cfg["datasets"]["b"]["generation"]["extra_body"] = {"top_k": 20}
    assert run() == {"a": 0, "b": 8}
    cfg["generation"].update(concurrency=1, timeout_s=7, max_attempts=9, backoff_base_s=0.5, job_timeout_s=600,
                             drain_timeout_s=3)
    cfg["budget_usd"] = 50.0
    assert run() == {"a": 0, "b": 0}  # client, retry and budget settings regenerate nothing
    assert sim.requests_total == 6 + 4 + 6 + 6 + 4 + 8


def test_concurrency_and_timeouts_change_no_request(stand_in, tmp_path, key):
    sim = stand_in()
    prompts = write_prompts(tmp_path / "p.jsonl", 9)
    outs = []
    for i, (conc, timeout) in enumerate([(1, 5.0), (7, 60.0)]):
        cfg = make_config(tmp_path / f"r{i}", prompts, sim.tokenizer.source, api_base=sim.base_url, concurrency=conc,
                          timeout_s=timeout, seed=5, temperature=0.3)
        generate_dataset(cfg, "d", tmp_path / f"out{i}.jsonl", log=quiet)
        outs.append(read_jsonl(tmp_path / f"out{i}.jsonl"))
    for a, b in zip(*outs):
        assert a["request"] == b["request"] and a["cache_key"] == b["cache_key"]
        pa, pb = parse_response(a["response_raw"]), parse_response(b["response_raw"])
        assert (pa.content, pa.reasoning, pa.usage["completion_tokens"]) == (pb.content, pb.reasoning, pb.usage["completion_tokens"])


# --------------------------------------------------------------------------------------------
# secrets, malformed prompt files, progress


def test_api_key_never_in_any_written_file(stand_in, tmp_path):
    sim = stand_in(faults={2: "429", 3: "400", 5: "mid-stream", 6: "error-in-200"})
    prompts = write_prompts(tmp_path / "p.jsonl", 8)
    cfg = make_config(tmp_path, prompts, sim.tokenizer.source, api_base=sim.base_url, stream=True)
    cmd = generate_cmd(cfg, tmp_path) + ["--summary", str(tmp_path / "results" / "d" / "generation_summary.json")]
    proc = spawn(cmd, tmp_path / "run.log")
    assert proc.wait(60) == 0, (tmp_path / "run.log").read_text()
    assert f"Bearer {API_KEY}" in sim.authorizations
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"responses.jsonl", "budget.sqlite", "generation_summary.json", "run.log"} <= names
    for p in files:
        assert API_KEY.encode() not in p.read_bytes(), p


def test_malformed_prompt_file_fails_with_file_line_field(tmp_path, k25):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n{"messages": [{"role": "user"}]}\n')
    cfg = make_config(tmp_path, prompts, k25[0].source, api_base="http://127.0.0.1:9/api/v1")
    proc = spawn(generate_cmd(cfg, tmp_path), tmp_path / "run.log")
    assert proc.wait(30) == 1
    assert f"{prompts}:2:messages[0].content: missing" in (tmp_path / "run.log").read_text()


def test_progress_plain_lines_and_tty_bar():
    lines: list[str] = []
    p = Progress("generate d", 20, lines.append, stream=io.StringIO(), tty=False, every_s=3600)
    for _ in range(20):
        p.done += 1
        p.ok += 1
        p.completion_tokens += 100
        p.cost += 0.01
        p.update()
    assert len(lines) == 10 and lines[-1].startswith("generate d: 20/20 (100%)")
    assert "tok/s" in lines[0] and "$0.0200" in lines[0] and "ETA" in lines[0] and "0 error(s)" in lines[0]

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Tty()
    p = Progress("generate d", 4, lines.append, stream=screen)
    p.done, p.final_errors = 1, 1
    p.update(force=True)
    p.close()
    assert "\r" in screen.getvalue() and "[######" in screen.getvalue() and "1 error(s)" in screen.getvalue()


# --------------------------------------------------------------------------------------------
# SGLang backend against the stand-in speaking SGLang's shapes


def sglang_setup(stand_in, tmp_path, n: int, server: dict, base_suffix: str = "", tools_every: int = 3, **generation):
    """An SGLang stand-in (``server``: its options) and a config sending ``n`` prompts to it (``api_base``:
    the server root, plus ``base_suffix``)."""
    sim = stand_in(api="sglang", **server)
    prompts = write_prompts(tmp_path / "p.jsonl", n, tools_every=tools_every)
    return sim, make_config(tmp_path, prompts, sim.tokenizer.source, backend="sglang",
                            api_base=sim.root_url + base_suffix, **generation)


@pytest.mark.parametrize("endpoint, trim", [("chat", False), ("chat", True), ("generate", False), ("generate", True)])
def test_sglang_backend_stores_the_generated_ids(stand_in, tmp_path, monkeypatch, endpoint, trim):
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)  # a local server needs no key
    # trimmed ids after tool calls cannot be completed on the chat endpoint (SGLang reports no matched
    # stop after tool calls): test_sglang_answers_without_usable_ids_stop_the_job
    sim, cfg = sglang_setup(stand_in, tmp_path, 6, {"sglang_trim_stop": trim, "faults": {2: "503"}}, "/v1",
                            tools_every=0 if trim and endpoint == "chat" else 3, sglang_endpoint=endpoint, stream=True)
    summary = generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    assert summary["http_requests"] == 7
    tok, eot = sim.tokenizer, sim.tokenizer.special_id(sim.family.end_of_turn)
    for rec in read_jsonl(tmp_path / "out.jsonl"):
        truth = sim.truth(f"gen-{rec['generation_id']}") if not rec["generation_id"].startswith("gen-") else sim.truth(rec["generation_id"])
        assert rec["token_ids"] == truth["ids"]  # the ids the model generated, end of turn included
        assert rec["token_ids"][-1] == eot and rec["token_ids_info"]["appended_stop"] is trim
        assert rec["prompt_token_ids"] == truth["prompt_ids"] if endpoint == "chat" else "prompt_token_ids" not in rec
        if endpoint == "chat":
            assert rec["request"]["return_token_ids"] is True and rec["request"]["stream"] is False
            assert "provider" not in rec["request"] and "chat_request" not in rec
            parsed = parse_response(rec["response_raw"])
            assert parsed.ok and parsed.completion_tokens == len(truth["ids"])
        else:
            assert rec["request"]["input_ids"] == truth["prompt_ids"] and rec["chat_request"]["messages"]
            body = json.loads(rec["response_raw"])
            assert tok.decode(rec["token_ids"]) == body["text"]  # special tokens kept, stop not trimmed


@pytest.mark.parametrize("endpoint, trim", [("chat", False), ("chat", True), ("generate", False), ("generate", True)])
def test_sglang_output_ids_that_echo_the_prompt_are_cut(stand_in, tmp_path, monkeypatch, endpoint, trim):
    """SGLang releases whose detokenizer returned its decode window as ``output_ids`` (sglang issues
    #10896, #17240) put the prompt's last 5 ids before the completion's. They were stored as the
    completion (12 of 12 records, then all a mismatch in the tokens stage); now the 5 extra ids,
    the prompt's own last ones by the engine's completion count, are cut."""
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    sim, cfg = sglang_setup(stand_in, tmp_path, 12, {"sglang_prompt_echo": 5, "sglang_trim_stop": trim},
                            tools_every=0, sglang_endpoint=endpoint)
    summary = generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    assert summary["http_requests"] == 12
    for rec in read_jsonl(tmp_path / "out.jsonl"):
        truth = sim.truth("gen-" + rec["generation_id"])
        assert rec["token_ids"] == truth["ids"]
        assert rec["token_ids_info"]["prompt_echo"] == 5 and rec["token_ids_info"]["appended_stop"] is trim


@pytest.mark.parametrize("endpoint, quirk", [("chat", {"sglang_chat_token_ids": False}),
                                             ("chat", {"sglang_trim_stop": True})])
def test_sglang_answers_without_usable_ids_stop_the_job(stand_in, tmp_path, monkeypatch, endpoint, quirk):
    """An SGLang answer without usable token ids is the server's (its release, or a bug in it), so
    every answer would be alike: the job stops at the first, having spent at most its ``concurrency``
    (4) generations. Retried as a passing fault, each of 20 prompts was generated 4 times
    (``max_attempts``, 6 by default), 80 whole generations for no id, and the job went on to the end.
    Quirks: a chat endpoint that ignores ``return_token_ids`` (SGLang before #30917); ids without their
    stop after tool calls (no matched stop reported: the missing id is unknown)."""
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    sim, cfg = sglang_setup(stand_in, tmp_path, 20, quirk, tools_every=1, sglang_endpoint=endpoint,
                            tool_choice="required")
    with pytest.raises(JobStopped, match="token_ids|output_ids") as err:
        generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    assert sim.requests_total <= 4, sim.requests_total
    assert "0 of its 20 samples are cached" in str(err.value)


def test_sglang_ids_are_held_to_the_engines_completion_count():
    """:func:`sglang_completion_ids` against the engine's own count: an echo of the prompt's end is
    cut (with a trimmed stop, one more), extra ids that are not the prompt's end and ids too few to
    complete are refused, and without a count the ids are taken as before."""
    prompt, done = [1, 2, 3, 4, 5, 6, 7], [50, 51, 99]
    assert sglang_completion_ids([3, 4, 5, 6, 7] + done, "stop", 99, prompt, 3)[0] == done
    assert sglang_completion_ids([3, 4, 5, 6, 7, 50, 51], "stop", 99, prompt, 3)[0] == done
    assert sglang_completion_ids(prompt + done, "stop", 99, prompt, 3)[1]["prompt_echo"] == 7
    assert sglang_completion_ids([7, 7] + done, "stop", 99, prompt, 3)[0] is None
    assert sglang_completion_ids([9] + done, "stop", 99, None, 3)[0] is None
    assert "unknown" in sglang_completion_ids([50, 51], "tool_calls", None, prompt, 3)[1]["problem"]
    assert sglang_completion_ids([50, 51], "length", None, prompt, 2)[0] == [50, 51]
    assert sglang_completion_ids([50, 51], "stop", 99, prompt, None)[0] == done


@pytest.mark.parametrize("endpoint", ["chat", "generate"])
def test_an_aborted_sglang_generation_is_asked_again(stand_in, tmp_path, monkeypatch, endpoint):
    """SGLang answers a generation it aborted part-way (``/abort_request``, a shutdown, a retraction)
    with a 200 whose finish is ``abort``. On the chat endpoint it was stored as a success: cached, so
    never asked again, its half of a reply a mismatch in the tokens stage and, with ``turns: all``,
    the next turn's history. Now it is retried like the native endpoint's abort."""
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    sim, cfg = sglang_setup(stand_in, tmp_path, 6, {"faults": {2: "abort"}}, tools_every=0, sglang_endpoint=endpoint)
    summary = generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    assert summary["http_requests"] == 7
    for rec in read_jsonl(tmp_path / "out.jsonl"):
        assert rec["token_ids"] == sim.truth("gen-" + rec["generation_id"])["ids"]
        assert "abort" not in rec["response_raw"]


def test_thinking_turned_off_reaches_sglangs_chat_template(stand_in, tmp_path, monkeypatch):
    """``reasoning: {enabled: false}`` (OpenRouter's off switch) is no off switch to SGLang's chat
    endpoint: its protocol takes ``reasoning.enabled`` only to turn thinking on (releases before
    sgl-project/sglang#9715 read no ``reasoning`` at all), so K2.5's template thought: 12 of 12
    answers were thinking ones, judged exact (the engine's prompt ids, only noted as differing from
    ours). The body now also says it the way SGLang's template step reads it; with thinking on the
    body is as before (its cached answers are kept)."""
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    sim, cfg = sglang_setup(stand_in, tmp_path, 12, {}, reasoning={"enabled": False},
                            extra_body={"chat_template_kwargs": {"other": 1}})
    generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    for rec in read_jsonl(tmp_path / "out.jsonl"):
        truth = sim.truth("gen-" + rec["generation_id"])
        assert truth["thinking"] is False and rec["prompt_token_ids"] == truth["prompt_ids"]
        assert rec["request"]["chat_template_kwargs"] == {"thinking": False, "other": 1}
    cfg["generation"].update(reasoning={"enabled": True}, extra_body={})
    assert "chat_template_kwargs" not in dataset_work(cfg, "d").items[0].request


@pytest.mark.parametrize("endpoint", ["chat", "generate"])
def test_a_new_model_behind_the_same_sglang_address_is_not_answered_from_the_cache(stand_in, tmp_path, monkeypatch,
                                                                                   endpoint):
    """The key names the server's address, not its weights: answers record the model path the server
    reports, and a job whose server now serves another one stops before anything is requested or
    written (before: the old checkpoint's 6 answers output as the new one's, 0 requests). A new
    ``models.NAME.revision`` makes the new checkpoint's requests new ones."""
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    sim, cfg = sglang_setup(stand_in, tmp_path, 6, {"model_path": "/models/kimi-k2.5-step-1000"}, "/v1",
                            sglang_endpoint=endpoint)
    out = tmp_path / "out.jsonl"
    generate_dataset(cfg, "d", out, log=quiet)
    assert {r["served_model"] for r in read_jsonl(out)} == {"/models/kimi-k2.5-step-1000"}
    first = out.read_bytes()
    generate_dataset(cfg, "d", out, log=quiet)  # the same model: all cached
    assert sim.requests_total == 6

    sim.model_path = "/models/kimi-k2.5-step-2000"
    with pytest.raises(GenerationError, match=r"serves '/models/kimi-k2.5-step-2000' now, but cached answers .* "
                                              r"\(6 by '/models/kimi-k2.5-step-1000'\).*models\.m\.revision"):
        generate_dataset(cfg, "d", out, log=quiet)
    assert sim.requests_total == 6 and out.read_bytes() == first
    cfg["models"]["m"]["revision"] = "step-2000"
    summary = generate_dataset(cfg, "d", out, log=quiet)
    assert summary["requested"] == 6 and sim.requests_total == 12
    assert {r["served_model"] for r in read_jsonl(out)} == {"/models/kimi-k2.5-step-2000"}

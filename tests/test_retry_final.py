"""Final errors requested again (``eagledata retry``), and a job whose first answers are all the same
final error stopping: against the stand-in on loopback, real caches and a real Snakemake dry run."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from eagledata.generate.cache import ResponseCache
from eagledata.generate.cachelock import try_writer_lock
from eagledata.generate.errors import JobStopped
from eagledata.generate.job import generate_dataset
from eagledata.generate.retryfinal import RetryRefused, retry_command, retry_final_errors, retry_note_path
from eagledata.standin.faults import Fault
from eagledata.standin.server import SimulatorServer

from gen_helpers import API_KEY, make_config, quiet, read_jsonl, write_prompts


@pytest.fixture
def setup(tmp_path, k25, monkeypatch):
    """A stand-in on loopback (faults as given), 12 prompts, and a config sending to it."""
    monkeypatch.setenv("OPENROUTER_API_KEY", API_KEY)
    tok, fam = k25
    prompts = write_prompts(tmp_path / "prompts.jsonl", 12)
    servers: list[SimulatorServer] = []

    def make(faults=None, **generation):
        sim = SimulatorServer(tok, fam, seed=2, faults=faults).start()
        servers.append(sim)
        return sim, make_config(tmp_path, prompts, str(tok.source), api_base=sim.base_url, **generation)

    yield make
    for s in servers:
        s.stop()


def cache_of(cfg) -> ResponseCache:
    cache = ResponseCache(f"{cfg['cache_dir']}/d/responses.jsonl")
    cache.load()
    return cache


def test_retried_final_errors_are_requested_again_and_only_they(setup, tmp_path):
    sim, cfg = setup(faults={2: "404", 5: "403", 7: "404"}, concurrency=1)
    out = tmp_path / "out.jsonl"
    generate_dataset(cfg, "d", out, log=quiet)
    assert sorted(r["status"] for r in read_jsonl(out) if r["status"] != 200) == [403, 404, 404]
    lines = (tmp_path / "cache/d/responses.jsonl").read_text().splitlines()

    assert retry_final_errors(cfg["cache_dir"], "d", [404], dry_run=True) == {"404": 2}
    assert (tmp_path / "cache/d/responses.jsonl").read_text().splitlines() == lines  # a dry run changes nothing
    assert not retry_note_path(cfg["cache_dir"], "d").exists()
    assert retry_final_errors(cfg["cache_dir"], "d", [404]) == {"404": 2}
    after = (tmp_path / "cache/d/responses.jsonl").read_text().splitlines()
    assert after[:len(lines)] == lines and len(after) == len(lines) + 2  # append-only: the errors are still there
    assert json.loads(retry_note_path(cfg["cache_dir"], "d").read_text())["forgotten"] == {"404": 2}

    before = sim.requests_total
    summary = generate_dataset(cfg, "d", out, log=quiet)
    assert sim.requests_total - before == 2 and summary["requested"] == 2
    assert sorted(r["status"] for r in read_jsonl(out)) == [200] * 11 + [403]  # the 403 was not asked for
    assert retry_final_errors(cfg["cache_dir"], "d", [404]) == {}
    before = sim.requests_total
    generate_dataset(cfg, "d", out, log=quiet)
    assert sim.requests_total == before  # answered now: cached, never forgotten


def test_an_answer_is_never_forgotten(setup, tmp_path):
    sim, cfg = setup(concurrency=2)
    generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    cache = cache_of(cfg)
    key = next(iter(cache.index))
    with pytest.raises(ValueError, match="not a final error"):
        cache.forget(key, {"by": "test"})
    # a retry marker written by hand after an answer does not drop it
    with open(cache.path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"cache_key": key, "retry": {"by": "hand"}}) + "\n")
    assert key in cache_of(cfg).index
    before = sim.requests_total
    generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    assert sim.requests_total == before


def test_retry_is_refused_while_a_job_writes_the_cache(setup, tmp_path):
    sim, cfg = setup(faults={1: "404"}, concurrency=1)
    generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    data = (tmp_path / "cache/d/responses.jsonl").read_bytes()
    with try_writer_lock(cfg["cache_dir"], "d") as held:
        assert held is not None and try_writer_lock(cfg["cache_dir"], "d") is None
        with pytest.raises(RetryRefused, match="a generate job is writing its cache"):
            retry_final_errors(cfg["cache_dir"], "d")
    assert (tmp_path / "cache/d/responses.jsonl").read_bytes() == data
    assert retry_final_errors(cfg["cache_dir"], "d") == {"404": 1}


def test_a_stop_names_the_config_file_the_snakemake_run_read(monkeypatch, tmp_path):
    """The retry command a job's stop message suggests repeats the config file the run read (the
    Snakefile passes it to jobs), unless it is the default one, which the command reads anyway."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EAGLEDATA_CONFIGFILES", json.dumps(["runs/real.yaml"]))
    assert retry_command("d", 404) == "eagledata retry d --config runs/real.yaml --status 404"
    monkeypatch.setenv("EAGLEDATA_CONFIGFILES", json.dumps([str(tmp_path / "config/config.yaml")]))
    assert retry_command("d", 404) == "eagledata retry d --status 404"
    monkeypatch.delenv("EAGLEDATA_CONFIGFILES")
    assert retry_command("d") == "eagledata retry d"


def test_the_first_answers_all_the_same_final_error_stop_the_job(setup, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEDATA_CONFIGFILES", json.dumps(["runs/real.yaml"]))  # as the Snakefile passes it
    sim, cfg = setup(faults=lambda n, body: "404", concurrency=1)
    with pytest.raises(JobStopped, match=r"the first 5 answers were all the same final error \(HTTP 404") as exc:
        generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    assert "eagledata retry d --config runs/real.yaml --status 404" in str(exc.value)
    assert "5 of its 12 samples are cached" in str(exc.value)
    assert sim.requests_total == 5  # not 12
    # final errors that differ (a prompt too long, each its own count) are the prompts' own: no stop,
    # also where OpenRouter words them alike and the provider's own message follows in metadata.raw
    sim, cfg = setup(faults=lambda n, body: Fault.http(400, message="Provider returned error", raw=json.dumps(
        {"error": {"message": f"This model's maximum context length is 8192 tokens; your prompt has {8000 + n}"}})),
        concurrency=1)
    cfg["cache_dir"] = str(tmp_path / "cache1")
    assert generate_dataset(cfg, "d", tmp_path / "out1.jsonl", log=quiet)["final_errors"] == 12
    sim, cfg = setup(faults=lambda n, body: Fault.http(400, message=f"prompt is {1000 + n} tokens, too long"),
                     concurrency=1)
    cfg["cache_dir"] = str(tmp_path / "cache2")
    assert generate_dataset(cfg, "d", tmp_path / "out2.jsonl", log=quiet)["final_errors"] == 12
    # after an answer, 5 alike are no stop; 20 in a row are (the only provider allowed gone mid-run)
    sim, cfg = setup(faults=lambda n, body: "404" if n > 1 else None, concurrency=1)
    cfg["cache_dir"] = str(tmp_path / "cache3")
    assert generate_dataset(cfg, "d", tmp_path / "out3.jsonl", log=quiet)["final_errors"] == 11
    prompts = write_prompts(tmp_path / "many.jsonl", 40)
    sim, cfg = setup(faults=lambda n, body: "404" if n > 3 else None, concurrency=1)
    cfg["cache_dir"], cfg["datasets"]["d"]["prompts"] = str(tmp_path / "cache4"), str(prompts)
    with pytest.raises(JobStopped, match=r"the last 20 answers were all the same final error \(HTTP 404"):
        generate_dataset(cfg, "d", tmp_path / "out4.jsonl", log=quiet)
    assert sim.requests_total == 23


def test_the_cli_counts_forgets_and_the_dry_run_shows_the_generate_job(setup, tmp_path):
    sim, cfg = setup(faults={3: "404"}, concurrency=1)
    generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "eagledata.cli", "retry", "--config", str(path), *args],
                              capture_output=True, text=True)

    dry = cli("--dry-run")
    assert dry.returncode == 0 and "d: 1 final error(s) would be requested again (HTTP 404: 1)" in dry.stdout
    assert cli("d", "--status", "400").stdout.strip() == "d: no final error cached"
    done = cli("d")
    assert done.returncode == 0 and "d: 1 final error(s) forgotten (HTTP 404: 1)" in done.stdout
    assert cli("nope").returncode == 2
    # the generate rule declares the note: written after the outputs, it reruns the job
    from eagledata.generate.ruleinputs import GenerateRuleInputs

    inputs = GenerateRuleInputs(cfg, lambda w: [])
    assert inputs.retried(type("W", (), {"dataset": "d"})) == [str(retry_note_path(cfg["cache_dir"], "d"))]
    retry_note_path(cfg["cache_dir"], "d").unlink()
    assert inputs.retried(type("W", (), {"dataset": "d"})) == []


def test_the_plan_counts_the_cached_final_errors_and_names_the_command(setup, tmp_path):
    from eagledata.generate.plan import format_plan, plan

    sim, cfg = setup(faults={2: "404", 4: "404", 6: "403"}, concurrency=1)
    generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    p = plan(cfg)
    row = p["datasets"][0]
    assert row["cached"] == 12 and row["to_request"] == 0 and row["final_errors"] == {"403": 1, "404": 2}
    assert "note: d: 3 of the cached are final errors (HTTP 403: 1, HTTP 404: 2)" in format_plan(p)
    assert "`eagledata retry d --config my.yaml` requests them again" in format_plan(p, "my.yaml")
    assert "`eagledata retry d` requests them again" in format_plan(p, "config/config.yaml")
    retry_final_errors(cfg["cache_dir"], "d", [404])
    row = plan(cfg)["datasets"][0]
    assert row["cached"] == 10 and row["to_request"] == 2 and row["final_errors"] == {"403": 1}


def test_the_plan_counts_a_later_turns_final_error_of_a_turns_all_dataset(tmp_path, k25, monkeypatch):
    """``turns: all``: a conversation that ended on a final error at turn 1 (turn 0 answered) is a
    cached final error the plan names, and after ``eagledata retry`` that turn, and the turn after it,
    are requested (the earlier turn's answer is not)."""
    from eagledata.generate.plan import plan_dataset
    from eagledata.standin.faults import Fault

    monkeypatch.setenv("OPENROUTER_API_KEY", API_KEY)
    tok, fam = k25
    convs = [{"id": c, "messages": [{"role": "user", "content": f"{c}: question 0?"},
                                    {"role": "assistant", "content": "original answer 0"},
                                    {"role": "user", "content": f"{c}: question 1?"},
                                    {"role": "assistant", "content": "original answer 1"},
                                    {"role": "user", "content": f"{c}: question 2?"}]} for c in ("a", "b")]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(c) + "\n" for c in convs))
    failing = {"on": True}

    def faults(n, body):
        if failing["on"] and body["messages"][-1]["content"] == "a: question 1?":
            return Fault.http(404, message="No endpoints found matching your data policy")
        return None

    sim = SimulatorServer(tok, fam, seed=2, faults=faults).start()
    try:
        cfg = make_config(tmp_path, prompts, str(tok.source), api_base=sim.base_url, concurrency=1)
        cfg["datasets"]["d"]["turns"] = "all"
        out = tmp_path / "out.jsonl"
        generate_dataset(cfg, "d", out, log=quiet)
        assert [(r["id"], r["status"]) for r in read_jsonl(out)] == [
            ("a#t0", 200), ("a#t1", 404), ("b#t0", 200), ("b#t1", 200), ("b#t2", 200)]
        row = plan_dataset(cfg, "d")
        assert (row["cached"], row["to_request"], row["final_errors"]) == (5, 0, {"404": 1})
        failing["on"] = False
        assert retry_final_errors(cfg["cache_dir"], "d") == {"404": 1}
        row = plan_dataset(cfg, "d")
        assert (row["cached"], row["to_request"], row["final_errors"]) == (4, 2, {})
        before = sim.requests_total
        assert generate_dataset(cfg, "d", out, log=quiet)["requested"] == 2 and sim.requests_total - before == 2
        assert all(r["status"] == 200 for r in read_jsonl(out)) and len(read_jsonl(out)) == 6
    finally:
        sim.stop()


def test_a_failed_write_leaves_no_error_forgotten_without_its_note(setup, tmp_path, monkeypatch):
    """The note makes Snakemake rerun the job; a final error forgotten without it would never be asked
    again (a second ``eagledata retry`` finds nothing left to forget): the note is written first, and a
    write that fails (a full disk) is a :class:`RetryFailed` saying what happened, not a traceback."""
    import errno

    from eagledata.generate import retryfinal
    from eagledata.generate.retryfinal import RetryFailed

    sim, cfg = setup(faults={2: "404", 5: "404"}, concurrency=1)
    generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    data = (tmp_path / "cache/d/responses.jsonl").read_bytes()

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:  # the note cannot be written: nothing is forgotten
        m.setattr(retryfinal, "atomic_write_json", full)
        with pytest.raises(RetryFailed, match="No space left on device.*nothing was forgotten"):
            retry_final_errors(cfg["cache_dir"], "d")
    assert (tmp_path / "cache/d/responses.jsonl").read_bytes() == data
    writes = {"n": 0}
    real = ResponseCache._write_some

    def second_fails(self, fd, view):
        writes["n"] += 1
        if writes["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, fd, view)

    with monkeypatch.context() as m:  # the second marker fails: the first error is forgotten, with its note
        m.setattr(ResponseCache, "_write_some", second_fails)
        with pytest.raises(RetryFailed, match=r"1 of 2 final error\(s\) forgotten.*run eagledata retry d again"):
            retry_final_errors(cfg["cache_dir"], "d")
    assert retry_note_path(cfg["cache_dir"], "d").exists()
    data = (tmp_path / "cache/d/responses.jsonl").read_bytes()
    with monkeypatch.context() as m:  # an fsync fails: the marker it cannot vouch for is cut off again
        m.setattr(ResponseCache, "_fsync", lambda self, fd: full())
        with pytest.raises(RetryFailed, match=r"0 of 1 final error\(s\) forgotten, then .*fsync failed"):
            retry_final_errors(cfg["cache_dir"], "d")
    assert (tmp_path / "cache/d/responses.jsonl").read_bytes() == data
    assert retry_final_errors(cfg["cache_dir"], "d") == {"404": 1}  # the other one
    before = sim.requests_total
    generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    assert sim.requests_total - before == 2


def test_errors_requested_again_on_purpose_do_not_stop_the_job(setup, tmp_path):
    """A retry run requests only errors, those that failed before: the prompts' own final errors among
    them (an upstream 400 that OpenRouter words "Provider returned error" for every prompt) are not a
    setting gone wrong, so the job does not stop on them and the errors fixed meanwhile are answered."""
    from eagledata.standin.faults import Fault

    policy = {"fixed": False}

    def faults(n, body):
        i = int(body["messages"][-1]["content"].split(":")[0].removeprefix("Prompt q"))
        if 2 <= i <= 7:
            return Fault.http(400, message="Provider returned error")
        if i in (9, 11) and not policy["fixed"]:
            return Fault.http(404, message="No endpoints found matching your data policy")
        return None

    sim, cfg = setup(faults=faults, concurrency=1)
    out = tmp_path / "out.jsonl"
    assert generate_dataset(cfg, "d", out, log=quiet)["final_errors"] == 8  # answers came first: no stop
    policy["fixed"] = True
    assert retry_final_errors(cfg["cache_dir"], "d") == {"400": 6, "404": 2}  # every status, the default
    summary = generate_dataset(cfg, "d", out, log=quiet)
    assert summary["requested"] == 8 and summary["final_errors"] == 6
    assert [r["status"] for r in read_jsonl(out)] == [200, 200] + [400] * 6 + [200] * 4
    # a fresh request's first answers still stop the job when they are all the same final error
    sim, cfg = setup(faults=lambda n, body: Fault.http(400, message="Provider returned error"), concurrency=1)
    cfg["cache_dir"] = str(tmp_path / "cache2")
    with pytest.raises(JobStopped, match="the first 5 answers were all the same final error"):
        generate_dataset(cfg, "d", tmp_path / "out2.jsonl", log=quiet)


def test_a_reader_that_knows_no_markers_keeps_the_final_error(setup, tmp_path):
    """Work directories may share a cache_dir across eagledata versions. A reader from before retry
    markers indexes each line by its ``cache_key`` (the last line of a key is its record) and skips a
    line without one: a marker must be such a line, else that reader takes it for the sample's record
    and writes it out with no status, request nor response."""
    sim, cfg = setup(faults={2: "404"}, concurrency=1)
    generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    assert retry_final_errors(cfg["cache_dir"], "d") == {"404": 1}
    last: dict[str, dict] = {}
    for line in (tmp_path / "cache/d/responses.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "cache_key" in rec:
            last[rec["cache_key"]] = rec
    assert sorted(r["status"] for r in last.values()) == [200] * 11 + [404]
    assert all(r.get("request") and r.get("response_raw") for r in last.values())
    assert cache_of(cfg).records == 11  # this version reads the marker, as before

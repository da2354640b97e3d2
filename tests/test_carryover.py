"""Answers carried over between datasets' caches (eagledata.generate.carryover): a renamed dataset,
generated against the stand-in on loopback, sends no request and pays nothing again."""
from __future__ import annotations

import json

import pytest

from eagledata.generate.carryover import carried_answers
from eagledata.generate.job import generate_dataset
from eagledata.generate.plan import plan_dataset
from eagledata.standin.server import SimulatorServer
from gen_helpers import API_KEY, cache_lines, ledger_rows, make_config, quiet, read_jsonl, write_prompts

K1, K2, K3 = "1" * 64, "2" * 64, "3" * 64


def test_only_a_complete_status_200_line_of_a_wanted_top_level_key_is_carried(tmp_path):
    path = tmp_path / "responses.jsonl"
    lines = [
        # a nested object with a wanted key's spelling: the record's own key is another
        {"cache_key": K3, "status": 200, "request": {"metadata": {"cache_key": K1}}, "response_raw": "{}"},
        # a text holding the spelling: escaped inside the string, never a candidate
        {"cache_key": K3, "status": 200, "request": {"note": f'"cache_key": "{K1}"'}, "response_raw": "{}"},
        {"cache_key": K2, "status": 400, "response_raw": "{\"error\": {}}"},
        {"cache_key": K1, "status": 200, "response_raw": "first"},
        {"cache_key": K1, "status": 200, "response_raw": "second"},
    ]
    torn = json.dumps({"cache_key": K2, "status": 200, "response_raw": "torn"})
    path.write_bytes(("".join(json.dumps(r) + "\n" for r in lines) + torn).encode())
    got = list(carried_answers(path, {K1, K2}))
    assert [(r["cache_key"], r["response_raw"]) for r in got] == [(K1, "first")]


@pytest.fixture
def standin(tmp_path, k25, monkeypatch):
    monkeypatch.setenv("OPENROUTER_API_KEY", API_KEY)
    tok, fam = k25
    sims: list[SimulatorServer] = []

    def start(faults=None):
        sims.append(SimulatorServer(tok, fam, seed=2, faults=faults).start())
        return sims[-1]

    yield start
    for s in sims:
        s.stop()


def renamed(cfg: dict, old: str, new: str, **options) -> dict:
    out = json.loads(json.dumps(cfg))
    out["datasets"] = {new: {**out["datasets"].pop(old), **options}}
    return out


def test_a_renamed_dataset_carries_the_paid_answers_over_and_sends_nothing(standin, tmp_path, k25):
    sim = standin()
    prompts = write_prompts(tmp_path / "prompts.jsonl", 8)
    cfg = make_config(tmp_path, prompts, str(k25[0].source), api_base=sim.base_url)
    first = generate_dataset(cfg, "d", tmp_path / "results/d/responses.jsonl", log=quiet)
    assert first["requested"] == 8 and sim.requests_total == 8
    paid = {r["cache_key"]: r for r in read_jsonl(tmp_path / "results/d/responses.jsonl")}
    reservations = len(ledger_rows(tmp_path))

    cfg2 = renamed(cfg, "d", "d_v2")
    assert plan_dataset(cfg2, "d_v2")["to_request"] == 0  # the dry run knows it too
    logs: list[str] = []
    summary = generate_dataset(cfg2, "d_v2", tmp_path / "results/d_v2/responses.jsonl", log=logs.append)
    assert sim.requests_total == 8 and summary["http_requests"] == 0 and summary["requested"] == 0
    assert summary["carried_over"] == {"d": 8} and summary["cached"] == 8
    assert len(ledger_rows(tmp_path)) == reservations  # nothing reserved, nothing paid
    assert any("8 answer(s) carried over from the cache of dataset 'd'" in m for m in logs)
    out = read_jsonl(tmp_path / "results/d_v2/responses.jsonl")
    assert [r["id"] for r in out] == [f"q{i:03d}" for i in range(8)]
    for r in out:  # the exact bodies received, with where they came from
        assert r["carried_from"] == "d"
        assert (r["request"], r["response_raw"], r["status"]) == (paid[r["cache_key"]]["request"],
                                                                  paid[r["cache_key"]]["response_raw"], 200)
    assert all("ledger_ref" not in r and r["carried_from"] == "d" for r in cache_lines(tmp_path, "d_v2"))
    # once carried they are the new dataset's own: a rerun carries nothing and sends nothing
    again = generate_dataset(cfg2, "d_v2", tmp_path / "results/d_v2/responses.jsonl", log=quiet)
    assert again["carried_over"] == {} and again["cached"] == 8 and sim.requests_total == 8


def test_dedup_off_other_requests_and_final_errors_are_requested_again(standin, tmp_path, k25):
    sim = standin(faults={1: "400"})  # the first request is answered with a final 400
    prompts = write_prompts(tmp_path / "prompts.jsonl", 4, tools_every=0)
    cfg = make_config(tmp_path, prompts, str(k25[0].source), api_base=sim.base_url, concurrency=1)
    assert generate_dataset(cfg, "d", tmp_path / "results/d/responses.jsonl", log=quiet)["final_errors"] == 1
    assert sim.requests_total == 4
    # a final 400 cost nothing and is asked again; the three answers are carried
    s = generate_dataset(renamed(cfg, "d", "e"), "e", tmp_path / "results/e/responses.jsonl", log=quiet)
    assert s["carried_over"] == {"d": 3} and s["requested"] == 1 and sim.requests_total == 5
    # dedup: false asks for the dataset's own answers
    s = generate_dataset(renamed(cfg, "d", "f", dedup=False), "f", tmp_path / "results/f/responses.jsonl", log=quiet)
    assert s["carried_over"] == {} and s["requested"] == 4 and sim.requests_total == 9
    # other output settings are other requests: nothing to carry
    other = renamed(cfg, "d", "g")
    other["generation"]["max_tokens"] = 64
    s = generate_dataset(other, "g", tmp_path / "results/g/responses.jsonl", log=quiet)
    assert s["carried_over"] == {} and s["requested"] == 4


def test_turns_all_conversations_are_carried_turn_after_turn(tmp_path, k25):
    convs = [{"id": "a", "messages": [{"role": "user", "content": "a: first?"}, {"role": "assistant", "content": "x"},
                                      {"role": "user", "content": "a: second?"}, {"role": "assistant", "content": "y"},
                                      {"role": "user", "content": "a: third?"}]},
             {"id": "b", "messages": [{"role": "user", "content": "b: only?"}]}]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(c) + "\n" for c in convs))
    cfg = make_config(tmp_path, prompts, str(k25[0].source), backend="simulator")
    cfg["datasets"]["d"]["turns"] = "all"
    first = generate_dataset(cfg, "d", tmp_path / "results/d/responses.jsonl", log=quiet)
    assert first["requested"] == 4
    s = generate_dataset(renamed(cfg, "d", "e"), "e", tmp_path / "results/e/responses.jsonl", log=quiet)
    assert s["carried_over"] == {"d": 4} and s["requested"] == 0 and s["http_requests"] == 0
    strip = ("carried_from", "started_at", "elapsed_s")
    assert [{k: v for k, v in r.items() if k not in strip} for r in read_jsonl(tmp_path / "results/e/responses.jsonl")] == \
        [{k: v for k, v in r.items() if k not in strip} for r in read_jsonl(tmp_path / "results/d/responses.jsonl")]


@pytest.mark.parametrize("turns", ["last", "all"])
def test_a_full_disk_while_carrying_stops_the_job_before_anything_is_sent(standin, tmp_path, k25, monkeypatch, turns):
    """The carried answers the cache refused go to the rescue file; the job stops, pays nothing and
    the next run, with room again, takes them in and sends nothing."""
    import errno

    from eagledata.generate.cache import ResponseCache
    from eagledata.generate.errors import GenerationError

    monkeypatch.setenv("EAGLEDATA_RESCUE_DIR", str(tmp_path / "rescue"))
    sim = standin()
    convs = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"c{i}: first?"}, {"role": "assistant", "content": "x"},
                                          {"role": "user", "content": f"c{i}: second?"}]} for i in range(3)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(c) + "\n" for c in convs))
    cfg = make_config(tmp_path, prompts, str(k25[0].source), api_base=sim.base_url)
    cfg["datasets"]["d"]["turns"] = turns
    generate_dataset(cfg, "d", tmp_path / "results/d/responses.jsonl", log=quiet)
    paid = sim.requests_total
    real = ResponseCache._write_some

    def disk_full(self, fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ResponseCache, "_write_some", disk_full)
    with pytest.raises(GenerationError, match="nothing was sent"):
        generate_dataset(renamed(cfg, "d", "e"), "e", tmp_path / "results/e/responses.jsonl", log=quiet)
    assert sim.requests_total == paid and list((tmp_path / "rescue").iterdir())
    monkeypatch.setattr(ResponseCache, "_write_some", real)
    s = generate_dataset(renamed(cfg, "d", "e"), "e", tmp_path / "results/e/responses.jsonl", log=quiet)
    assert sim.requests_total == paid and s["http_requests"] == 0
    assert len(read_jsonl(tmp_path / "results/e/responses.jsonl")) == len(read_jsonl(tmp_path / "results/d/responses.jsonl"))


def test_an_unreadable_cache_of_another_dataset_is_skipped_with_a_warning(standin, tmp_path, k25, monkeypatch):
    import builtins

    sim = standin()
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3)
    cfg = make_config(tmp_path, prompts, str(k25[0].source), api_base=sim.base_url)
    generate_dataset(cfg, "d", tmp_path / "results/d/responses.jsonl", log=quiet)
    other = renamed(cfg, "d", "x")
    other["datasets"]["x"]["prompts"] = str(write_prompts(tmp_path / "other.jsonl", 2, prefix="o"))
    unreadable = str(tmp_path / "cache" / "d" / "responses.jsonl")
    real_open = builtins.open

    def refuse(path, *args, **kwargs):  # another user's cache in a shared cache_dir (root reads any file)
        if str(path) == unreadable:
            raise PermissionError(13, "Permission denied", unreadable)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refuse)
    logs: list[str] = []
    assert plan_dataset(other, "x")["to_request"] == 2
    s = generate_dataset(other, "x", tmp_path / "results/x/responses.jsonl", log=logs.append)
    assert s["requested"] == 2 and any(f"{unreadable}: not read for answers to carry over" in m for m in logs)


def test_a_request_claim_dies_with_its_process_kill_9_included(tmp_path):
    """A claim is a lock the kernel drops with its holder: a job killed mid-request never leaves
    another dataset's job waiting for an answer that will not come."""
    import signal
    import subprocess
    import sys
    import time

    from eagledata.generate.carryover import RequestClaims

    ready = tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, pathlib\n"
        "from eagledata.generate.carryover import RequestClaims\n"
        f"c = RequestClaims({str(tmp_path)!r}, 'a')\n"
        f"assert c.try_claim({K1!r})\n"
        f"pathlib.Path({str(ready)!r}).write_text('1')\n"
        "time.sleep(60)\n")])
    try:
        t0 = time.monotonic()
        while not ready.exists():
            assert holder.poll() is None and time.monotonic() - t0 < 30
            time.sleep(0.02)
        mine = RequestClaims(tmp_path, "b")
        assert not mine.try_claim(K1)  # claimed by the other dataset's job
        assert mine.try_claim(K2)  # another request is not
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        assert mine.try_claim(K1)
        mine.close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)


def test_an_answer_another_dataset_cached_after_the_job_looked_is_carried_from_the_tail(tmp_path):
    from eagledata.generate.carryover import RequestClaims

    other = tmp_path / "a" / "responses.jsonl"
    other.parent.mkdir()
    other.write_bytes((json.dumps({"cache_key": K3, "status": 200, "response_raw": "old"}) + "\n").encode())
    claims = RequestClaims(tmp_path, "b")
    claims.watch()
    claims.want([K1, K2], scanned=True)
    assert claims.answer(K1) is None
    with open(other, "ab") as fh:  # the other job's answers arrive: one a final error, one torn
        fh.write((json.dumps({"cache_key": K2, "status": 400, "response_raw": "no"}) + "\n").encode())
        fh.write((json.dumps({"cache_key": K1, "status": 200, "response_raw": "paid", "ledger_ref": "r1"}) + "\n").encode())
        fh.write(json.dumps({"cache_key": K2, "status": 200}).encode())
    name, rec = claims.answer(K1)
    assert (name, rec["response_raw"]) == ("a", "paid")
    assert claims.answer(K2) is None  # not carried: an error, and a line not complete yet
    with open(other, "ab") as fh:
        fh.write(b"\n")
    assert claims.answer(K2)[1]["status"] == 200


def test_a_filesystem_without_record_locks_turns_claims_off_with_a_warning(tmp_path, monkeypatch):
    """Where lockf fails for another reason than a held lock (ENOLCK on some network filesystems), a
    job never waits on a claim it cannot take: claims are off, said once."""
    import errno
    import fcntl

    from eagledata.generate.carryover import RequestClaims

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    warned = []
    claims = RequestClaims(tmp_path, "b", warned.append)
    assert claims.try_claim(K1) and claims.try_claim(K1) and claims.try_claim(K2)
    claims.release(K1)
    claims.close()
    assert len(warned) == 1 and "No locks available" in warned[0] and "may pay an identical request twice" in warned[0]


def test_a_lock_file_the_job_may_not_open_turns_claims_off_instead_of_waiting_forever(tmp_path, monkeypatch):
    """``requests.lock`` created by another user in a shared ``cache_dir`` (mode 0644): opening it for
    writing fails with EACCES, the errno lockf gives for a claim held by another process. That is no
    claim: read as one, every request of the job waited forever."""
    import errno
    import os

    from eagledata.generate.carryover import CLAIMS_NAME, RequestClaims

    real_open = os.open

    def not_permitted(path, *args, **kwargs):
        if str(path).endswith(CLAIMS_NAME):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", not_permitted)
    warned = []
    claims = RequestClaims(tmp_path, "b", warned.append)
    assert claims.try_claim(K1) and claims.try_claim(K2)
    claims.release(K1)
    claims.close()
    assert claims.disabled and len(warned) == 1 and "Permission denied" in warned[0]


def test_answers_written_over_a_torn_tail_that_another_job_cut_off_are_carried(tmp_path):
    """A job killed -9 while writing leaves its cache a torn last line; its rerun cuts the line off and
    appends from there. Another dataset's job that started watching in between must read the tail from
    the end of the last complete line: from the file's size, every answer written over the cut bytes
    was passed over, and its request paid again."""
    from eagledata.generate.cache import ResponseCache
    from eagledata.generate.carryover import RequestClaims

    other = tmp_path / "a" / "responses.jsonl"
    other.parent.mkdir()
    old = (json.dumps({"cache_key": K3, "status": 200, "response_raw": "old"}) + "\n").encode()
    other.write_bytes(old + b'{"cache_key": "' + K2.encode() + b'", "status": 200, "response_raw": "cut sho')
    claims = RequestClaims(tmp_path, "b")
    claims.watch()
    claims.want([K1, K2], scanned=True)
    rerun = ResponseCache(other)  # the killed job's rerun: the torn line cut off, answers appended
    rerun.open()
    rerun.append({"cache_key": K1, "status": 200, "response_raw": "paid once " * 20})
    rerun.append({"cache_key": K2, "status": 200, "response_raw": "paid once too"})
    rerun.close()
    assert claims.answer(K1)[1]["response_raw"] == "paid once " * 20
    assert claims.answer(K2)[1]["response_raw"] == "paid once too"


def test_claims_taken_before_claims_turned_off_are_still_given_up(tmp_path, monkeypatch):
    """Record locks failing midway (ENOLCK: a lock table full on a network filesystem) turn claims off;
    the claims the job took before are still released after their request, not held until the job
    ends with other datasets' jobs waiting on them."""
    import errno
    import fcntl
    import subprocess
    import sys

    from eagledata.generate.carryover import RequestClaims

    real_lockf = fcntl.lockf

    def no_more_locks(fd, cmd, *args):
        if cmd & fcntl.LOCK_EX:
            raise OSError(errno.ENOLCK, "No locks available")
        return real_lockf(fd, cmd, *args)

    claims = RequestClaims(tmp_path, "b", lambda m: None)
    assert claims.try_claim(K1)
    monkeypatch.setattr(fcntl, "lockf", no_more_locks)
    assert claims.try_claim(K2) and claims.disabled
    claims.release(K1)
    other = subprocess.run([sys.executable, "-c", (
        "from eagledata.generate.carryover import RequestClaims\n"
        f"print(RequestClaims({str(tmp_path)!r}, 'a').try_claim({K1!r}))\n")], capture_output=True, text=True, timeout=60)
    claims.close()
    assert other.stdout.strip() == "True", other.stderr


def test_a_cache_replaced_under_the_tail_being_watched_is_read_again_from_its_start(tmp_path):
    """Another dataset's cache cut back (a failed fsync) or deleted and written anew while a job
    watches it: where the job stopped reading is no longer a line's start, and reading on from there
    passed over every answer written before it (their requests paid again)."""
    from eagledata.generate.carryover import RequestClaims

    other = tmp_path / "a" / "responses.jsonl"
    other.parent.mkdir()
    other.write_bytes((json.dumps({"cache_key": K3, "status": 200, "response_raw": "x" * 300}) + "\n").encode())
    claims = RequestClaims(tmp_path, "b")
    claims.watch()
    claims.want([K1, K2], scanned=True)
    other.write_bytes((json.dumps({"cache_key": K1, "status": 200, "response_raw": "new"}) + "\n"
                       + json.dumps({"cache_key": K2, "status": 200, "response_raw": "y" * 600}) + "\n").encode())
    assert claims.answer(K1)[1]["response_raw"] == "new"
    assert claims.answer(K2)[1]["response_raw"] == "y" * 600


def test_a_dedup_dataset_waits_for_the_requests_a_dedup_off_job_is_sending_and_carries_them(tmp_path, k25, monkeypatch):
    """A ``dedup: false`` dataset pays for its own answers, but claims what it sends: a dedup dataset
    generated at once (another process) waits for those answers and carries them over (before, it sent
    all 12 again: 24 paid)."""
    import time

    from gen_helpers import generate_cmd, spawn

    monkeypatch.setenv("OPENROUTER_API_KEY", API_KEY)
    tok, fam = k25
    prompts = write_prompts(tmp_path / "prompts.jsonl", 12)
    with SimulatorServer(tok, fam, seed=2, latency_ms=2500) as sim:
        cfg = make_config(tmp_path, prompts, str(tok.source), api_base=sim.base_url, concurrency=12)
        own = spawn(generate_cmd(renamed(cfg, "d", "b", dedup=False), tmp_path, "b", name="cfg-b"), tmp_path / "b.log")
        t0 = time.monotonic()
        while sim.requests_total < 12:  # every request of b in flight
            assert own.poll() is None and time.monotonic() - t0 < 60, (tmp_path / "b.log").read_text()[-2000:]
            time.sleep(0.01)
        s = generate_dataset(renamed(cfg, "d", "a"), "a", tmp_path / "results/a/responses.jsonl", log=quiet)
        assert own.wait(60) == 0, (tmp_path / "b.log").read_text()[-2000:]
        assert sim.requests_total == 12
    assert s["carried_over"] == {"b": 12} and s["http_requests"] == 0 and s["requested"] == 0
    b = json.loads((tmp_path / "cache/b/generation_summary.json").read_text())
    assert b["http_requests"] == 12 and b["carried_over"] == {}

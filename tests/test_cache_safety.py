"""Attacks on the paid-response cache from outside the job: two work directories sharing one
``cache_dir``, a second writer while one holds the cache, a torn last line under readers, a full disk
(an injected ENOSPC on the cache and on the ledger, and a real tmpfs), and a kill -9 loop against the
stand-in in its own process. The stand-in's ``GET /_sim/counters`` proves each prompt was paid once."""
from __future__ import annotations

import asyncio
import errno
import json
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eagledata.generate.budget import BudgetLedger
from eagledata.generate.cachelock import acquire_writer_lock
from eagledata.config import validate_config
from eagledata.generate.cache import ResponseCache
from eagledata.generate.errors import GenerationError, JobStopped
from eagledata.generate.job import generate_dataset
from eagledata.generate.plan import plan_dataset
from eagledata.standin.server import SimulatorServer, prompt_hash
from gen_helpers import (API_KEY, StandInProcess, cache_lines, generate_cmd, ledger_counted, ledger_rows, make_config,
                         quiet, read_jsonl, spawn, write_prompts)


pytestmark = pytest.mark.timing  # runs alone under xdist (tests/conftest.py)


ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv("OPENROUTER_API_KEY", API_KEY)
    return API_KEY


@pytest.fixture
def stand_in_process(k25, tmp_path):
    started: list[StandInProcess] = []

    def make(**kw) -> StandInProcess:
        started.append(StandInProcess(k25[0].source, tmp_path, **kw))
        return started[-1]

    yield make
    for s in started:
        s.stop()


@pytest.fixture
def stand_in(k25):
    started: list[SimulatorServer] = []

    def make(**kw) -> SimulatorServer:
        started.append(SimulatorServer(*k25, seed=2, **kw).start())
        return started[-1]

    yield make
    for s in started:
        s.stop()


def hashes(records) -> set[str]:
    return {prompt_hash(r["request"]) for r in records}


def assert_clean_lines(path: Path) -> None:
    """Every line of the file is one complete JSON record (nothing torn or interleaved)."""
    lines = path.read_bytes().splitlines(keepends=True)
    assert all(line.endswith(b"\n") and json.loads(line)["cache_key"] for line in lines)


# --------------------------------------------------------------------------------------------
# the stand-in's counters, one writer per cache, readers and torn lines


def test_stand_in_counters_endpoint_counts_requests_per_prompt_and_billing(stand_in_process, k25, tmp_path, key):
    sim = stand_in_process()
    cfg = make_config(tmp_path, write_prompts(tmp_path / "p.jsonl", 5), k25[0].source, api_base=sim.base_url)
    generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    counters, records = sim.counters(), cache_lines(tmp_path)
    assert counters["requests_total"] == 5 and counters["generations"] == 5
    assert counters["requests_per_prompt"] == {h: 1 for h in hashes(records)}
    assert counters["billed_usd"] == pytest.approx(sum(r["cost"] for r in records), abs=1e-9)
    assert counters["keys"] == 1 and API_KEY not in json.dumps(counters)


def test_two_work_directories_sharing_a_cache_pay_each_prompt_once(stand_in_process, k25, tmp_path):
    """Two generate jobs of the same prompts, started together from two work directories with one
    cache_dir: the second waits for the first (saying who holds the cache), then requests nothing."""
    sim = stand_in_process(latency_ms=150)
    prompts = write_prompts(tmp_path / "p.jsonl", 24)
    jobs = []
    for name in ("a", "b"):
        work = tmp_path / name
        work.mkdir()
        cfg = make_config(work, prompts, k25[0].source, api_base=sim.base_url, concurrency=4)
        cfg["cache_dir"] = str(tmp_path / "shared-cache")
        jobs.append((work, generate_cmd(cfg, work)))
    procs = [spawn(cmd, work / "generate.log", cwd=work) for work, cmd in jobs]
    assert [p.wait(60) for p in procs] == [0, 0], [(w / "generate.log").read_text() for w, _ in jobs]
    counters = sim.counters()
    assert counters["requests_total"] == 24 and len(counters["requests_per_prompt"]) == 24
    assert set(counters["requests_per_prompt"].values()) == {1}
    outputs = [read_jsonl(work / "results" / "d" / "responses.jsonl") for work, _ in jobs]
    assert [r["response_raw"] for r in outputs[0]] == [r["response_raw"] for r in outputs[1]] and len(outputs[0]) == 24
    cache = tmp_path / "shared-cache" / "d" / "responses.jsonl"
    assert_clean_lines(cache) and len(cache.read_bytes().splitlines()) == 24
    logs = [(work / "generate.log").read_text() for work, _ in jobs]
    waited = [i for i, text in enumerate(logs) if "waiting for the cache lock" in text]
    assert len(waited) == 1, logs
    holder = 1 - waited[0]
    assert f"pid {procs[holder].pid} on host {socket.gethostname()} (work directory {jobs[holder][0]}" in logs[waited[0]]
    assert "0 to request" in logs[waited[0]] or "24 cached" in logs[waited[0]]


HOLDER = """
import asyncio, sys, time
from eagledata.generate.cachelock import acquire_writer_lock
lock = asyncio.run(acquire_writer_lock(sys.argv[1], "d", 5, print))
print("held", flush=True)
time.sleep(120)
"""


def test_second_writer_gives_up_naming_the_holder_and_kill_9_frees_the_lock(stand_in, k25, tmp_path, key, monkeypatch):
    sim = stand_in()
    cfg = make_config(tmp_path, write_prompts(tmp_path / "p.jsonl", 4), k25[0].source, api_base=sim.base_url)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "cache")], stdout=subprocess.PIPE,
                              text=True, cwd=tmp_path)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv("EAGLEDATA_CACHE_LOCK_WAIT_S", "1")
        logs: list[str] = []
        with pytest.raises(GenerationError) as exc:
            generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=logs.append)
        who = f"pid {holder.pid} on host {socket.gethostname()} (work directory {tmp_path}"
        assert who in str(exc.value) and "still being written by another job" in str(exc.value)
        assert any("waiting for the cache lock" in m and who in m for m in logs), logs
        assert sim.requests_total == 0 and not (tmp_path / "cache" / "d" / "responses.jsonl").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    assert generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)["requested"] == 4  # the kernel freed it


def test_readers_tolerate_a_torn_last_line_while_the_writer_holds_the_cache(stand_in, k25, tmp_path, key):
    sim = stand_in()
    cfg = make_config(tmp_path, write_prompts(tmp_path / "p.jsonl", 6), k25[0].source, api_base=sim.base_url)
    generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    path = tmp_path / "cache" / "d" / "responses.jsonl"
    last = path.read_bytes().splitlines(keepends=True)[-1]
    write_prompts(tmp_path / "p.jsonl", 8)  # two more prompts

    async def read_while_held() -> None:
        lock = await acquire_writer_lock(tmp_path / "cache", "d", 5, quiet)  # a writer, mid-write:
        with open(path, "ab") as fh:
            fh.write(last[: len(last) // 2])
        before = path.read_bytes()
        cache = ResponseCache(path)
        assert len(cache.load()) == 6 and cache.skipped_lines == 0
        plan = plan_dataset(validate_config(dict(cfg)), "d")
        assert (plan["cached"], plan["to_request"]) == (6, 2)
        assert path.read_bytes() == before  # readers never cut the writer's file
        lock.release()

    asyncio.run(read_while_held())
    summary = generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    assert (summary["cached"], summary["requested"]) == (6, 2) and sim.requests_total == 8
    assert_clean_lines(path)


# --------------------------------------------------------------------------------------------
# a full disk: injected ENOSPC on the cache and on the ledger


class FullDisk:
    """Injected ENOSPC in :class:`ResponseCache`'s writes (``kind="write"``: the first failing
    write is torn, half of it written) or fsyncs, once ``after`` records were written, until
    :meth:`free` (called by a timer ``free_after`` s later when given)."""

    def __init__(self, monkeypatch, kind: str, after: int, free_after: float | None = None):
        self.kind, self.after, self.free_after = kind, after, free_after
        self.writes = 0
        self.full = self.torn = False
        self.failures = 0
        real_write, real_fsync = ResponseCache._write_some, ResponseCache._fsync

        def write_some(cache, fd, data):
            if self.full and kind == "write":
                self.failures += 1
                if not self.torn:
                    self.torn = True
                    return real_write(cache, fd, data[: max(1, len(data) // 2)])
                raise ENOSPC
            n = real_write(cache, fd, data)
            self.writes += 1
            if self.writes == after and not self.full:
                self.fill()
            return n

        def fsync(cache, fd):
            if self.full and kind == "fsync":
                self.failures += 1
                raise ENOSPC
            real_fsync(cache, fd)

        monkeypatch.setattr(ResponseCache, "_write_some", write_some)
        monkeypatch.setattr(ResponseCache, "_fsync", fsync)

    def fill(self) -> None:
        self.full = True
        if self.free_after is not None:
            threading.Timer(self.free_after, self.free).start()

    def free(self) -> None:
        self.full = False
        self.after = -1  # never again


@pytest.mark.parametrize("kind", ["write", "fsync"])
@pytest.mark.parametrize("space_returns", [True, False])
def test_injected_enospc_loses_no_paid_answer(stand_in, k25, tmp_path, key, monkeypatch, kind, space_returns):
    monkeypatch.setenv("EAGLEDATA_RESCUE_DIR", str(tmp_path / "rescue"))
    sim = stand_in(latency_ms=40)
    cfg = make_config(tmp_path, write_prompts(tmp_path / "p.jsonl", 16), k25[0].source, api_base=sim.base_url,
                      concurrency=4, drain_timeout_s=3 if space_returns else 0.3)
    monkeypatch.setattr("eagledata.generate.cache.FSYNC_INTERVAL_S", 0.0)  # a background fsync after every record
    disk = FullDisk(monkeypatch, kind, after=5, free_after=0.4 if space_returns else None)
    path = tmp_path / "cache" / "d" / "responses.jsonl"
    logs: list[str] = []
    with pytest.raises(JobStopped) as exc:
        generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=logs.append)
    msg = str(exc.value)
    assert f"cache write failed: {path}: {kind} failed: No space left on device (" in msg and "bytes free" in msg
    assert disk.failures >= 1
    received = set(sim.request_counts)
    assert 5 <= len(received) < 16 and set(sim.request_counts.values()) == {1}
    rescued = [json.loads(line) for f in (tmp_path / "rescue").glob("*.jsonl") for line in f.read_bytes().splitlines()]
    assert_clean_lines(path)
    assert hashes(cache_lines(tmp_path)) | hashes(rescued) == received  # not one paid answer lost
    if space_returns:
        assert not rescued and hashes(cache_lines(tmp_path)) == received and "space came back" in msg
    else:
        assert rescued and str(next((tmp_path / "rescue").glob("*.jsonl"))) in msg
    disk.free()
    summary = generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=logs.append)
    assert set(sim.request_counts.values()) == {1} and len(sim.request_counts) == 16  # none paid twice
    assert summary["requested"] == 16 - len(received) and len(read_jsonl(tmp_path / "out.jsonl")) == 16
    assert not list((tmp_path / "rescue").glob("*.jsonl"))
    assert space_returns or any(m.startswith(f"imported {len(rescued)} paid answer(s) from") for m in logs)
    assert ledger_counted(tmp_path) >= sim.billed_usd - 1e-9


def test_a_failed_ledger_write_stops_new_requests_and_keeps_the_answers(stand_in, k25, tmp_path, key, monkeypatch):
    sim = stand_in(latency_ms=40)
    cfg = make_config(tmp_path, write_prompts(tmp_path / "p.jsonl", 16), k25[0].source, api_base=sim.base_url,
                      concurrency=4)
    real_apply, disk = BudgetLedger._apply, {"transactions": 0, "full": False}

    def apply(ledger, reserves, updates):  # SQLite on a full disk: the 7th transaction on fail
        disk["transactions"] += 1
        disk["full"] = disk["full"] or disk["transactions"] == 7
        if disk["full"]:
            raise sqlite3.OperationalError("database or disk is full")
        return real_apply(ledger, reserves, updates)

    monkeypatch.setattr(BudgetLedger, "_apply", apply)
    with pytest.raises(JobStopped) as exc:
        generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    msg = str(exc.value)
    assert f"budget ledger write failed: {tmp_path / 'cache' / 'budget.sqlite'}: database or disk is full (" in msg
    assert "bytes free" in msg
    received = set(sim.request_counts)
    assert 1 <= len(received) < 16 and hashes(cache_lines(tmp_path)) == received  # every answer in flight kept
    disk.update(full=False, transactions=-10**9)  # space is back
    generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    assert set(sim.request_counts.values()) == {1} and len(sim.request_counts) == 16
    assert ledger_counted(tmp_path) >= sim.billed_usd - 1e-9


# --------------------------------------------------------------------------------------------
# a full disk for real: a small tmpfs in a user + mount namespace


FILL_DRIVER = r"""
import json, os, shutil, subprocess, sys, time
mnt, out, cmd = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt], check=True)
cache = os.path.join(mnt, "cache", "d", "responses.jsonl")
def lines():
    try:
        with open(cache, "rb") as fh:
            return fh.read().count(b"\n")
    except OSError:
        return 0
job = subprocess.Popen(cmd, stdout=open(os.path.join(out, "run1.log"), "wb"), stderr=subprocess.STDOUT)
t0 = time.monotonic()
while lines() < 5 and job.poll() is None and time.monotonic() - t0 < 60:
    time.sleep(0.005)
fd = os.open(os.path.join(mnt, "filler"), os.O_WRONLY | os.O_CREAT)
try:
    while True:
        os.write(fd, b"\0" * 4096)
except OSError:
    pass
os.close(fd)
free_when_full = shutil.disk_usage(mnt).free
rc1 = job.wait(120)
kept_in_cache = lines()
os.unlink(os.path.join(mnt, "filler"))
rc2 = subprocess.run(cmd, stdout=open(os.path.join(out, "run2.log"), "wb"), stderr=subprocess.STDOUT).returncode
shutil.copytree(os.path.join(mnt, "cache"), os.path.join(out, "cache"))
print(json.dumps({"rc1": rc1, "rc2": rc2, "free_when_full": free_when_full, "kept_in_cache": kept_in_cache}))
"""


def tmpfs_unavailable(probe: Path) -> str | None:
    """Why this test cannot mount a tmpfs (None when it can)."""
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux) to mount a small tmpfs in a user + mount namespace"
    probe.mkdir()
    r = subprocess.run(["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"cannot mount a tmpfs in a user + mount namespace here (unshare -rm: {r.stderr.strip() or r.returncode})"
    return None


def test_full_tmpfs_loses_no_paid_answer(stand_in_process, k25, tmp_path):
    """The cache (and the ledger) on a real 1 MB tmpfs that fills up mid-run: the job stops, every
    answer it was paid for is in the cache or in the rescue file on another filesystem, and the run
    after space is freed imports them and requests each prompt once."""
    reason = tmpfs_unavailable(tmp_path / "probe")
    if reason:
        pytest.skip(reason)
    sim = stand_in_process(latency_ms=60)
    mnt, out, rescue = tmp_path / "mnt", tmp_path / "out", tmp_path / "rescue"
    mnt.mkdir()
    out.mkdir()
    cfg = make_config(mnt, write_prompts(tmp_path / "p.jsonl", 40), k25[0].source, api_base=sim.base_url,
                      concurrency=4, drain_timeout_s=0.5)
    cfg["results_dir"] = str(out / "results")
    cmd = generate_cmd(cfg, tmp_path)
    cmd[cmd.index("--output") + 1] = str(out / "responses.jsonl")
    env = {**os.environ, "OPENROUTER_API_KEY": API_KEY, "EAGLEDATA_RESCUE_DIR": str(rescue)}
    r = subprocess.run(["unshare", "-rm", sys.executable, "-c", FILL_DRIVER, str(mnt), str(out), json.dumps(cmd)],
                       capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.splitlines()[-1])
    run1 = (out / "run1.log").read_text()
    assert result["rc1"] == 1 and result["rc2"] == 0, run1 + (out / "run2.log").read_text()
    assert "write failed: " in run1 and "bytes free" in run1 and str(mnt) in run1
    counters = sim.counters()
    assert counters["requests_total"] == 40 and set(counters["requests_per_prompt"].values()) == {1}  # none paid twice
    assert len(read_jsonl(out / "responses.jsonl")) == 40 and not list(rescue.glob("*.jsonl"))
    assert ledger_counted(out) >= counters["billed_usd"] - 1e-9


# --------------------------------------------------------------------------------------------
# kill -9 loop


def _kill_at_a_random_moment(cmd: list[str], tmp: Path, rng: random.Random, log: Path) -> bool:
    """Run the generate job and SIGKILL it once the cache grew by 0-6 records plus 0-150 ms;
    False when it finished first."""
    proc = spawn(cmd, log)
    target, t0 = len(cache_lines(tmp)) + rng.randint(0, 6), time.monotonic()
    while len(cache_lines(tmp)) < target and proc.poll() is None and time.monotonic() - t0 < 20:
        time.sleep(0.005)
    time.sleep(rng.uniform(0, 0.15))
    if proc.poll() is not None:
        assert proc.returncode == 0, log.read_text()
        return False
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL
    return True


@pytest.mark.slow
def test_kill_9_loop_never_requests_a_cached_prompt_again(stand_in_process, k25, tmp_path):
    """The generate job against the stand-in (own process, 50-200 ms latency), SIGKILLed at 12
    random moments and restarted: no prompt is requested after its answer was cached, each prompt at
    most once more per kill that caught it in flight, and the ledger never counts less than the
    stand-in billed (checked after every kill and at the end)."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng, t_start = random.Random(seed), time.monotonic()
    sim = stand_in_process(latency_ms=50, jitter_ms=150)
    n = 120
    cfg = make_config(tmp_path, write_prompts(tmp_path / "p.jsonl", n), k25[0].source, api_base=sim.base_url,
                      concurrency=6)
    cmd = generate_cmd(cfg, tmp_path)
    kills: list[tuple[dict[str, int], set[str]]] = []
    while len(kills) < 12 and time.monotonic() - t_start < 40:
        if not _kill_at_a_random_moment(cmd, tmp_path, rng, tmp_path / f"run{len(kills)}.log"):
            break
        time.sleep(0.05)  # requests already on the wire reach the stand-in's counters
        counters = sim.counters()
        assert ledger_counted(tmp_path) >= counters["billed_usd"] - 1e-9, f"seed {seed}"
        kills.append((counters["requests_per_prompt"], hashes(cache_lines(tmp_path))))
    assert len(kills) >= 10, f"seed {seed}: only {len(kills)} kills before the job finished"
    proc = spawn(cmd, tmp_path / "final.log")
    assert proc.wait(60) == 0, (tmp_path / "final.log").read_text()
    final = sim.counters()["requests_per_prompt"]
    assert len(final) == n and len(read_jsonl(tmp_path / "results" / "d" / "responses.jsonl")) == n
    in_flight: dict[str, int] = {}
    before: dict[str, int] = {}
    for counts, cached in kills:
        for h in cached:  # cached before this kill: never requested after it
            assert final[h] == counts[h], f"seed {seed}: {h} requested again after it was cached"
        for h, c in counts.items():
            if h not in cached and c > before.get(h, 0):
                in_flight[h] = in_flight.get(h, 0) + 1
        before = counts
    assert all(final[h] <= 1 + in_flight.get(h, 0) for h in final), f"seed {seed}"
    rows = ledger_rows(tmp_path)
    assert not [r for r in rows if r[0] == "reserved"] and not [r for r in rows if r[0] == "orphaned" and r[3]]
    counted, billed = ledger_counted(tmp_path), sim.counters()["billed_usd"]
    assert counted >= billed - 1e-9, f"seed {seed}"
    print(f"kill -9 loop (seed {seed}): {len(kills)} kills, {sum(final.values())} requests for {n} prompts, "
          f"{sum(c > 1 for c in final.values())} requested again (max {max(final.values())}; "
          f"{sum(in_flight.values())} in flight at a kill), ledger ${counted:.6f} vs billed ${billed:.6f}")
    assert time.monotonic() - t_start < 60

"""Warm workers for the per-shard token jobs (eagledata.tokens.warmjobs), with real snakemake runs:
a job run in a worker writes the bytes its own process writes; workers end when idle, with a job whose
process ends first, and a job whose worker ends first runs in its own process."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_pershard_tokens import K2, _import_config, _records, _write, needs_recorded
from workflow_runs import copy_repo, snakemake

WARM = re.compile(r"run in warm worker (\d+) \(slot (\d+), its job (\d+)\)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in fh)
    except OSError:
        return False


def _wait_until(what, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if what():
            return True
        time.sleep(0.05)
    return what()


def _waiting_on_a_socket(job: subprocess.Popen) -> bool:
    """Whether the job's process has a socket open (it then connects and sends its request at once)."""
    fds = f"/proc/{job.pid}/fd"
    try:
        return any(os.readlink(f"{fds}/{fd}").startswith("socket:") for fd in os.listdir(fds))
    except OSError:
        return False


def _job_command(work: Path, key: str) -> list[str]:
    stamp = next(work.glob("results/_code/datasets/rec/tokens.*.sha256")).relative_to(work)
    w = "results/rec/tokens.work"
    return [sys.executable, "scripts/token_shard.py", "--slice", f"{w}/slices/{key}.tsv", "--stamp", str(stamp),
            "--part", f"{w}/parts/{key}.parquet", "--summary", f"{w}/parts/{key}.summary.json",
            "--log", f"logs/rec/token_shard/{key}.log"]


@needs_recorded
@pytest.mark.workflow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="warm workers are Linux only")
def test_shard_jobs_in_warm_workers_write_what_their_own_processes_write(tmp_path):
    """80 recorded responses in shards of 10, with 2 cores: every job run in its own process
    (EAGLEDATA_WARM_WORKERS=0), then every job again in warm workers (at most one per core, most
    running several jobs): the parts, summaries and final shards are the same bytes, every job logs
    its peak memory, and the workers end once idle. A worker whose job's process is killed ends
    without writing the part; a job whose worker is killed runs in its own process and writes it."""
    work = copy_repo(tmp_path / "w")
    src = tmp_path / "responses.jsonl"
    _write(src, _records(80))
    _import_config(work, src, K2)
    snakemake(work, "rec", env={"EAGLEDATA_WARM_WORKERS": "0"})
    parts = work / "results/rec/tokens.work/parts"
    own = {p.name: p.read_bytes() for p in parts.iterdir()}
    store = work / "results/rec/tokens.store"
    stored = sorted(p.name for p in store.glob("*.parquet"))
    logs = sorted((work / "logs/rec/token_shard").glob("*.log"))
    assert len(logs) >= 6 and all("run in its own process: EAGLEDATA_WARM_WORKERS=0" in p.read_text() for p in logs)

    for p in logs:
        p.unlink()
    for p in store.glob("*.parquet"):
        p.unlink()
    snakemake(work, "rec", "--forcerun", "token_shard", env={"EAGLEDATA_WARM_IDLE_S": "4"})
    assert {p.name: p.read_bytes() for p in parts.iterdir()} == own
    assert sorted(p.name for p in store.glob("*.parquet")) == stored
    texts = {p.stem: p.read_text() for p in logs}
    runs = {k: [tuple(map(int, m)) for m in WARM.findall(t)] for k, t in texts.items()}
    assert all(len(r) == 1 for r in runs.values()), texts
    assert all(re.search(r"peak memory \d+ MB", t) and "run in its own process" not in t for t in texts.values())
    workers = {r[0][0] for r in runs.values()}
    assert 1 <= len(workers) <= 2 and max(r[0][2] for r in runs.values()) > 1, runs
    assert _wait_until(lambda: not any(map(_alive, workers)), 15), "the workers did not end once idle"
    env = {**os.environ, "PYTHONPATH": str(work / "src"), "EAGLEDATA_WARM_IDLE_S": "30"}
    stamp = _job_command(work, "k")[5]
    where = subprocess.run([sys.executable, "-c", "from eagledata.tokens import warmjobs as w; "
                            f"print(w.private_dir(), w.worker_key({stamp!r}))"], cwd=work, env=env, text=True,
                           capture_output=True, check=True).stdout.split()
    assert not list(Path(where[0]).glob(f"{where[1]}-*")), "an idle worker left its slot's files"

    # a job whose process ends before its job does ends its worker, which writes nothing
    key = sorted(texts)[0]
    subprocess.run(_job_command(work, key), cwd=work, env=env, check=True)  # starts slot 0's worker
    worker = int(WARM.findall((work / f"logs/rec/token_shard/{key}.log").read_text())[-1][0])
    assert _alive(worker)
    (parts / f"{key}.parquet").unlink()
    os.kill(worker, signal.SIGSTOP)  # the job's request waits in the worker's socket
    job = subprocess.Popen(_job_command(work, key), cwd=work, env=env)
    assert _wait_until(lambda: _waiting_on_a_socket(job), 30)
    time.sleep(0.5)
    job.kill()
    job.wait()
    os.kill(worker, signal.SIGCONT)
    assert _wait_until(lambda: not _alive(worker), 10), "the worker outlived its job's process"
    assert not (parts / f"{key}.parquet").exists()

    # a job whose worker ends first runs in its own process
    subprocess.run(_job_command(work, key), cwd=work, env=env, check=True)  # a new worker for slot 0
    worker = int(WARM.findall((work / f"logs/rec/token_shard/{key}.log").read_text())[-1][0])
    (parts / f"{key}.parquet").unlink()
    os.kill(worker, signal.SIGSTOP)
    job = subprocess.Popen(_job_command(work, key), cwd=work, env=env)
    assert _wait_until(lambda: _waiting_on_a_socket(job), 30)
    time.sleep(0.5)
    os.kill(worker, signal.SIGKILL)
    assert job.wait(timeout=60) == 0
    assert (parts / f"{key}.parquet").read_bytes() == own[f"{key}.parquet"]
    assert "run in its own process: the warm worker ended before the job did" in \
        (work / f"logs/rec/token_shard/{key}.log").read_text()


def test_installing_a_library_changes_the_workers_jobs_go_to(tmp_path, monkeypatch):
    """A library installed, upgraded or removed (an entry added to or removed from site-packages) gives
    new worker keys: a worker that loaded the old libraries gets no more jobs."""
    from eagledata.tokens import warmjobs

    site = tmp_path / "lib" / "site-packages"
    site.mkdir(parents=True)
    os.utime(site, ns=(1_000_000_000, 1_000_000_000))
    monkeypatch.setattr(sys, "path", [*sys.path, str(site)])
    stamp = str(tmp_path / "tokens.stamp")
    before = warmjobs.worker_key(stamp)
    assert warmjobs.worker_key(stamp) == before  # nothing changed: the same workers
    (site / "polars-9.9.dist-info").mkdir()  # the directory's time is now, not 1970's
    installed = warmjobs.worker_key(stamp)
    assert installed != before
    os.utime(site, ns=(1_000_000_000, 1_000_000_000))
    (site / "polars-9.9.dist-info").rmdir()
    assert warmjobs.worker_key(stamp) not in (before, installed)



def test_a_job_reads_its_arguments_in_any_order_and_refuses_any_other(capsys):
    from eagledata.tokens.warmjobs import JOB_FIELDS, job_arguments

    job = {name: f"/w/{name} with space.x" for name in JOB_FIELDS}
    argv = [a for name in reversed(JOB_FIELDS) for a in (f"--{name}", job[name])]
    assert job_arguments(argv) == job
    for wrong in (argv[:-2], argv + ["--log", "again"], argv + ["--extra"], ["--slice"], ["slice", "s"] + argv,
                  [argv[0], argv[1], argv[0], argv[1]] + argv[2:], ["--slice"] + argv[2:], [f"{argv[0]}={argv[1]}"] + argv[2:]):
        with pytest.raises(SystemExit) as ended:
            job_arguments(wrong)
        assert ended.value.code == 2
        assert "usage: token_shard.py --slice SLICE" in capsys.readouterr().err


def test_what_a_job_sends_and_reads_is_what_json_writes_and_reads():
    """The job's side writes and reads JSON without the json module (its import was a third of a job's
    start): its request, with the odd strings an environment can hold, reads back as written."""
    import json

    from eagledata.tokens.warmjobs import json_text, json_value

    request = {"job": {"slice": "a/b \"c\"\\d.tsv"}, "cwd": "/tmp/é 東京",
               "env": {"UNDECODABLE": "x\udcff", "CTRL": "\x00\x1f\n\t\u2028", "EMPTY": "", "Ü": "☃"},
               "key": ["/usr/bin/python3", [1733400000123456789, 5]]}
    assert json.loads(json_text(request)) == request
    assert json_text(request) == json.dumps(request, separators=(",", ":"))
    for reply in ('{"code": 0}\n', '{"code": null, "refused": "its stamp is not /x/\\u00e9"}\n', ' {"code": 75} '):
        assert json_value(reply) == json.loads(reply)
    for bad in ("", "{", '{"code": 0} {"code": 1}', "code"):
        with pytest.raises(ValueError):
            json_value(bad)
    with pytest.raises(TypeError):
        json_text({"x": 1.5})

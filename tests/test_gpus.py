"""GPU pinning (eagledata.extract.gpus), proven on a CPU machine with 8 simulated devices
(EAGLEDATA_NUM_GPUS=8): real concurrent subprocesses claim devices with flock; a device must never
be held by two jobs, never more than 8 in use, and a kill -9'd job must free its devices."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eagledata.extract import gpus


pytestmark = pytest.mark.timing  # runs alone under xdist (tests/conftest.py)


ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "tests" / "_gpu_child.py"


@pytest.fixture
def box(tmp_path):
    """A simulated 8-GPU box: lock dir, busy-marker dir, journal, child environment."""
    locks, busy = tmp_path / "locks", tmp_path / "busy"
    busy.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(EAGLEDATA_NUM_GPUS="8", EAGLEDATA_GPU_LOCK_DIR=str(locks), PYTHONPATH=str(ROOT / "src"))
    return {"locks": locks, "busy": busy, "journal": tmp_path / "journal.jsonl", "env": env}


def _spawn(box, n, hold_s, name=None):
    args = [sys.executable, str(CHILD), str(n), str(box["journal"]), str(box["busy"]), str(hold_s)]
    return subprocess.Popen(args + ([name] if name else []), env=box["env"], stdout=subprocess.PIPE, text=True)


def _run_all(box, sizes, hold_s):
    procs = [_spawn(box, n, hold_s, f"job{k}") for k, n in enumerate(sizes)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    return _journal(box)


def _journal(box):
    recs = [json.loads(line) for line in box["journal"].read_text().splitlines()]
    claims = {r["name"]: r for r in recs if r["event"] == "claim"}
    releases = {r["name"]: r for r in recs if r["event"] == "release"}
    return claims, releases


def _assert_exclusive(claims, releases, limit=8):
    assert all(not c["violations"] for c in claims.values()), [c["violations"] for c in claims.values()]
    # independent check on the journal: intervals of jobs sharing a device never overlap, and at
    # no claim instant are more than `limit` devices held
    names = list(claims)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if set(claims[a]["ids"]) & set(claims[b]["ids"]):
                assert (releases[a]["t"] <= claims[b]["t"]) or (releases[b]["t"] <= claims[a]["t"]), (a, b)
    for c in claims.values():
        held = sum(len(o["ids"]) for n, o in claims.items() if o["t"] <= c["t"] < releases[n]["t"])
        assert held <= limit


def test_candidates_and_env(monkeypatch, tmp_path):
    assert gpus.gpu_candidates({"CUDA_VISIBLE_DEVICES": "2,5", "EAGLEDATA_NUM_GPUS": "8"}) == ["2", "5"]
    assert gpus.gpu_candidates({"CUDA_VISIBLE_DEVICES": ""}) == []  # explicitly no GPU
    assert gpus.gpu_candidates({"EAGLEDATA_NUM_GPUS": "3"}) == ["0", "1", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    try:
        assert gpus.claim_gpus(0, tmp_path) == []
        assert gpus.claim_gpus(1, tmp_path) == ["4"]
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "4" and os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        # the visible set is now just "4" (ours): a second claim in this process sees it held
        with pytest.raises(gpus.GpuClaimError, match="could not claim 1 free GPUs"):
            gpus.claim_gpus(1, tmp_path, timeout_s=0, poll_s=0)
        with pytest.raises(gpus.GpuClaimError, match="only 2 visible"):
            gpus.claim_gpus(3, tmp_path, candidates=["4", "6"])
        assert gpus.claim_gpus(1, tmp_path, candidates=["4", "6"]) == ["6"]
        assert gpus.held_by_others(tmp_path, ["4", "6", "7"]) == ["4", "6"]
    finally:
        gpus.release_all()
    assert gpus.held_by_others(tmp_path, ["4", "6"]) == []


def test_all_or_nothing(tmp_path):
    first = gpus.try_claim(6, [str(i) for i in range(8)], tmp_path)
    assert first is not None and first.ids == ["0", "1", "2", "3", "4", "5"]
    assert gpus.try_claim(4, [str(i) for i in range(8)], tmp_path) is None
    assert gpus.held_by_others(tmp_path, ["6", "7"]) == []  # the partial claim was given back
    first.release()
    assert gpus.try_claim(4, [str(i) for i in range(8)], tmp_path).ids == ["0", "1", "2", "3"]


def test_eight_concurrent_jobs_of_one_gpu(box):
    claims, releases = _run_all(box, [1] * 8, hold_s=1.0)
    _assert_exclusive(claims, releases)
    assert sorted(i for c in claims.values() for i in c["ids"]) == [str(i) for i in range(8)]
    # they really ran at the same time: every claim happened before any release
    assert max(c["t"] for c in claims.values()) < min(r["t"] for r in releases.values())


def test_more_jobs_than_gpus_wait_and_never_exceed_the_limit(box):
    claims, releases = _run_all(box, [1] * 11, hold_s=0.8)
    _assert_exclusive(claims, releases)
    waited = [n for n, c in claims.items() if c["wait_s"] > 0.5]
    assert len(waited) >= 3  # 11 jobs, 8 devices: at least 3 had to wait for a release
    for n in waited:
        assert any(r["t"] <= claims[n]["t"] for r in releases.values())


def test_two_jobs_of_four_and_a_third_waits(box):
    claims, releases = _run_all(box, [4, 4], hold_s=1.0)
    _assert_exclusive(claims, releases)
    a, b = claims["job0"]["ids"], claims["job1"]["ids"]
    assert len(a) == len(b) == 4 and sorted(a + b) == [str(i) for i in range(8)]
    assert max(c["t"] for c in claims.values()) < min(r["t"] for r in releases.values())  # concurrent
    box["journal"].unlink()
    claims, releases = _run_all(box, [4, 4, 4, 1], hold_s=0.8)
    _assert_exclusive(claims, releases)


def test_kill_9_releases_the_devices(box):
    p = _spawn(box, 8, 600, "victim")
    assert p.stdout.readline().strip() == "ready"
    cands = [str(i) for i in range(8)]
    assert gpus.try_claim(1, cands, box["locks"]) is None  # all 8 held by the child
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL
    claim = gpus.try_claim(8, cands, box["locks"])  # no cleanup step: the kernel dropped the locks
    assert claim is not None and claim.ids == cands
    claim.release()


def test_real_snakemake_run_with_gpu_resource(box, tmp_path):
    """A real Snakemake run: 10 jobs (8 x gpu=1, 2 x gpu=4) with --resources gpu=8 and
    --cores 8. Snakemake limits the sum; each job claims concrete devices; no device is shared,
    the limit holds, and no job ever waits for a claim (Snakemake's count and the locks agree)."""
    wf = tmp_path / "wf"
    wf.mkdir()
    (wf / "Snakefile").write_text(textwrap.dedent(f"""
        SIZES = {{**{{f"d{{i}}": 1 for i in range(8)}}, "big0": 4, "big1": 4}}

        rule all:
            input: expand("out/{{name}}.done", name=SIZES)

        rule extract_like:
            output: "out/{{name}}.done"
            resources: gpu=lambda wc: SIZES[wc.name]
            params: n=lambda wc: SIZES[wc.name]
            shell: "{sys.executable} {CHILD} {{params.n}} {box['journal']} {box['busy']} 1.0 {{wildcards.name}} > {{output}}"
        """))
    proc = subprocess.run([sys.executable, "-m", "snakemake", "all", "--cores", "8", "--resources", "gpu=8"],
                          cwd=wf, env=box["env"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    claims, releases = _journal(box)
    assert len(claims) == 10
    _assert_exclusive(claims, releases)
    assert all(len(claims[f"d{i}"]["ids"]) == 1 for i in range(8))
    assert len(claims["big0"]["ids"]) == len(claims["big1"]["ids"]) == 4
    assert max(c["wait_s"] for c in claims.values()) < 0.5


def test_claiming_happens_before_torch_is_imported():
    """The extraction modules import torch lazily, so a job can claim GPUs and set
    CUDA_VISIBLE_DEVICES before CUDA is initialised."""
    code = ("import sys; from eagledata.extract import gpus, base, layers, storage, hf, core, sglang; "
            "from eagledata.export import common, specforge, speculators, trainers; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})


def test_cli_runs_the_command_after_double_dash_with_options_before_it(box, tmp_path):
    """``python -m eagledata.extract.gpus N --lock-dir D -- CMD``: the options before ``--`` are the
    tool's, the command after it runs with its devices pinned; the locks are taken in D."""
    lock_dir = tmp_path / "cli-locks"
    cmd = [sys.executable, "-m", "eagledata.extract.gpus", "2", "--lock-dir", str(lock_dir), "--timeout", "5",
           "--", sys.executable, "-c", "import os; print('pinned', os.environ['CUDA_VISIBLE_DEVICES'])"]
    out = subprocess.run(cmd, env=box["env"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["pinned", "0,1"]
    assert sorted(p.name for p in lock_dir.glob("gpu-*.lock")) == ["gpu-0.lock", "gpu-1.lock"]
    # without a command it prints the claimed devices
    out = subprocess.run(cmd[:8], env=box["env"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "0,1", out.stderr

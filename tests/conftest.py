"""Shared fixtures. Tests that need ../shared (real Kimi tokenizers, recorded traffic) skip with a
clear message where it is absent; EAGLEDATA_SHARED may point elsewhere."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("EAGLEDATA_SHARED", ROOT.parent / "shared"))
# the shard jobs' warm workers (eagledata.tokens.warmjobs) of the many work directories the tests run
# the workflow in end a few seconds after their last job, not 30 s
os.environ.setdefault("EAGLEDATA_WARM_IDLE_S", "3")


def need_shared(*parts: str) -> Path:
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"needs {path} (the project's shared/ data; set EAGLEDATA_SHARED to its location)")
    return path


@pytest.fixture(scope="session")
def k25():
    from eagledata.text.families import get_family
    from eagledata.text.tokenizer import load_tokenizer

    fam = get_family("kimi-k2.5")
    return load_tokenizer(need_shared("tokenizers", "kimi-k2.5"), fam), fam


@pytest.fixture(scope="session")
def k2_thinking():
    from eagledata.text.families import get_family
    from eagledata.text.tokenizer import load_tokenizer

    fam = get_family("kimi-k2-thinking")
    return load_tokenizer(need_shared("tokenizers", "kimi-k2-thinking"), fam), fam


@pytest.fixture(scope="session")
def k2():
    from eagledata.text.families import get_family
    from eagledata.text.tokenizer import load_tokenizer

    fam = get_family("kimi-k2")
    return load_tokenizer(need_shared("tokenizers", "kimi-k2-instruct"), fam), fam


@pytest.fixture(scope="session")
def recorded():
    path = need_shared("recorded", "openrouter-kimi-k2-0905.jsonl")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def demo_prompts(names: tuple[str, ...] = ("chat", "tools")) -> list[dict]:
    """The demo's prompt records (config/demo/NAME.jsonl), in file order."""
    rows = []
    for name in names:
        for line in (ROOT / f"config/demo/{name}.jsonl").read_text(encoding="utf-8").splitlines():
            if line.strip():
                rows.append(json.loads(line))
    return rows


@pytest.fixture(scope="session")
def demo_tok(tmp_path_factory):
    """The demo tokenizer (built from the bundled corpus) with the K2.5 family."""
    from eagledata.demo.tokenizer import build_demo_tokenizer, default_corpus_path
    from eagledata.text.families import get_family
    from eagledata.text.tokenizer import load_tokenizer

    out = tmp_path_factory.mktemp("tok") / "demo"
    build_demo_tokenizer(default_corpus_path(), out)
    fam = get_family("kimi-k2.5")
    return load_tokenizer(out, fam), fam


def ask_stand_in(tok, fam, profile: str, seed: int, prompts: list[dict] | None = None) -> tuple[list[dict], dict]:
    """Send every demo prompt to an in-process stand-in with ``profile`` (every other request streamed);
    return the recorded responses and, per id, the stand-in's truth (what the model produced,
    whatever the provider profile did to it)."""
    import httpx

    from eagledata.standin.server import SimulatorServer

    records, truths = [], {}
    with SimulatorServer(tok, fam, seed=seed, profile=profile) as sim, httpx.Client(timeout=30) as client:
        for i, p in enumerate(demo_prompts() if prompts is None else prompts):
            body = {"model": "demo", "messages": p["messages"], "max_tokens": 4096, "stream": i % 2 == 1}
            if p.get("tools"):
                body["tools"] = p["tools"]
            r = client.post(sim.base_url + "/chat/completions", json=body)
            records.append({"id": p["id"], "request": body, "status": r.status_code, "response_raw": r.text})
            truths[p["id"]] = sim.truth_of(body)
    return records, truths


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, pytestconfig):
    """The demo (config/config.yaml) run to the end once per test session, in a copy of the repository,
    shared by the session's pytest-xdist workers (the first to need it runs it, under a lock; the others
    wait and reuse it). Read-only: a test that changes anything, or runs snakemake in it (even a dry run
    writes Snakemake's records), works on ``workflow_runs.copy_run(demo_run, ...)``, which keeps mtimes,
    so the copy's finished jobs (and its demo tokenizer and model) stay done."""
    from workflow_runs import copy_repo, snakemake

    shared = _xdist_run_dir(pytestconfig) or tmp_path_factory.getbasetemp()
    work, done = shared / "demo_run" / "w", shared / "demo_run" / "done"
    with _locked(shared / "demo_run.lock"):
        if not done.exists():
            shutil.rmtree(work, ignore_errors=True)  # a worker that failed half-way
            snakemake(copy_repo(work), "all")
            done.touch()
    return work


def _xdist_run_dir(config) -> Path | None:
    """The directory the pytest-xdist workers of this run share (the parent of each worker's base
    temporary directory, which xdist sets); None outside xdist."""
    return Path(config.option.basetemp).parent if os.environ.get("PYTEST_XDIST_WORKER") else None


@contextlib.contextmanager
def _locked(path: Path, mode: int = fcntl.LOCK_EX):
    with open(path, "a") as fh:
        fcntl.flock(fh, mode)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist, a test marked ``timing`` (it measures latencies, in-flight counts or a
    filesystem filling up against a clock) runs alone: it holds the run's test lock exclusively, from
    its fixtures' setup to their teardown, and every other test holds it shared. So no other worker's
    Snakemake jobs share the cores with it, as when the tests ran one at a time."""
    shared = _xdist_run_dir(item.config)
    if shared is None:
        yield
        return
    alone = item.get_closest_marker("timing") is not None
    with _locked(shared / "tests.lock", fcntl.LOCK_EX if alone else fcntl.LOCK_SH):
        yield

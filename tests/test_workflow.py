"""Real Snakemake runs of the workflow, in a copy of the repository under a temp dir."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COPY = ["Snakefile", "rules", "scripts", "config", "src", "profiles", "envs"]

pytestmark = pytest.mark.workflow


def _copy_repo(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name in COPY:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def snakemake(workdir: Path, *args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", *args]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def planned_jobs(workdir: Path, *args: str, env: dict | None = None) -> dict[str, int]:
    """Rule -> job count that a dry run would execute."""
    out = snakemake(workdir, "-n", *args, env=env)
    text = out.stdout + out.stderr
    if "Nothing to be done" in text:
        return {}
    table = re.search(r"Job stats:\n(.*?)\n\n", text, re.S)
    assert table, text[-3000:]
    jobs = {}
    for line in table.group(1).splitlines()[2:]:
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] != "total":
            jobs[parts[0]] = int(parts[1])
    return jobs


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    work = _copy_repo(tmp_path_factory.mktemp("demo"))
    snakemake(work, "all")
    return work


def _lines(path: Path) -> int:
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())


def test_demo_runs_end_to_end(demo_run):
    work = demo_run
    config = yaml.safe_load((work / "config/config.yaml").read_text())
    for name, ds in config["datasets"].items():
        n_prompts = _lines(work / ds["prompts"])
        report = json.loads((work / f"results/{name}/validation.json").read_text())
        if ds.get("turns") == "all":  # one sample per regenerated turn
            assert report["counts"]["total"] == _lines(work / f"results/{name}/responses.jsonl") > n_prompts
        else:
            assert report["counts"]["total"] == n_prompts
        assert report["passed"]
        assert report["counts"]["exact"] + report["counts"]["repaired"] >= 0.9 * n_prompts
        hidden = json.loads((work / f"results/{name}/hidden/manifest.json").read_text())
        tokens = json.loads((work / f"results/{name}/tokens/manifest.json").read_text())
        assert hidden["tokenizer_fingerprint"] == tokens["tokenizer_fingerprint"]
        assert hidden["samples"] == report["counts"]["included"]
        assert (work / f"results/{name}/validation.txt").read_text().startswith(f"dataset {name}:")
    assert planned_jobs(work) == {}


def test_one_dataset_target_builds_only_that_dataset(tmp_path):
    work = _copy_repo(tmp_path / "w")
    jobs = planned_jobs(work, "chat")
    assert jobs.get("generate") == 1 and jobs.get("tokens") == 1 and jobs.get("extract") == 1
    assert "chat" in jobs


@pytest.fixture
def paid_setup(tmp_path):
    """A workflow whose datasets use backend openrouter, pointed at a local stand-in over loopback."""
    from eagledata.demo.tokenizer import build_demo_tokenizer, default_corpus_path
    from eagledata.text.families import get_family
    from eagledata.standin.server import SimulatorServer
    from eagledata.text.tokenizer import load_tokenizer

    work = _copy_repo(tmp_path / "w")
    tok_dir = tmp_path / "tok"
    build_demo_tokenizer(default_corpus_path(), tok_dir)
    fam = get_family("kimi-k2.5")
    tok = load_tokenizer(tok_dir, fam)
    prompts = {}
    for name in ("a", "b"):
        p = work / f"data/{name}.jsonl"
        p.parent.mkdir(exist_ok=True)
        p.write_text("".join(json.dumps({"id": f"{name}{i}", "messages": [{"role": "user", "content": f"Question {i} for {name}?"}]}) + "\n"
                             for i in range(3)))
        prompts[name] = p
    with SimulatorServer(tok, fam, seed=3) as server:
        config = {
            "budget_usd": 1.0,
            "models": {"m": {"family": "kimi-k2.5", "tokenizer": str(tok_dir), "api_model": "moonshotai/kimi-k2.5"}},
            "generation": {"api_base": server.base_url, "max_tokens": 4096, "concurrency": 4, "backoff_base_s": 0.01},
            "extraction": {"enabled": False},
            "datasets": {n: {"prompts": f"data/{n}.jsonl", "model": "m", "backend": "openrouter"} for n in ("a", "b")},
        }
        (work / "config/config.yaml").write_text(yaml.safe_dump(config))
        yield work, server, tok_dir, prompts


KEY = "sk-or-v1-test-secret-0123456789abcdef"


def _requests(server) -> int:
    return sum(server.request_counts.values())


def test_rerun_rules_never_regenerate_paid_responses(paid_setup):
    work, server, tok_dir, prompts = paid_setup
    env = {"OPENROUTER_API_KEY": KEY}
    snakemake(work, "all", env=env)
    assert _requests(server) == 6

    # changed reconstruction code: tokens and downstream rerun, generation does not
    with open(work / "src/eagledata/tokens/reconstruct.py", "a") as fh:
        fh.write("\n# changed\n")
    jobs = planned_jobs(work, env=env)
    assert "generate" not in jobs and jobs["tokens"] == 2 and jobs["validate"] == 2
    snakemake(work, "all", env=env)

    # changed tokenizer (its chat template): same
    with open(tok_dir / "chat_template.jinja", "a") as fh:
        fh.write("{# changed #}")
    jobs = planned_jobs(work, env=env)
    assert "generate" not in jobs and jobs["tokens"] == 2
    snakemake(work, "all", env=env)
    assert _requests(server) == 6

    # a new prompt in dataset a: only a regenerates, and only the new prompt is requested
    with open(prompts["a"], "a") as fh:
        fh.write(json.dumps({"id": "a-new", "messages": [{"role": "user", "content": "One more?"}]}) + "\n")
    jobs = planned_jobs(work, env=env)
    assert jobs["generate"] == 1 and jobs["tokens"] == 1  # b (deduplicated against a) does not rerun
    snakemake(work, "all", env=env)
    assert _requests(server) == 7
    assert _lines(work / "results/a/responses.jsonl") == 4

    # the key never lands in any file the pipeline wrote
    for path in work.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path


def test_lint_is_clean():
    out = subprocess.run([sys.executable, "-m", "snakemake", "--lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


# token_plan (a checkpoint) is left out: see the tokens stage notes in README (known gap)
STAGE_RULES = {"tokens.py": {"tokens"}, "validate.py": {"validate"}, "report.py": {"report_dataset", "report"},
               "export.py": {"export"}, "extract.py": {"extract"}, "build_demo_model.py": {"demo_model"},
               "build_demo_tokenizer.py": {"demo_tokenizer"}}


def _runtime_imports(work: Path, script: str) -> set[str]:
    """Project module files a stage script's top-level imports load, measured in a fresh interpreter."""
    code = ("import ast, sys, pathlib\n"
            f"tree = ast.parse(pathlib.Path('scripts/{script}').read_text())\n"
            "top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]\n"
            "exec(compile(ast.Module(top, []), 'imports', 'exec'))\n"
            "print('\\n'.join(m.__file__ for n, m in list(sys.modules.items())\n"
            "                 if n.split('.')[0] == 'eagledata' and getattr(m, '__file__', None)))\n")
    env = {**os.environ, "PYTHONPATH": str(work / "src")}
    out = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return {str(Path(line).resolve().relative_to(work.resolve())) for line in out.stdout.split()}


def test_editing_a_module_reruns_the_stages_that_import_it_and_never_generation(tmp_path):
    """Every project module in turn: a newer copy reruns each stage whose script imports it (measured
    by importing the script's imports) and what follows, and never the paid generate step."""
    from eagledata.standin.server import SimulatorServer
    from eagledata.demo.tokenizer import build_demo_tokenizer, default_corpus_path
    from eagledata.text.families import get_family
    from eagledata.text.tokenizer import load_tokenizer

    work = _copy_repo(tmp_path / "w")
    tok_dir = tmp_path / "tok"
    build_demo_tokenizer(default_corpus_path(), tok_dir)
    fam = get_family("kimi-k2.5")
    with SimulatorServer(load_tokenizer(tok_dir, fam), fam, seed=5) as server:
        config = yaml.safe_load((work / "config/config.yaml").read_text())
        config["generation"]["api_base"] = server.base_url
        config["datasets"] = {"a": {"prompts": "config/demo/chat.jsonl", "model": "demo", "backend": "openrouter"}}
        (work / "config/config.yaml").write_text(yaml.safe_dump(config))
        env = {"OPENROUTER_API_KEY": KEY}
        snakemake(work, "all", env=env)
    assert planned_jobs(work, env=env) == {}
    modules = sorted(p for p in (work / "src/eagledata").rglob("*.py"))
    imported = {script: _runtime_imports(work, script) for script in STAGE_RULES}
    assert all(imported.values())

    # Two copies of the finished run (copy2 keeps mtimes: nothing is out of date in either), each
    # editing every other module, so the dry runs use both cores.
    twin = shutil.copytree(work, tmp_path / "w2", symlinks=True)
    assert planned_jobs(twin, env=env) == {}

    def plan_after_edit(root: Path, rel: Path) -> dict[str, int]:
        """A real edit (Snakemake compares input checksums, so a touch is not a change), then undone."""
        path = root / rel
        text, st = path.read_bytes(), path.stat()
        path.write_bytes(text + b"\n# edited\n")
        try:
            return planned_jobs(root, env=env)
        finally:
            path.write_bytes(text)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    rels = [path.relative_to(work) for path in modules]
    with ThreadPoolExecutor(2) as pool:
        halves = pool.map(lambda job: {rel: plan_after_edit(job[0], rel) for rel in job[1]},
                          [(work, rels[0::2]), (Path(twin), rels[1::2])])
        results = {work / rel: jobs for half in halves for rel, jobs in half.items()}
    assert len(results) == len(modules)
    for path, jobs in results.items():
        rel = str(path.relative_to(work))
        assert "generate" not in jobs and "import_responses" not in jobs, (rel, jobs)
        for script, rules in STAGE_RULES.items():
            if rel in imported[script]:
                assert rules <= set(jobs), (rel, script, jobs)
    unused = work / "src/eagledata/cli.py"  # the CLI is imported by no stage
    assert results[unused] == {}, results[unused]
    # A touch is not a change: every module newer than every stamp, same bytes, plans nothing (the
    # stamp jobs compare the recorded checksums of their inputs).
    later = time.time() + 5
    for path in modules:
        os.utime(path, (later, later))
    assert planned_jobs(work, env=env) == {}

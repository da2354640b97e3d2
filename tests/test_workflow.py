"""Real Snakemake runs of the workflow, in a copy of the repository under a temp dir."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from workflow_runs import ROOT, configure, copy_repo, copy_run, planned_jobs, snakemake

pytestmark = pytest.mark.workflow

_copy_repo = copy_repo  # the name tests/test_pershard_tokens.py imports


def _lines(path: Path) -> int:
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())


def test_demo_runs_end_to_end(demo_run, tmp_path):
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
    assert planned_jobs(copy_run(work, tmp_path / "w")) == {}  # a dry run writes records: on a copy


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
        fh.write("\nCHANGED = 1\n")
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


# token_shard is left out: a dry run cannot list the jobs of a checkpoint (token_plan) that reruns
STAGE_RULES = {"token_plan.py": {"token_plan"}, "tokens.py": {"tokens"}, "validate.py": {"validate"}, "report.py": {"report_dataset", "report"},
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


def _readers(work: Path) -> dict[str, frozenset[str]]:
    """Module file -> the code stamps that count it (results/_code/scripts/: a ``digest  path`` line
    per file), as the workflow wrote them while it was parsed."""
    readers: dict[str, set[str]] = defaultdict(set)
    for stamp in (work / "results/_code/scripts").glob("*.sha256"):
        for line in stamp.read_text().splitlines()[:-1]:
            readers[line.split("  ", 1)[1]].add(stamp.name.split(".")[0])  # {name}.{digest16}.sha256
    assert readers, f"no code stamps under {work}"
    return {path: frozenset(stamps) for path, stamps in readers.items()}


def _plan_after_edit(root: Path, rels: list[Path], env: dict) -> dict[str, int]:
    """The dry run after a real edit of every file of ``rels`` (Snakemake compares input checksums, so a
    touch is not a change); the edits are then undone, mtimes included."""
    saved = {rel: ((root / rel).read_bytes(), (root / rel).stat()) for rel in rels}
    for rel, (text, _) in saved.items():
        (root / rel).write_bytes(text + b"\nEDITED_FOR_TEST = 1\n")
    try:
        return planned_jobs(root, env=env)
    finally:
        for rel, (text, st) in saved.items():
            (root / rel).write_bytes(text)
            os.utime(root / rel, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_editing_a_module_reruns_the_stages_that_import_it_and_never_generation(demo_run, demo_tok, tmp_path):
    """Every project module in turn: a newer copy reruns each stage whose script imports it (measured
    by importing the script's imports) and what follows, and never the paid generate step.

    One dry run per group of modules that the same code stamps count: the jobs an edit makes out of
    date are those declaring a stamp of the edited file and what follows them, so every module of a
    group plans exactly what editing the whole group plans, and a module missing from a stage's code
    inputs is counted by other stamps than its neighbours: a group of its own."""
    from eagledata.standin.server import SimulatorServer

    work = copy_run(demo_run, tmp_path / "w")  # the demo's tokenizer and model are built
    tok, fam = demo_tok
    env = {"OPENROUTER_API_KEY": KEY}
    with SimulatorServer(tok, fam, seed=5) as server:
        generation = {**yaml.safe_load((work / "config/config.yaml").read_text())["generation"], "api_base": server.base_url}
        configure(work, generation=generation,
                  datasets={"a": {"prompts": "config/demo/chat.jsonl", "model": "demo", "backend": "openrouter"}})
        snakemake(work, "all", env=env)
    assert planned_jobs(work, env=env) == {}
    modules = sorted(p for p in (work / "src/eagledata").rglob("*.py"))
    imported = {script: _runtime_imports(work, script) for script in STAGE_RULES}
    assert all(imported.values())

    readers = _readers(work)
    groups: dict[frozenset[str], list[Path]] = defaultdict(list)
    for path in modules:
        rel = path.relative_to(work)
        groups[readers.get(str(rel), frozenset())].append(rel)
    assert any(readers.get(str(p.relative_to(work))) for p in modules)  # the records name the modules

    # Two copies of the finished run (copy_run keeps mtimes: nothing is out of date in either), each
    # taking every other group, so the dry runs use both cores.
    twin = copy_run(work, tmp_path / "w2")
    assert planned_jobs(twin, env=env) == {}
    batches = list(groups.values())
    with ThreadPoolExecutor(2) as pool:
        halves = pool.map(lambda job: [(rels, _plan_after_edit(job[0], rels, env)) for rels in job[1]],
                          [(work, batches[0::2]), (twin, batches[1::2])])
        results = {work / rel: jobs for half in halves for rels, jobs in half for rel in rels}
    assert len(results) == len(modules)
    for path, jobs in results.items():
        rel = str(path.relative_to(work))
        assert "generate" not in jobs and "import_responses" not in jobs, (rel, jobs)
        for script, rules in STAGE_RULES.items():
            if rel in imported[script]:
                assert rules <= set(jobs), (rel, script, jobs)
    unused = work / "src/eagledata/cli.py"  # the CLI is imported by no stage
    assert results[unused] == {}, results[unused]
    # the package's data files a stage reads (not imported: read as resources) are its code inputs too
    for data, rules in (("templates/kimi-k2.5.jinja", {"demo_tokenizer"}), ("templates/report.html.jinja", {"report"})):
        jobs = _plan_after_edit(work, [Path("src/eagledata/data") / data], env)
        assert rules <= set(jobs) and "generate" not in jobs, (data, jobs)
    # A touch is not a change: every module newer than every stamp, same bytes, plans nothing (the
    # stamps are rewritten only when their content changes). Nor is a comment, a docstring or the
    # package's version (read from the installed metadata: no module holds it).
    later = time.time() + 5
    for path in modules:
        os.utime(path, (later, later))
    assert planned_jobs(work, env=env) == {}
    for path in modules:
        text = path.read_text()
        path.write_text(text.replace('"""', '"""An edited docstring. ', 1) + "\n# an edited comment\n")
    assert planned_jobs(work, env=env) == {}


def test_a_hugging_face_tokenizers_files_and_code_are_inputs_its_weights_are_not(tmp_path):
    """Every file a tokenizer directory's loaders read is an input of the stamp the token jobs declare
    (so an edited merges.txt reruns them), its tokenization code too; weights beside them are not."""
    work = copy_repo(tmp_path / "w")
    tok = tmp_path / "hf-tokenizer"
    tok.mkdir()
    read = ("vocab.json", "merges.txt", "tokenizer_config.json", "added_tokens.json", "special_tokens_map.json",
            "config.json", "tokenization_custom.py")
    for name in read + ("model.safetensors", "README.md"):
        (tok / name).write_text("{}")
    (work / "responses.jsonl").write_text("")
    configure(work, models={"m": {"family": "kimi-k2", "tokenizer": str(tok), "api_model": "org/m"}},
              datasets={"d": {"model": "m", "responses": "responses.jsonl"}})
    stamps = work / "results/_code/datasets/d"
    snakemake(work, "-n")  # the workflow writes its stamps while it is parsed, named by their content
    [stamp] = stamps.glob("tokens.*.sha256")
    hashed = {line.split("  ", 1)[1] for line in stamp.read_text().splitlines() if "  " in line}
    assert {str(tok / name) for name in read} <= hashed
    assert not {str(tok / name) for name in ("model.safetensors", "README.md")} & hashed
    assert stamp.name == f"tokens.{stamp.read_text().splitlines()[-1][:16]}.sha256"
    (tok / "merges.txt").write_text('{"edited": 1}')
    snakemake(work, "-n")
    assert len(list(stamps.glob("tokens.*.sha256"))) == 2 and stamp.is_file()  # the first is never rewritten


def test_a_job_run_elsewhere_declares_the_main_processs_stamps(demo_run, tmp_path):
    """A job run elsewhere (--executor slurm: `--mode remote`, which parses the workflow again) takes the
    stamps the main process wrote (EAGLEDATA_STAMPS, an envvar Snakemake passes to jobs), not the code
    on disk when it starts: code edited since makes it fail its check instead of running unstamped
    code that the main process would record as the stamped code's; the same code passes."""
    work = copy_run(demo_run, tmp_path / "w")
    stamps = {}
    for path in sorted((work / "results/_code").rglob("*.sha256")):
        rel = str(path.relative_to(work / "results/_code"))
        stamps[re.sub(r"\.[0-9a-f]{16}\.sha256$", "", rel)] = str(path.relative_to(work))
    env = {"EAGLEDATA_STAMPS": json.dumps(stamps)}
    remote = ("--target-jobs", "validate:dataset=chat", "--allowed-rules", "validate", "--mode", "remote", "--force")
    module = work / "src/eagledata/validate/summary.py"
    original = module.read_text()
    module.write_text(original + "\nEDITED = 1\n")
    assert snakemake(work, *remote, env=env, check=False).returncode != 0
    assert "CodeChangedError" in (work / "logs/chat/validate.log").read_text()
    module.write_text(original)
    snakemake(work, *remote, env=env)
    assert "CodeChangedError" not in (work / "logs/chat/validate.log").read_text()


def _with_own_weights(demo_run, tmp_path):
    """A copy of the demo run whose model's weights are a copy outside the workflow's assets, run to the
    end: (work directory, weights directory, config)."""
    work = copy_run(demo_run, tmp_path / "w")
    weights = tmp_path / "weights"
    shutil.copytree(work / "results/_assets/demo-model", weights)
    config = yaml.safe_load((work / "config/config.yaml").read_text())
    model = next(iter(config["models"]))
    configure(work, models={**config["models"], model: {**config["models"][model], "weights": str(weights)}})
    snakemake(work, "all")
    assert planned_jobs(work) == {}
    return work, weights, config


def test_a_weight_file_rewritten_in_place_reruns_extraction(demo_run, tmp_path):
    """Weights outside the workflow's own assets: their model files are inputs of the extraction jobs
    (a directory input is judged by the directory's mtime, which rewriting a file in it leaves)."""
    work, weights, _ = _with_own_weights(demo_run, tmp_path)
    shard = next(weights.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes())  # in place: the directory's mtime stays
    jobs = planned_jobs(work)
    assert jobs.get("extract_shard") and jobs.get("extract"), jobs


def test_weights_replaced_by_older_files_rerun_extraction(demo_run, tmp_path):
    """Weights replaced by another checkpoint whose files are older than the hidden states (cp -a or
    rsync -a of it, a symlink moved to it): no input is newer than an output, so Snakemake's mtime
    trigger saw nothing and the old model's hidden states stayed published, exports too (the demo: 0
    jobs; the manifests named the old model's fingerprint). The model files' names, sizes and mtimes are
    a param of the extraction rules: the shard jobs rerun, and extract (another fingerprint)."""
    from eagledata.demo.model import build_demo_model
    from eagledata.extract.weights import model_fingerprint

    work, weights, config = _with_own_weights(demo_run, tmp_path)
    vocab = json.loads((weights / "config.json").read_text())["vocab_size"]
    other = build_demo_model(tmp_path / "other", vocab, seed=1)
    old = min(p.stat().st_mtime for p in weights.iterdir()) - 3600
    for f in other.iterdir():
        os.utime(f, (old, old))
        shutil.copy2(f, weights / f.name)  # as cp -a does: the older mtime comes along
    assert model_fingerprint(weights) != json.loads((work / "results/chat/hidden/manifest.json").read_text())["model_fingerprint"]
    jobs = planned_jobs(work)
    assert jobs.get("extract_shard") == len(config["datasets"]) and jobs.get("extract") == len(config["datasets"]), jobs
    snakemake(work, "all")
    for name in config["datasets"]:
        for done in ("hidden/manifest.json", "export/specforge/export.json", "export/speculators/export.json"):
            assert json.loads((work / "results" / name / done).read_text())["model_fingerprint"] == model_fingerprint(weights)
    assert planned_jobs(work) == {}


def test_a_setting_of_one_trainers_export_reruns_only_that_export(demo_run, tmp_path):
    """export.specforge_group_size shapes SpecForge's layout alone: changing it plans the SpecForge
    exports and not the speculators ones. The config is rewritten by a YAML dump (keys sorted): a
    mapping's key order is no change (params are compared as written out, so they are kept sorted)."""
    work = copy_run(demo_run, tmp_path / "w")
    config = yaml.safe_load((work / "config/config.yaml").read_text())
    export = {**(config.get("export") or {}), "specforge_group_size": 7}
    configure(work, export=export)
    out = snakemake(work, "-n").stdout
    assert "kind=specforge" in out and "kind=speculators" not in out, out[-3000:]
    # the SpecForge export of each dataset, and the report that reads the exports
    assert planned_jobs(work) == {"export": len(config["datasets"]), "report": 1, "all": 1}


def test_a_dataset_left_with_no_sample_runs_to_the_end_and_says_so(demo_run, tmp_path):
    """A dataset whose every prompt is a duplicate of an earlier dataset's (dedup) has no sample: its
    tokens, extraction, exports, validation and the run's report finish with zero samples (the tokens
    gather and the extraction gather had no store to prune, the report no columns to read); its
    speculators export loads as an empty dataset; its history entries go. Given its own prompts back,
    it extracts them again (the extraction records of its last shards had outlived them)."""
    import datasets

    work = copy_run(demo_run, tmp_path / "w")
    config = yaml.safe_load((work / "config/config.yaml").read_text())
    first = next(iter(config["datasets"]))
    shared = (work / config["datasets"][first]["prompts"]).read_text()
    own = "".join(json.dumps({"id": f"own-{i}", "messages": [{"role": "user", "content": f"Name {i} colours."}]}) + "\n"
                  for i in range(3))
    prompts = work / "data/dup.jsonl"
    prompts.parent.mkdir()
    prompts.write_text(shared + own)
    configure(work, datasets={**config["datasets"], "dup": {**config["datasets"][first], "prompts": "data/dup.jsonl"}})
    results = work / "results/dup"
    snakemake(work, "all")
    assert json.loads((results / "hidden/manifest.json").read_text())["samples"] == 3
    history = next((work / ".cache").rglob("fidelity_history.jsonl"))
    assert any(json.loads(line)["dataset"] == "dup" for line in history.read_text().splitlines())

    prompts.write_text(shared)
    snakemake(work, "all")
    assert planned_jobs(work) == {}
    summary = json.loads((results / "generation_summary.json").read_text())
    assert summary["samples"] == 0 and len(summary["dedup"]["dropped"]) == _lines(prompts)
    assert json.loads((results / "tokens/manifest.json").read_text())["rows"] == 0
    validation = json.loads((results / "validation.json").read_text())
    assert validation["counts"]["total"] == 0 and validation["passed"]
    assert json.loads((results / "hidden/manifest.json").read_text())["samples"] == 0
    for kind in ("specforge", "speculators"):
        assert json.loads((results / f"export/{kind}/export.json").read_text())["samples"] == 0
    assert len(datasets.load_from_disk(str(results / "export/speculators"))) == 0
    assert 'href="dup/report.html"' in (work / "results/report.html").read_text()
    assert not any(json.loads(line)["dataset"] == "dup" for line in history.read_text().splitlines())

    prompts.write_text(shared + own)
    snakemake(work, "all")
    assert json.loads((results / "hidden/manifest.json").read_text())["samples"] == 3
    assert planned_jobs(work) == {}


def test_a_policy_change_reaches_the_trainer_files_in_one_run(demo_run, tmp_path):
    """A tokens rerun that changes which rows train (validation.policy) rewrites the token shards (new
    content-named files, same stable keys) and the extraction plan. The shard jobs' records are named
    by the tokens' content, so the changed shards are extracted in that same run: the trainer files hold
    exactly the admitted samples after one run each way (before, the old hidden shards were published:
    24 of 24 chat samples exported with none admitted)."""
    work = copy_run(demo_run, tmp_path / "w")
    config = yaml.safe_load((work / "config/config.yaml").read_text())
    names = list(config["datasets"])

    def exported() -> dict[str, tuple[int, int, int]]:
        out = {}
        for name in names:
            results = work / "results" / name
            admitted = json.loads((results / "validation.json").read_text())["counts"]["included"]
            out[name] = (admitted, *(json.loads((results / f"export/{kind}/export.json").read_text())["samples"]
                                     for kind in ("specforge", "speculators")))
        return out

    before = exported()
    assert all(a == s == p > 0 for a, s, p in before.values())
    configure(work, validation={**(config.get("validation") or {}), "policy": {"completion": ["repaired"]}})
    snakemake(work, "all")
    assert exported() == {name: (0, 0, 0) for name in names}
    configure(work, validation=config.get("validation") or {})
    snakemake(work, "all")
    assert exported() == before
    assert planned_jobs(work) == {}


def test_a_retry_note_reruns_the_generate_job_of_its_dataset_only(demo_run, tmp_path):
    """`eagledata retry` ends with a note beside the dataset's cache (tests/test_retry_final.py): the
    generate rule declares it, so the dataset's job reruns (and requests the final errors forgotten),
    the other datasets' do not."""
    from eagledata.config import load_config
    from eagledata.generate.retryfinal import retry_note_path

    work = copy_run(demo_run, tmp_path / "w")
    config = load_config(work / "config/config.yaml")
    name = next(iter(config["datasets"]))
    assert planned_jobs(work) == {}
    note = retry_note_path(work / config["cache_dir"], name)
    note.write_text(json.dumps({"by": "eagledata retry", "forgotten": {"404": 1}}))
    out = snakemake(work, "-n").stdout
    assert planned_jobs(work).get("generate") == 1 and f"dataset={name}" in out.split("rule generate:")[1][:800], out[-3000:]

"""Helpers for the tests that run the real workflow: a copy of the repository in a work directory,
`snakemake` as a subprocess, the jobs a dry run plans, and copies of a finished run.

The session fixture ``demo_run`` (tests/conftest.py) runs the demo once; a test that needs a finished
run, or only the demo's built assets (tokenizer, model), starts from :func:`copy_run` of
it instead of running those jobs again."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPY = ["Snakefile", "rules", "scripts", "config", "src", "profiles", "envs"]


def copy_repo(dest: Path) -> Path:
    """The workflow (Snakefile, rules, scripts, config, the package) in a work directory of its own."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in COPY:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def copy_run(work: Path, dest: Path) -> Path:
    """A copy of the work directory of a run (``dest`` must not exist): ``cp -a`` keeps mtimes, hard
    links (hidden/ and tokens/ link into their stores) and Snakemake's records, so nothing that was
    up to date in ``work`` is out of date in the copy."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", str(work), str(dest)], check=True)
    return dest


def snakemake(workdir: Path, *args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Snakemake in ``workdir``, whose jobs import the copy's own package (the stamps are of it, and a job
    that ran other code than its stamps record fails: eagledata.codeinputs.verify_loaded_code)."""
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", *args]
    own = {"PYTHONPATH": str(Path(workdir) / "src")} if (Path(workdir) / "src" / "eagledata").is_dir() else {}
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env={**os.environ, **own, **(env or {})},
                          timeout=900)
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


def configure(work: Path, **sections) -> dict:
    """Replace top-level sections of the work directory's config/config.yaml; return the new config."""
    import yaml

    path = work / "config" / "config.yaml"
    config = {**yaml.safe_load(path.read_text()), **sections}
    path.write_text(yaml.safe_dump(config))
    return config

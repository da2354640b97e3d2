"""profiles/slurm: parses, the workflow dry-runs with it (snakemake-executor-plugin-slurm must be
installed: it is in the `test` extra), extract jobs carry gpu=N and the plugin turns that into
--gpus=N. No SLURM cluster here: nothing is submitted."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "slurm" / "config.yaml"

pytest.importorskip("snakemake_executor_plugin_slurm", reason="pip install snakemake-executor-plugin-slurm (test extra)")


def test_profile_parses():
    prof = yaml.safe_load(PROFILE.read_text())
    assert prof["executor"] == "slurm"
    assert isinstance(prof["jobs"], int) and prof["jobs"] > 0
    assert {"slurm_partition", "runtime", "mem_mb", "cpus_per_task"} <= set(prof["default-resources"])
    assert "extract" in prof["set-resources"] and "gpu" not in prof["set-resources"]["extract"]  # gpu comes from the rule
    assert "resources" not in prof  # no single-machine GPU cap on a cluster


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("slurm")
    for name in ("Snakefile", "rules", "scripts", "config", "src", "profiles", "envs"):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, work / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, work / name)
    cfg = yaml.safe_load((work / "config" / "config.yaml").read_text())
    cfg["extraction"].update(gpus_per_job=8, device="auto")  # K2.5-style: one job per 8-GPU node
    (work / "gpu.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "all", "--workflow-profile", "profiles/slurm",
                           "--configfile", "gpu.yaml"], cwd=work, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _job_resources(text: str, rule: str) -> list[dict[str, str]]:
    out = []
    for block in re.findall(rf"rule {rule}:\n(.*?)(?:\n\n|\Z)", text, re.S):
        m = re.search(r"resources: (.*)", block)
        out.append(dict(kv.split("=", 1) for kv in m.group(1).split(", ")))
    return out


def test_dag_dry_runs_with_the_slurm_profile(dry_run):
    extract = _job_resources(dry_run, "extract")
    assert len(extract) == len(yaml.safe_load((ROOT / "config/config.yaml").read_text())["datasets"])  # one per dataset
    for res in extract:
        assert res["gpu"] == "8" and res["slurm_partition"] == "gpu" and res["cpus_per_task"] == "32"
    for res in _job_resources(dry_run, "tokens"):
        assert res["slurm_partition"] == "cpu" and "gpu" not in res


def test_plugin_maps_gpu_to_gpus_flag(dry_run):
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    class Resources(dict):
        __getattr__ = dict.get

    res = _job_resources(dry_run, "extract")[0]
    job = SimpleNamespace(resources=Resources(gpu=int(res["gpu"])))
    assert set_gres_string(job).strip() == "--gpus=8"

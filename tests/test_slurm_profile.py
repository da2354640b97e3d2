"""profiles/slurm: parses, the workflow dry-runs with it (snakemake-executor-plugin-slurm must be
installed: it is in the `test` extra), there is one extract_shard job per token shard, each carries
gpu=N (the plugin turns that into --gpus=N) on the GPU partition, and the gather and the plan run on
the CPU partition. No SLURM cluster here: nothing is submitted (the stages before the extraction plan,
a checkpoint, run locally first so that the dry run knows the shards)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "slurm" / "config.yaml"

pytest.importorskip("snakemake_executor_plugin_slurm", reason="pip install snakemake-executor-plugin-slurm (test extra)")
pytestmark = pytest.mark.xdist_group("slurm_dry_run")  # one worker builds the module's dry run


def test_profile_parses():
    prof = yaml.safe_load(PROFILE.read_text())
    assert prof["executor"] == "slurm"
    assert isinstance(prof["jobs"], int) and prof["jobs"] > 0
    assert {"slurm_partition", "runtime", "mem_mb", "cpus_per_task"} <= set(prof["default-resources"])
    shard = prof["set-resources"]["extract_shard"]
    assert shard["slurm_partition"] == "gpu" and "gpu" not in shard  # gpu comes from the rule
    assert "slurm_partition" not in prof["set-resources"]["extract"]  # the gather runs on the CPU partition
    assert "resources" not in prof  # no single-machine GPU cap on a cluster


@pytest.fixture(scope="module")
def dry_run(demo_run, tmp_path_factory):
    """The demo's stages up to the extraction plans run locally at a smaller shard size (on a copy of
    the finished demo run: its responses are there), then the dry run with the slurm profile."""
    from workflow_runs import copy_run

    work = copy_run(demo_run, tmp_path_factory.mktemp("slurm") / "w")
    cfg = yaml.safe_load((work / "config" / "config.yaml").read_text())
    cfg["extraction"].update(gpus_per_job=8, device="auto")  # K2.5-style: one job per 8-GPU node
    cfg["tokens"] = {**(cfg.get("tokens") or {}), "shard_size": 6}  # a few shards per dataset
    (work / "gpu.yaml").write_text(yaml.safe_dump(cfg))
    plans = [f"results/{d}/hidden.work/plan.json" for d in cfg["datasets"]]
    local = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", *plans, "--configfile", "gpu.yaml"],
                           cwd=work, capture_output=True, text=True, timeout=600)
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    keys = sum(len(json.loads((work / p).read_text())["shards"]) for p in plans)
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "all", "--workflow-profile", "profiles/slurm",
                           "--configfile", "gpu.yaml"], cwd=work, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return SimpleNamespace(text=proc.stdout + proc.stderr, keys=keys, datasets=len(cfg["datasets"]))


def _job_resources(text: str, rule: str) -> list[dict[str, str]]:
    out = []
    for block in re.findall(rf"rule {rule}:\n(.*?)(?:\n\n|\Z)", text, re.S):
        m = re.search(r"resources: (.*)", block)
        out.append(dict(kv.split("=", 1) for kv in m.group(1).split(", ")))
    return out


def test_dag_dry_runs_with_the_slurm_profile(dry_run):
    shards = _job_resources(dry_run.text, "extract_shard")
    assert len(shards) == dry_run.keys > dry_run.datasets  # one GPU job per token shard, several per dataset
    for res in shards:
        assert res["gpu"] == "8" and res["slurm_partition"] == "gpu" and res["cpus_per_task"] == "32"
    gathers = _job_resources(dry_run.text, "extract")
    assert len(gathers) == dry_run.datasets
    for res in gathers + _job_resources(dry_run.text, "tokens"):
        assert res["slurm_partition"] == "cpu" and "gpu" not in res


def test_plugin_maps_gpu_to_gpus_flag(dry_run):
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    class Resources(dict):
        __getattr__ = dict.get

    res = _job_resources(dry_run.text, "extract_shard")[0]
    job = SimpleNamespace(resources=Resources(gpu=int(res["gpu"])))
    assert set_gres_string(job).strip() == "--gpus=8"

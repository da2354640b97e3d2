"""Extraction as one job per token shard (rules/extract.smk, eagledata.extract.pershard), in real
snakemake runs of the demo (stand-in responses, the tiny random DeepSeek-V3 on CPU):

* one new prompt at the top, in the middle or at the end re-extracts only the shard holding it: every
  other hidden shard keeps its sha256 and mtime, and the dry run plans one extract_shard job (the three
  places tried side by side, each on its own copy of one finished run); an edit of comments and a
  docstring in the extraction code re-extracts nothing (a fourth copy); a length limit plans the jobs
  of the shards it acts on and no other (a fifth); compute_dtype written as the model's own dtype plans
  none (a sixth); with extraction.keep_replaced_gb, a prompt added and removed again takes the replaced
  hidden shard back, extracting nothing (a seventh);
* with 8 simulated GPUs and 16 shards at one GPU per job, 8 extract jobs hold a device at once and
  no device is ever held by two jobs (--resources gpu=8), and a failed shard job is the only one
  redone (one run for both).

Every work directory starts from a copy of the finished demo run (tests/conftest.py): its demo tokenizer
and model are built already.
"""
from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from eagledata.io import sha256_file
from eagledata.extract.storage import read_shard_metadata
from eagledata.tokens.shards import is_boundary_id
from workflow_runs import copy_run, planned_jobs, snakemake

pytestmark = pytest.mark.workflow

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = "results/ds/hidden"
PLAN = "results/ds/hidden.work/plan.json"
# One torch thread per extract_shard job (the rule asks for 2): on a 2-core machine two jobs then run
# side by side instead of one, and 8 concurrent jobs do not fight over the cores. What a shard holds
# does not depend on it, and Snakemake reruns nothing for a changed thread count.
ONE_THREAD = ("--set-threads", "extract_shard=1")
# The demo's 24 chat prompts at this shard size: 5 shards, and the three places below (top, middle,
# end) fall in the first, the third and the last of them.
CHAT_SHARD_SIZE = 10


def _configure(work: Path, prompts: str, shard_size: int, **extraction) -> None:
    """One dataset `ds` of ``prompts`` (relative to ``work``: a copy of the work directory reads its own)."""
    config = yaml.safe_load((work / "config/config.yaml").read_text())
    config["datasets"] = {"ds": {"prompts": prompts, "model": "demo", "backend": "simulator"}}
    config["tokens"] = {**(config.get("tokens") or {}), "shard_size": shard_size}
    config["extraction"] = {**config["extraction"], **extraction}
    config["export"] = {**(config.get("export") or {}), "specforge": False, "speculators": False}
    (work / "config/config.yaml").write_text(yaml.safe_dump(config))


def _store(work: Path) -> dict[str, tuple[str, int]]:
    """Hidden shard file -> (sha256, mtime_ns), as in the store."""
    return {p.name: (sha256_file(p), p.stat().st_mtime_ns)
            for p in (work / "results/ds/hidden.store").glob("*.safetensors") if p.is_file()}


def _ids(work: Path, name: str) -> set[str]:
    return set(json.loads(read_shard_metadata(work / "results/ds/hidden.store" / name)["sample_ids"]))


def _records(work: Path) -> dict[str, dict]:
    # hidden.work/shards/{key}/{content}.json: one per key after a gather
    return {p.parent.name: json.loads(p.read_text()) for p in (work / "results/ds/hidden.work/shards").glob("*/*.json")}


def _plan_keys(work: Path) -> list[str]:
    return [s["key"] for s in json.loads((work / PLAN).read_text())["shards"]]


def _prompt(pid: str) -> str:
    return json.dumps({"id": pid, "messages": [{"role": "user", "content": f"Explain {pid} in one sentence."}]}) + "\n"


def _not_boundary(prefix: str, shard_size: int) -> str:
    return next(f"{prefix}{k}" for k in range(100) if not is_boundary_id(f"{prefix}{k}", shard_size))


def _add_one_prompt(work: Path, where: str, new_id: str) -> None:
    """Insert one prompt `new_id` at the top, in the middle or at the end (``where``) of the dataset's
    prompts, rebuild, and check that only the shard holding it was re-extracted."""
    prompts = work / "data" / "chat.jsonl"
    before, records_before = _store(work), _records(work)
    ids_before = {n: _ids(work, n) for n in before}
    lines = prompts.read_text().splitlines(keepends=True)
    at = {"top": 0, "middle": len(lines) // 2, "end": len(lines)}[where]
    prompts.write_text("".join(lines[:at] + [_prompt(new_id)] + lines[at:]))
    snakemake(work, PLAN)  # generation (one request), tokens, validation, the plan
    assert planned_jobs(work, HIDDEN) == {"extract_shard": 1, "extract": 1}, where
    snakemake(work, HIDDEN, *ONE_THREAD)
    after = _store(work)
    new = [n for n in after if after[n] != before.get(n)]
    assert len(new) == 1, (where, new)
    new_ids_in_shard = _ids(work, new[0])
    assert new_id in new_ids_in_shard
    kept = [n for n in before if n in after]
    assert all(after[n] == before[n] for n in kept)  # same bytes (sha256) and the same mtime
    replaced = set(before) - set(after)  # at most the shard that gained the prompt (none if it starts one)
    assert len(replaced) <= 1 and all(ids_before[n] < new_ids_in_shard for n in replaced), (where, replaced)
    records = _records(work)
    rerun = [k for k in records if records[k].get("job") != (records_before.get(k) or {}).get("job")]
    assert len(rerun) == 1 and records[rerun[0]]["file"] == new[0] and not records[rerun[0]]["resumed"]
    manifest = json.loads((work / HIDDEN / "manifest.json").read_text())
    assert sorted(s["file"] for s in manifest["shards"]) == sorted(after)
    assert all(os.path.samefile(work / HIDDEN / n, work / "results/ds/hidden.store" / n) for n in after)
    assert manifest["samples"] == len(lines) + 1
    assert planned_jobs(work, HIDDEN) == {}


def _edit_comments(work: Path, where: str, new_id: str) -> None:
    """A comment and a docstring edited in the extraction code (``where``/``new_id``: unused): no job
    is planned (no code stamp changed), every hidden shard is kept, same bytes and mtime."""
    before, records_before = _store(work), _records(work)
    module = work / "src/eagledata/extract/core.py"
    module.write_text(module.read_text().replace('"""', '"""(An edited docstring.) ', 1) + "\n# an edited comment\n")
    assert planned_jobs(work, HIDDEN) == {}
    snakemake(work, HIDDEN, *ONE_THREAD)
    assert _store(work) == before
    assert _records(work) == records_before


def _set_length_limit(work: Path, max_seq_len: int) -> None:
    config = yaml.safe_load((work / "config/config.yaml").read_text())
    config["datasets"]["ds"]["extraction"] = {"max_seq_len": max_seq_len}
    (work / "config/config.yaml").write_text(yaml.safe_dump(config))


def _length_limits(work: Path, where: str, new_id: str) -> None:
    """A length limit above every sample (a safety cap) plans no shard job (only the gather, which
    records the limit), and keeps every hidden shard; one below the longest shard's longest sample
    but above every other shard's plans that shard's job alone, which re-extracts it (``where``/
    ``new_id``: unused)."""
    before, records_before = _store(work), _records(work)
    longest = {s["key"]: s["longest_train"] for s in json.loads((work / PLAN).read_text())["shards"]}
    top, *others = sorted(longest.values(), reverse=True)
    assert others and top > others[0], longest  # the demo's: one shard holds the longest sample alone
    _set_length_limit(work, 100_000)
    assert planned_jobs(work, HIDDEN) == {"extract": 1}
    snakemake(work, HIDDEN, *ONE_THREAD)
    assert _store(work) == before and _records(work) == records_before
    _set_length_limit(work, top - 1)
    assert planned_jobs(work, HIDDEN) == {"extract_shard": 1, "extract": 1}
    snakemake(work, HIDDEN, *ONE_THREAD)
    after, records = _store(work), _records(work)
    (cut,) = [k for k, n in longest.items() if n == top]
    cut_file = records[cut]["file"]  # named after its token shard: the same name, new bytes
    assert after[cut_file] != before[cut_file] and not records[cut]["resumed"]
    assert {k: r for k, r in records.items() if k != cut} == {k: r for k, r in records_before.items() if k != cut}
    assert all(after[n] == before[n] for n in before if n != cut_file)
    manifest = json.loads((work / HIDDEN / "manifest.json").read_text())
    assert manifest["length_limit"]["truncated"] >= 1


def _compute_dtype(work: Path, where: str, new_id: str) -> None:
    """compute_dtype written out as the dtype the model declares (what auto loads) plans no shard job
    and keeps every hidden shard, nor do the other settings below; another dtype plans every shard's job (``where``/``new_id``:
    unused). The demo model copied out of results/_assets/ first (weights a job builds are not read
    while jobs are planned): that move reruns every shard job, each keeping its shard."""
    before = _store(work)
    shutil.copytree(work / "results/_assets/demo-model", work / "models/demo")
    config = yaml.safe_load((work / "config/config.yaml").read_text())
    config["models"]["demo"]["weights"] = "models/demo"
    (work / "config/config.yaml").write_text(yaml.safe_dump(config))
    snakemake(work, HIDDEN, *ONE_THREAD)
    assert _store(work) == before and all(r["resumed"] for r in _records(work).values())
    declared = json.loads((work / "models/demo/config.json").read_text())["dtype"]
    assert config["extraction"].get("backend", "hf") == "hf" and config["extraction"].get("compute_dtype", "auto") == "auto"
    for dtype, jobs in ((declared, {"extract": 1}), ("bfloat16", {"extract_shard": len(before), "extract": 1})):
        config["extraction"]["compute_dtype"] = dtype
        (work / "config/config.yaml").write_text(yaml.safe_dump(config))
        assert planned_jobs(work, HIDDEN) == jobs, dtype
        if dtype == declared:
            snakemake(work, HIDDEN, *ONE_THREAD)
            assert _store(work) == before and all(r["resumed"] for r in _records(work).values())
    # nor does writing out the default layers, SGLang's server arguments under the hf backend, or a
    # file added to (or replaced in) the weights directory that is not the model's; other layers do
    config["extraction"]["compute_dtype"] = declared
    n_layers = json.loads((work / "models/demo/config.json").read_text())["num_hidden_layers"]
    config["extraction"].update(layers=[1, n_layers // 2 - 1, n_layers - 4], sglang_server_args={"kv_cache_dtype": "fp8_e5m2"})
    (work / "config/config.yaml").write_text(yaml.safe_dump(config))
    (work / "models/demo/NOTES.md").write_text("where these weights came from\n")
    generation_config = work / "models/demo/generation_config.json"
    if generation_config.exists():
        generation_config.write_bytes(generation_config.read_bytes())
    assert planned_jobs(work, HIDDEN) == {}
    config["extraction"]["layers"] = [1, 2, 3]
    (work / "config/config.yaml").write_text(yaml.safe_dump(config))
    assert planned_jobs(work, HIDDEN) == {"extract_shard": len(before), "extract": 1}


def _revert(work: Path, where: str, new_id: str) -> None:
    """With extraction.keep_replaced_gb, a prompt added then removed again (``new_id``, in the middle:
    ``where``) takes the replaced hidden shard back from hidden.store/replaced/: the revert's one shard
    job extracts nothing and the store ends as it began, same bytes and mtimes."""
    config = yaml.safe_load((work / "config/config.yaml").read_text())
    config["extraction"]["keep_replaced_gb"] = 1
    (work / "config/config.yaml").write_text(yaml.safe_dump(config))
    before = _store(work)
    prompts = work / "data" / "chat.jsonl"
    original = prompts.read_text()
    lines = original.splitlines(keepends=True)
    prompts.write_text("".join(lines[:len(lines) // 2] + [_prompt(new_id)] + lines[len(lines) // 2:]))
    snakemake(work, HIDDEN, *ONE_THREAD)
    changed = [n for n, facts in _store(work).items() if before.get(n) != facts]
    assert len(changed) == 1 and changed[0] not in before, changed
    replaced = work / "results/ds/hidden.store/replaced"
    assert sorted(p.name for p in replaced.glob("*.safetensors")) == sorted(set(before) - set(_store(work)))
    prompts.write_text(original)
    snakemake(work, PLAN)
    assert planned_jobs(work, HIDDEN) == {"extract_shard": 1, "extract": 1}
    snakemake(work, HIDDEN, *ONE_THREAD)
    assert _store(work) == before
    assert sum(r["resumed"] for r in _records(work).values()) >= 1
    assert sorted(p.name for p in replaced.glob("*.safetensors")) == changed  # the added prompt's shard, kept


def test_one_new_prompt_reextracts_only_the_shard_holding_it(demo_run, tmp_path):
    work = copy_run(demo_run, tmp_path / "w")
    prompts = work / "data" / "chat.jsonl"
    prompts.parent.mkdir()
    shutil.copy(ROOT / "config/demo/chat.jsonl", prompts)
    _configure(work, "data/chat.jsonl", shard_size=CHAT_SHARD_SIZE)
    snakemake(work, HIDDEN, *ONE_THREAD)
    keys = _plan_keys(work)
    assert len(keys) >= 4
    new_ids = {where: _not_boundary(prefix, CHAT_SHARD_SIZE)
               for where, prefix in (("top", "chat-000-"), ("middle", "chat-012-"), ("end", "chat-999-"))}
    # the places are three different shards: the first, one neither first nor last, and the last
    firsts = sorted(min(_ids(work, name)) for name in _store(work))  # a shard holds an id range
    assert len(firsts) == len(keys)
    at = {where: max([0] + [i for i, first in enumerate(firsts) if first <= new_id]) for where, new_id in new_ids.items()}
    assert at["top"] == 0 < at["middle"] < at["end"] == len(keys) - 1, at
    # each place on its own copy of the finished run (copy_run keeps mtimes: nothing out of date), side
    # by side: the runs are chains of one-process jobs, so three of them keep both cores busy
    copies = {where: copy_run(work, tmp_path / where) for where in [*new_ids, "comments", "limits", "dtype", "revert"]}
    steps = {**{where: _add_one_prompt for where in new_ids}, "comments": _edit_comments, "limits": _length_limits,
             "dtype": _compute_dtype, "revert": _revert}
    new_ids["revert"] = new_ids["middle"]
    with ThreadPoolExecutor(len(copies)) as pool:
        list(pool.map(lambda where: steps[where](copies[where], where, new_ids.get(where, "")), copies))


@pytest.fixture(scope="module")
def sixteen_shards(demo_run, tmp_path_factory):
    """The demo's 16 tool prompts at shard_size 1 (16 shards), one GPU per extract job, run up to the
    extraction plan, and the demo model built (a copy of the demo run: built already)."""
    work = copy_run(demo_run, tmp_path_factory.mktemp("gpu") / "w")
    _configure(work, "config/demo/tools.jsonl", shard_size=1, device="auto", gpus_per_job=1)
    snakemake(work, PLAN, "results/_assets/demo-model")
    assert len(_plan_keys(work)) == 16
    return work


def _gpu_env(tmp_path: Path) -> dict[str, str]:
    return {"EAGLEDATA_NUM_GPUS": "8", "EAGLEDATA_GPU_LOCK_DIR": str(tmp_path / "locks")}




def test_eight_shard_jobs_hold_eight_gpus_and_a_failed_one_is_the_only_one_redone(sixteen_shards, tmp_path):
    """One run of the 16 shard jobs on 8 simulated GPUs, one of them made to fail (its store path is
    a directory, so publishing fails): 8 jobs hold a device at once, never two jobs the same device,
    and the rerun redoes only the failed shard, leaving the 15 others' files untouched."""
    work = copy_run(sixteen_shards, tmp_path / "w")
    env = _gpu_env(tmp_path)
    assert planned_jobs(work, HIDDEN, env=env) == {"extract_shard": 16, "extract": 1}
    plan = json.loads((work / PLAN).read_text())
    victim = plan["shards"][5]
    blocker = work / "results/ds/hidden.store" / Path(victim["file"]).with_suffix(".safetensors").name
    blocker.mkdir(parents=True)
    # --cores 32 would allow all 16 jobs (one thread each): the gpu resource is what holds it to 8
    proc = snakemake(work, HIDDEN, "--cores", "32", "--resources", "gpu=8", "--keep-going", *ONE_THREAD, env=env,
                     check=False)
    assert proc.returncode != 0
    assert "IsADirectoryError" in (work / f"logs/ds/extract_shard/{victim['key']}.{victim['sha256'][:16]}.log").read_text()
    records = _records(work)
    assert sorted(records) == sorted(s["key"] for s in plan["shards"] if s is not victim)
    jobs = [r["job"] for r in records.values()]
    assert len(jobs) == 15 and all(len(j["gpus"]) == 1 for j in jobs)
    assert sorted({g for j in jobs for g in j["gpus"]}) == [str(i) for i in range(8)]
    for i, a in enumerate(jobs):  # a device is held by one job at a time
        for b in jobs[i + 1:]:
            if a["gpus"] == b["gpus"]:
                assert a["finished"] <= b["claimed"] or b["finished"] <= a["claimed"], (a, b)
    held = [sum(1 for o in jobs if o["claimed"] <= j["claimed"] < o["finished"]) for j in jobs]
    assert max(held) == 8  # 8 jobs at once, never more

    before = _store(work)
    assert len(before) == 15
    blocker.rmdir()
    assert planned_jobs(work, HIDDEN, env=env) == {"extract_shard": 1, "extract": 1}
    snakemake(work, HIDDEN, *ONE_THREAD, env=env)
    after = _store(work)
    assert {n: after[n] for n in before} == before  # the 15 finished shards untouched
    assert set(after) - set(before) == {blocker.name}
    again = _records(work)
    assert all(again[k] == records[k] for k in records)
    manifest = json.loads((work / HIDDEN / "manifest.json").read_text())
    assert manifest["samples"] == 16 and len(manifest["shards"]) == 16
    assert planned_jobs(work, HIDDEN, env=env) == {}

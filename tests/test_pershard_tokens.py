"""The tokens stage as one job per shard (eagledata.tokens.pershard, rules/tokens.smk): the same samples,
verdicts and shard files as the one-job stage; slices left untouched when unchanged; learning from
per-shard summaries only; one new response rebuilds one shard's reconstruction (real snakemake)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import xxhash
import yaml

from eagledata.errors import StageError
from eagledata.text.families import get_family
from eagledata.text.tokenizer import load_tokenizer
from eagledata.tokens import pershard as ps
from eagledata.tokens import plan as tp
from eagledata.tokens.shards import build_token_shards, is_boundary_id, read_shards

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
RECORDED = SHARED / "recorded" / "openrouter-kimi-k2-0905.jsonl"
K2 = SHARED / "tokenizers" / "kimi-k2-instruct"
needs_recorded = pytest.mark.skipif(not (RECORDED.exists() and K2.exists()), reason="needs ../shared recorded data and K2 tokenizer")


def _lines_digest(path: Path) -> str:
    """What plan.json's ``source_lines_xxh3_128`` holds: the XXH3-128 of each record line's ``offset TAB
    length TAB xxh3_128(line)`` in file order (blank lines are no record; line breaks not in the line)."""
    digest, offset = xxhash.xxh3_128(), 0
    for raw in path.read_bytes().split(b"\n"):
        line = raw.rstrip(b"\r")
        if line.strip():
            digest.update(f"{offset}\t{len(line)}\t{xxhash.xxh3_128_hexdigest(line)}\n".encode())
        offset += len(raw) + 1
    return digest.hexdigest()


def run_pershard(src: Path, work: Path, tok, fam, shard_size: int, dataset: str = "ds", workers: int = 1) -> dict:
    """Every step of the per-shard stage in turn, as the rules run them."""
    plan = tp.plan_shards(src, work / "plan.json", work / "slices", dataset, shard_size)
    keys = [s["key"] for s in plan["shards"]]
    paths = {k: ps.work_paths(work, k) for k in keys}
    for k in keys:
        ps.reconstruct_shard(paths[k]["slice"], paths[k]["where"], src, paths[k]["part"], paths[k]["summary"], tok, fam)
    return ps.learn_and_judge(work / "plan.json", work, work.parent / "tokens", work.parent / "store", tok, fam,
                              workers=workers)


@needs_recorded
@pytest.mark.parametrize("shard_size,batch_rows,workers", [(1, None, 1), (7, None, 2), (100, None, 1), (100, 5, 1)])
def test_per_shard_stage_gives_the_one_job_stage_results_on_recorded_data(tmp_path, monkeypatch, shard_size, batch_rows,
                                                                          workers):
    """Every column of every sample and the shard files' bytes, also when the per-shard steps work in
    batches of 5 rows, and when two spawned processes judge the shards."""
    if batch_rows:
        monkeypatch.setattr(ps, "BATCH_ROWS", batch_rows)
    fam = get_family("kimi-k2")
    tok = load_tokenizer(K2, fam)
    old = build_token_shards(RECORDED, tmp_path / "old", tok, fam, "ds", shard_size=shard_size,
                             store_dir=tmp_path / "old.store")
    new = run_pershard(RECORDED, tmp_path / "work", tok, fam, shard_size, workers=workers)
    a, b = read_shards(tmp_path / "old"), read_shards(tmp_path / "tokens")
    assert a.height == b.height == 272
    assert a.equals(b)  # every column of every sample: ids, verdicts, reasons, counts, repairs
    assert [s["file"] for s in old.manifest["shards"]] == [s["file"] for s in new["shards"]]  # same bytes
    assert old.manifest["conventions"] == new["conventions"]
    plan = json.loads((tmp_path / "work" / "plan.json").read_text())
    assert old.manifest["rows"] == new["rows"]
    assert plan["source_lines_xxh3_128"] == _lines_digest(RECORDED)
    assert new["source_records_sha256"] == plan["source_records_sha256"]


def _records(n: int) -> list[dict]:
    lines = [json.loads(x) for x in RECORDED.read_text(encoding="utf-8").splitlines() if x.strip()]
    out = []
    for i in range(n):
        rec = dict(lines[i % len(lines)])
        rec["id"] = f"rec-{i:05d}"
        out.append(rec)
    return out


def _write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def _new_id(records: list[dict], shard_size: int) -> str:
    """An id sorting inside the dataset that starts no shard."""
    return next(f"rec-00050-{k}" for k in range(100) if not is_boundary_id(f"rec-00050-{k}", shard_size))


@needs_recorded
def test_slices_of_unchanged_shards_keep_bytes_and_mtime(tmp_path):
    records = _records(200)
    src = tmp_path / "responses.jsonl"
    _write(src, records)
    plan = tp.plan_shards(src, tmp_path / "plan.json", tmp_path / "slices", "ds", 10)
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_ino) for p in (tmp_path / "slices").iterdir()}
    new = dict(records[3], id=_new_id(records, 10))
    _write(src, [new] + records[::-1])  # lines moved too: a shard follows ids, never lines
    again = tp.plan_shards(src, tmp_path / "plan.json", tmp_path / "slices", "ds", 10)
    after = {p.name: (p.stat().st_mtime_ns, p.stat().st_ino) for p in (tmp_path / "slices").iterdir()}
    assert again["slices_written"] == 1
    assert len(plan["shards"]) == len(again["shards"]) > 10
    changed = [k for k in after if after[k] != before.get(k)]
    assert len(changed) == 1
    owner = next(s for s in again["shards"] if s["first_id"] <= new["id"] <= s["last_id"])
    assert changed == [f"{owner['key']}.tsv"]
    assert [s["key"] for s in plan["shards"]] == [s["key"] for s in again["shards"]]


@needs_recorded
def test_a_slice_names_its_records_and_refuses_one_changed_after_the_plan(tmp_path):
    """A slice holds ids and digests (not the records: about 100 bytes a sample); its shard job reads
    each record from the responses at its offset, and refuses one whose bytes changed since the plan,
    naming the responses file and line."""
    fam = get_family("kimi-k2")
    tok = load_tokenizer(K2, fam)
    records = _records(30)
    src = tmp_path / "responses.jsonl"
    _write(src, records)
    plan = tp.plan_shards(src, tmp_path / "plan.json", tmp_path / "slices", "ds", 10)
    key = plan["shards"][0]["key"]
    p = ps.work_paths(tmp_path, key)
    assert p["slice"].stat().st_size < 100 * plan["shards"][0]["rows"] < src.stat().st_size / 10
    assert ps.slice_sources(p["slice"]) == (p["where"], str(src))  # what the token_shard job reads
    got = [sid for sid, _ in ps.iter_slice(p["slice"], p["where"], src)]
    assert got == sorted(got) and got[0] == plan["shards"][0]["first_id"] and len(got) == plan["shards"][0]["rows"]
    line = next(n for n, r in enumerate(records, 1) if r["id"] == got[-1])
    changed = [dict(r, status=201) if n == line else r for n, r in enumerate(records, 1)]
    _write(src, changed)
    with pytest.raises(ps.ResponsesFileError, match=rf"{src}:{line}: not the record token_plan saw there .*rerun token_plan"):
        ps.reconstruct_shard(p["slice"], p["where"], src, p["part"], p["summary"], tok, fam)
    assert not p["part"].exists()
    # a plan an older eagledata wrote (its slices hold other digests) is refused, naming the rerun
    (tmp_path / "plan.json").write_text(json.dumps({**plan, "version": 1}))
    with pytest.raises(ps.ResponsesFileError, match=r"plan.json: a plan of version 1, .*rerun token_plan"):
        ps.slice_sources(p["slice"])


@needs_recorded
def test_plan_sorted_in_runs_on_disk_is_the_plan_sorted_in_memory(tmp_path, monkeypatch):
    """Ids sorted in runs of 7 on disk and merged give the same plan and slices, byte for byte, as one
    sort in memory, and leave no run file behind; also ids a run file must escape (a tab, a line break,
    quotes, non-ASCII)."""
    records = _records(200)
    for i, odd in enumerate(["rec-00010\tx", "rec-00020\ny", 'rec-00030"\\', "rec-00040-é中🙂"]):
        records[i * 37]["id"] = odd
    src = tmp_path / "responses.jsonl"
    _write(src, records[::-1])
    one = tp.plan_shards(src, tmp_path / "one.json", tmp_path / "one" / "slices", "ds", 10)
    monkeypatch.setattr(tp, "RUN_ROWS", 7)
    runs = tp.plan_shards(src, tmp_path / "runs.json", tmp_path / "runs" / "slices", "ds", 10)
    assert runs == one and len(one["shards"]) > 10 and one["rows"] == 200
    assert sum(s["rows"] for s in one["shards"]) == 200
    a, b = sorted((tmp_path / "one" / "slices").iterdir()), sorted((tmp_path / "runs" / "slices").iterdir())
    assert [p.name for p in a] == [p.name for p in b] and all(x.read_bytes() == y.read_bytes() for x, y in zip(a, b))
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["slices", "where"]


@needs_recorded
def test_plan_read_in_parallel_ranges_is_the_plan_read_in_one_process(tmp_path, monkeypatch, caplog):
    """A responses file read by 3 spawned processes (byte ranges cut at line starts) gives the same
    plan and slices, byte for byte, as one process: blank lines, records without an id (named after
    their global line), CRLF line ends and ids sorted in runs on disk included."""
    from eagledata.tokens import planfile
    records = _records(120)
    for i in (5, 61, 118):
        del records[i]["id"]
    src = tmp_path / "responses.jsonl"
    src.write_text("\n".join(json.dumps(r) + ("\r" if i % 9 == 0 else "") + ("\n" if i % 17 == 0 else "")
                             for i, r in enumerate(records)) + "\n", encoding="utf-8")
    one = tp.plan_shards(src, tmp_path / "one.json", tmp_path / "one" / "slices", "ds", 10, workers=3)
    monkeypatch.setattr(planfile, "MIN_BYTES_PER_PROCESS", 1)
    monkeypatch.setattr(tp, "RUN_ROWS", 16)
    with caplog.at_level("INFO", logger=tp.__name__):
        three = tp.plan_shards(src, tmp_path / "three.json", tmp_path / "three" / "slices", "ds", 10, workers=3)
    assert "120 records read in 3 process(es)" in caplog.text
    assert three == one and one["source_lines_xxh3_128"] == _lines_digest(src)
    lines = src.read_text(encoding="utf-8").split("\n")
    no_id = sorted(f"ds-{n:06d}" for n, line in enumerate(lines, 1) if line.strip() and "id" not in json.loads(line))
    named = sorted(json.loads(line.split("\t")[0]) for p in (tmp_path / "one" / "slices").iterdir()
                   for line in p.read_text().splitlines() if line.startswith('"ds-'))
    assert len(no_id) == 3 and named == no_id
    for kind in ("slices", "where"):
        a, b = sorted((tmp_path / "one" / kind).iterdir()), sorted((tmp_path / "three" / kind).iterdir())
        assert [p.name for p in a] == [p.name for p in b] and all(x.read_bytes() == y.read_bytes() for x, y in zip(a, b))
    assert sorted(p.name for p in (tmp_path / "three").iterdir()) == ["slices", "where"]


@needs_recorded
@pytest.mark.parametrize("bad_line,bad", [(2, "cut"), (119, "cut"), (2, "id"), (119, "id")])
def test_parallel_plan_refuses_a_bad_record_as_one_process_does(tmp_path, monkeypatch, bad_line, bad):
    """The first bad record in file order, whichever range it falls in, is refused with the one-process
    message and its global line number: a line that is no JSON, an id that is no Unicode text (a lone
    surrogate: it has no UTF-8 bytes to shard it by)."""
    from eagledata.tokens import planfile
    records = _records(120)
    src = tmp_path / "responses.jsonl"
    lines = [json.dumps(r) for r in records]
    if bad == "cut":
        lines[bad_line - 1] = lines[bad_line - 1][:-3]  # not JSON
    else:
        lines[bad_line - 1] = json.dumps(dict(records[bad_line - 1], id="rec-\ud800"))  # (json writes it escaped)
    lines[min(bad_line + 30, 119)] = json.dumps({"id": "x", "response_raw": ""})  # a later bad record: not reported
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ps.ResponsesFileError) as one:
        tp.plan_shards(src, tmp_path / "plan.json", tmp_path / "slices", "ds", 10)
    monkeypatch.setattr(planfile, "MIN_BYTES_PER_PROCESS", 1)
    with pytest.raises(ps.ResponsesFileError) as parallel:
        tp.plan_shards(src, tmp_path / "plan.json", tmp_path / "slices", "ds", 10, workers=2)
    expected = f"{src}:{bad_line}:(json): invalid JSON" if bad == "cut" else f"{src}:{bad_line}:id: a lone surrogate"
    assert str(parallel.value) == str(one.value) and str(one.value).startswith(expected)
    if bad == "id":  # the one-job stage refuses it alike (it crashed hashing the id)
        fam = get_family("kimi-k2")
        with pytest.raises(ps.ResponsesFileError) as one_job:
            build_token_shards(src, tmp_path / "old", load_tokenizer(K2, fam), fam, "ds", shard_size=10)
        assert str(one_job.value) == str(one.value)


@needs_recorded
@pytest.mark.parametrize("run_rows", [None, 7])
def test_plan_refuses_a_duplicate_id_as_the_one_job_stage_does(tmp_path, monkeypatch, run_rows):
    """The plan (ids sorted in memory, or in runs on disk) names the line where an id first repeats,
    before any slice is written."""
    if run_rows:
        monkeypatch.setattr(tp, "RUN_ROWS", run_rows)
    records = _records(40)
    records[25]["id"], records[31]["id"], records[33]["id"] = "rec-00007", "rec-00002", "rec-00007"
    src = tmp_path / "responses.jsonl"
    _write(src, records)
    fam = get_family("kimi-k2")
    with pytest.raises(ps.ResponsesFileError) as planned:
        tp.plan_shards(src, tmp_path / "plan.json", tmp_path / "slices", "ds", 10)
    with pytest.raises(ps.ResponsesFileError) as one_job:
        build_token_shards(src, tmp_path / "old", load_tokenizer(K2, fam), fam, "ds", shard_size=10)
    assert str(planned.value) == str(one_job.value) == f"{src}:26: field 'id': duplicate id 'rec-00007'"
    assert not (tmp_path / "slices").exists() or not any((tmp_path / "slices").iterdir())


@needs_recorded
def test_learning_reads_the_per_shard_summaries_only(tmp_path):
    """The learning job gets the same conventions from the summaries alone (the parts, the slices and
    the responses removed), and a summary's size does not grow with its shard."""
    fam = get_family("kimi-k2")
    tok = load_tokenizer(K2, fam)
    src = tmp_path / "responses.jsonl"
    _write(src, _records(600))
    manifest = run_pershard(src, tmp_path / "work", tok, fam, 50)
    summaries = sorted((tmp_path / "work" / "parts").glob("*.summary.json"))
    largest = max(s.stat().st_size for s in summaries)
    alone = tmp_path / "alone"
    alone.mkdir()
    for p in summaries:
        shutil.copy(p, alone / p.name)
    shutil.rmtree(tmp_path / "work")
    src.unlink()
    learned = ps.learn_summaries(sorted(alone.glob("*.summary.json")), tmp_path / "learned.json")
    assert learned["rows"] == 600
    for provider, conv in manifest["conventions"].items():
        assert learned["conventions"][provider]["convention"] == conv["convention"]
        assert learned["conventions"][provider]["support"] == conv["support"]
        if "reasoning_count" in conv:
            assert learned["reliability"][provider] == conv["reasoning_count"]
        if "prompt_rendering" in conv:
            assert learned["variants"][provider] == conv["prompt_rendering"]
    one_shard = tmp_path / "one"
    _write(src, _records(600))
    big = tp.plan_shards(src, one_shard / "plan.json", one_shard / "slices", "ds", 100_000)
    key = big["shards"][0]["key"]
    p = ps.work_paths(one_shard, key)
    ps.reconstruct_shard(p["slice"], p["where"], src, p["part"], p["summary"], tok, fam)
    assert p["summary"].stat().st_size <= 2 * largest  # 600 samples in one shard vs about 50: counters only



@needs_recorded
def test_a_shard_of_another_tokenizer_is_refused_not_gathered(tmp_path):
    """A shard reconstructed with another tokenizer than the dataset's as the gathering job loads it
    (another fingerprint: here a revised chat template; in use a hub id's updated files or a library
    upgrade, which the stage stamp cannot see) is refused, naming it and the fix, and the gathered
    files are left as they were; a summary that records no tokenizer (an older eagledata) too. Rebuilt
    with the dataset's tokenizer, it is gathered."""
    fam = get_family("kimi-k2")
    tok = load_tokenizer(K2, fam)
    revised = tmp_path / "revised.jinja"
    revised.write_text(tok.chat_template + "{# revised upstream #}", encoding="utf-8")
    other = load_tokenizer(K2, fam, chat_template=revised)
    assert other.fingerprint != tok.fingerprint
    src = tmp_path / "responses.jsonl"
    _write(src, _records(80))
    work = tmp_path / "work"
    first = run_pershard(src, work, tok, fam, 10)
    keys = ps.plan_keys(work / "plan.json")
    assert len(keys) >= 3
    gathered = (tmp_path / "tokens" / "manifest.json").read_bytes()

    def gather():
        return ps.learn_and_judge(work / "plan.json", work, tmp_path / "tokens", tmp_path / "store", tok, fam)

    stale = ps.work_paths(work, keys[1])
    ps.reconstruct_shard(stale["slice"], stale["where"], src, stale["part"], stale["summary"], other, fam)
    with pytest.raises(StageError, match=rf"1 of {len(keys)} shards .*: {keys[1]} \({other.fingerprint[:16]}\)\..*"
                                         r"--forcerun token_shard"):
        gather()
    assert (tmp_path / "tokens" / "manifest.json").read_bytes() == gathered
    unrecorded = ps.work_paths(work, keys[2])["summary"]
    summary = json.loads(unrecorded.read_text())
    del summary["tokenizer_fingerprint"]
    unrecorded.write_text(json.dumps(summary))
    with pytest.raises(StageError, match=rf"2 of {len(keys)} shards .*{keys[2]} \(not recorded\)"):
        gather()
    for key in keys[1:3]:
        p = ps.work_paths(work, key)
        ps.reconstruct_shard(p["slice"], p["where"], src, p["part"], p["summary"], tok, fam)
    assert gather()["shards"] == first["shards"]


def test_the_records_digest_follows_the_records_not_the_order_of_the_lines(tmp_path):
    records = _records(60)
    src = tmp_path / "responses.jsonl"
    _write(src, records)
    plan = tp.plan_shards(src, tmp_path / "plan.json", tmp_path / "slices", "ds", 10)
    slices = b"".join((tmp_path / "slices" / f"{s['key']}.tsv").read_bytes() for s in plan["shards"])
    assert plan["source_records_sha256"] == hashlib.sha256(slices).hexdigest()
    _write(src, records[::-1])
    moved = tp.plan_shards(src, tmp_path / "plan.json", tmp_path / "slices", "ds", 10)
    assert moved["source_lines_xxh3_128"] != plan["source_lines_xxh3_128"]
    assert moved["source_records_sha256"] == plan["source_records_sha256"] and moved["slices_written"] == 0
    _write(src, records[:-1] + [dict(records[-1], cost=123.0)])
    changed = tp.plan_shards(src, tmp_path / "plan.json", tmp_path / "slices", "ds", 10)
    assert changed["source_records_sha256"] != plan["source_records_sha256"] and changed["slices_written"] == 1


@needs_recorded
@pytest.mark.workflow
def test_a_reorder_of_the_responses_reruns_only_the_plan_and_leaves_a_true_manifest(tmp_path):
    """Lines moved, no record changed: the plan reruns (the file changed), no shard, no gather, no
    validation (so no extraction either); the manifest's source digest, of the records in id order,
    is still the responses' own, and it names no file digest that is no longer true."""
    from test_workflow import _copy_repo, planned_jobs, snakemake

    work = _copy_repo(tmp_path / "w")
    records = _records(60)
    src = tmp_path / "responses.jsonl"
    _write(src, records)
    _import_config(work, src, K2)
    snakemake(work, "rec")
    manifest_path = work / "results/rec/tokens/manifest.json"
    validated = work / "results/rec/validation.json"
    stamps = (manifest_path.stat().st_mtime_ns, validated.stat().st_mtime_ns)
    first = json.loads(manifest_path.read_text())

    _write(src, records[::-1])
    snakemake(work, "results/rec/tokens.work/plan.json")
    assert planned_jobs(work, "rec") == {}  # nothing after the plan: no shard, no gather, no validation
    snakemake(work, "rec")
    assert (manifest_path.stat().st_mtime_ns, validated.stat().st_mtime_ns) == stamps
    plan = json.loads((work / "results/rec/tokens.work/plan.json").read_text())
    manifest = json.loads(manifest_path.read_text())
    assert plan["source_lines_xxh3_128"] == _lines_digest(work / "results/rec/responses.jsonl")
    assert "source_sha256" not in manifest  # never a stale file digest
    assert manifest["source_records_sha256"] == plan["source_records_sha256"] == first["source_records_sha256"]


@needs_recorded
@pytest.mark.workflow
def test_one_new_response_rebuilds_only_its_shard(tmp_path):
    """Real snakemake on an imported dataset of 300 responses in about 30 shards: adding one response
    reruns the plan, one token_shard job and what follows (the dataset's learning, judging and
    gathering job, validation); every other shard's reconstruction is up to date, its slice and part
    keep their bytes and mtimes, and its final shard in the store keeps its file. A setting that decides
    token ids, or an edit of the shard job's script, reruns every shard."""
    from test_workflow import _copy_repo, planned_jobs, snakemake

    work = _copy_repo(tmp_path / "w")
    records = _records(300)
    src = tmp_path / "responses.jsonl"
    _write(src, records)
    tok_dir = shutil.copytree(K2, tmp_path / "k2-tokenizer")
    config = _import_config(work, src, tok_dir)
    run = snakemake(work, "rec")
    assert planned_jobs(work, "rec") == {}
    plan = json.loads((work / "results/rec/tokens.work/plan.json").read_text())
    n_shards = len(plan["shards"])
    assert n_shards > 15
    # the shard jobs start largest first (their priority: the shard's rows); on 2 cores the jobs started
    # together are listed in either order, so each job has at least the rows of every job listed 2 later
    rows = {s["key"]: s["rows"] for s in plan["shards"]}
    started = [rows[k] for k in re.findall(r"rule token_shard:\n(?:[^\n]*\n)*?\s*wildcards: dataset=rec, shard=([0-9a-f]{16})",
                                           run.stdout + run.stderr)]
    assert len(started) == n_shards and len(set(started)) > 3, started
    assert all(started[i] >= max(started[i + 2:], default=0) for i in range(n_shards)), started
    parts = work / "results/rec/tokens.work/parts"
    before = {p.name: p.stat().st_mtime_ns for p in parts.glob("*.parquet")}
    store = work / "results/rec/tokens.store"
    stored = {p.name: p.stat().st_mtime_ns for p in store.glob("*.parquet")}
    _write(src, records + [dict(records[7], id=_new_id(records, 10))])
    snakemake(work, "results/rec/tokens.work/plan.json")  # import + the checkpoint (cheap, streams ids)
    jobs = planned_jobs(work, "rec")
    assert jobs.get("token_shard") == 1, jobs
    assert jobs.get("tokens") == 1 and "validate" in jobs, jobs
    assert set(jobs) == {"token_shard", "tokens", "validate", "rec"}, jobs  # "rec": the target rule
    snakemake(work, "rec")
    assert "judged in 2 process(es)" in (work / "logs/rec/tokens.log").read_text()  # the spawned workers
    after = {p.name: p.stat().st_mtime_ns for p in parts.glob("*.parquet")}
    assert sum(after[k] != before.get(k) for k in after) == 1
    kept = {k: t for k, t in ((p.name, p.stat().st_mtime_ns) for p in store.glob("*.parquet")) if stored.get(k) == t}
    assert len(kept) == n_shards - 1, (len(kept), n_shards)  # only the new response's shard has a new file
    report = json.loads((work / "results/rec/validation.json").read_text())
    assert report["counts"]["total"] == 301
    assert planned_jobs(work, "rec") == {}

    # a gather interrupted after Snakemake removed its directory() output: the next run rebuilds it
    # from the parts (a missing intermediate alone, validation.json up to date, reran nothing)
    shutil.rmtree(work / "results/rec/tokens")
    jobs = planned_jobs(work, "rec")
    assert jobs.get("tokens") == 1 and "token_shard" not in jobs, jobs
    snakemake(work, "rec")
    assert (work / "results/rec/tokens/manifest.json").exists() and planned_jobs(work, "rec") == {}

    # a config setting that decides token ids (here the model's family: one defined in the config, as
    # kimi-k2 under another name) reruns every shard's reconstruction; put back, nothing is to run
    shards_now = len(json.loads((work / "results/rec/tokens.work/plan.json").read_text())["shards"])
    changed = {**config, "families": {"k2-local": {"base": "kimi-k2"}},
               "models": {"k2": {**config["models"]["k2"], "family": "k2-local"}}}
    (work / "config/config.yaml").write_text(yaml.safe_dump(changed))
    jobs = planned_jobs(work, "rec")
    assert jobs.get("token_shard") == shards_now and jobs.get("tokens") == 1, jobs
    (work / "config/config.yaml").write_text(yaml.safe_dump(config))
    assert planned_jobs(work, "rec") == {}

    # the per-shard job's own script (a shell command: Snakemake does not track it as a script:) is stamped
    script = work / "scripts/token_shard.py"
    original = script.read_text()
    script.write_text(original + "\nEDITED = 1\n")
    assert planned_jobs(work, "rec").get("token_shard") == shards_now
    script.write_text(original)
    assert planned_jobs(work, "rec") == {}

    # the tokenizer counts by its files' content: touching the vocabulary (over the 1 MB up to which
    # Snakemake compares checksums) reruns nothing; a changed chat template reruns every shard
    vocab = tok_dir / "tiktoken.model"
    assert vocab.stat().st_size > 1_000_000
    later = time.time() + 5
    os.utime(vocab, (later, later))
    assert planned_jobs(work, "rec") == {}
    with open(tok_dir / "chat_template.jinja", "a") as fh:
        fh.write("{# edited #}")
    jobs = planned_jobs(work, "rec")
    assert jobs.get("token_shard") == shards_now and jobs.get("tokens") == 1, jobs


def _import_config(work, src, tokenizer) -> dict:
    """The work copy's config: one imported dataset ``rec`` of ``src`` (kimi-k2, ``tokenizer``), shards
    of 10, every sample let through validation, no extraction; returns it."""
    config = yaml.safe_load((work / "config/config.yaml").read_text())
    config["models"] = {"k2": {"family": "kimi-k2", "tokenizer": str(tokenizer)}}
    config["datasets"] = {"rec": {"responses": str(src), "model": "k2", "validation": {"max_bad_fraction": 1.0}}}
    config["tokens"] = {**(config.get("tokens") or {}), "shard_size": 10}
    config["extraction"] = {**config["extraction"], "enabled": False}
    (work / "config/config.yaml").write_text(yaml.safe_dump(config))
    return config


@needs_recorded
def test_streams_read_by_the_compiled_core_give_the_parts_of_the_python_reading(tmp_path, monkeypatch, caplog):
    """Long streamed answers (read through chunk templates) reconstruct to the same part, column for
    column, with the compiled core and without it; a job without it says so in its log."""
    from eagledata.standin.responses import json_body, sse_stream
    from eagledata.standin.server import SimulatorServer
    from eagledata.tokens import chunk_templates
    if not chunk_templates.native_stream_reading():
        pytest.skip("the compiled core is not built here")
    import polars as pl
    fam = get_family("kimi-k2")
    tok = load_tokenizer(K2, fam)
    server = SimulatorServer(tok, fam, seed=4, content_tokens=(150, 400), max_generations=1)
    requests = [json.loads(x)["request"] for x in RECORDED.read_text(encoding="utf-8").splitlines() if x.strip()]
    records = []
    for i in range(24):
        body = {**requests[(7 * i) % len(requests)], "max_tokens": 4000, "stream": i % 4 != 0}
        g = server.make_generation(body)
        raw = "".join(f"data: {p}\n\n" for p, _ in sse_stream(g)) if body["stream"] else json_body(g, "")
        records.append({"id": f"s{i:03d}", "request": body, "status": 200, "response_raw": raw})
    src = tmp_path / "responses.jsonl"
    _write(src, records)
    assert sum(r["response_raw"].count("\n\n") >= 80 for r in records) >= 12  # templated streams
    plan = tp.plan_shards(src, tmp_path / "plan.json", tmp_path / "slices", "ds", 1000)
    key = plan["shards"][0]["key"]
    paths = ps.work_paths(tmp_path, key)
    parts = {}
    for native in (True, False):
        if not native:
            monkeypatch.setattr(chunk_templates, "_NATIVE_MATCH", None)
        part = tmp_path / f"part-{native}.parquet"
        with caplog.at_level("INFO", logger="eagledata.tokens.pershard"):
            caplog.clear()
            ps.reconstruct_shard(paths["slice"], paths["where"], src, part, tmp_path / f"s-{native}.json", tok, fam)
        assert ("streams read in Python only" in caplog.text) is not native
        parts[native] = pl.read_parquet(part)
    assert parts[True].height == 24 and parts[True].equals(parts[False])


def _times_ten(x: int) -> int:
    if x < 0:
        raise ValueError(f"item {x}")
    return x * 10


@pytest.mark.timing
def test_work_shared_with_helpers_gives_every_result_in_order_and_raises_a_failure():
    """shared_map: the job's process takes the items from the last back (here 0.05 s each) while a
    spawned helper starts and takes them from the first (the others); every result comes back in order,
    whoever computed it; a failing item's exception is raised."""
    from eagledata.tokens.sharedwork import shared_map, spawned_pool
    done_here: list[int] = []

    def here(x: int) -> int:
        time.sleep(0.05)
        done_here.append(x)
        return _times_ten(x)

    items = list(range(200))
    with spawned_pool(1) as pool:
        assert shared_map(pool, _times_ten, here, items) == [x * 10 for x in items]
    # a run from the end, and not all of them: the helper (started within 10 s) did the others
    assert done_here and done_here == items[::-1][:len(done_here)] and len(done_here) < len(items)
    with spawned_pool(1) as pool:
        with pytest.raises(ValueError, match="item -1"):
            shared_map(pool, _times_ten, _times_ten, [0, 1, 2, -1])


def test_the_collector_paused_per_batch_still_collects_cycles_and_is_restored():
    """collected_per_batch: no automatic collection inside, a batch's reference cycles freed when the
    caller collects, what was alive on entry left out of those collections, the collector as before after."""
    import gc
    import weakref

    class Node:
        pass

    was_enabled = gc.isenabled()
    with ps.collected_per_batch() as collect:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        node = Node()
        node.self = node  # a cycle: only the cyclic collector frees it
        alive = weakref.ref(node)
        del node
        kept = [[] for _ in range(10_000)]  # enough allocations for automatic collections
        assert alive() is not None
        del kept
        collect()
        assert alive() is None
    assert gc.isenabled() == was_enabled and gc.get_freeze_count() == 0


def test_a_shard_jobs_priority_is_its_rows_read_from_the_plan_as_it_is_now(tmp_path):
    """plan_shard_rows (token_shard's priority): the shard's rows in the plan, read again when the plan
    changes; 0 for a shard not in it or no plan yet."""
    from eagledata.tokens.planfile import plan_keys, plan_shard_rows
    plan = tmp_path / "plan.json"
    assert plan_shard_rows(plan, "a" * 16) == 0
    plan.write_text(json.dumps({"shards": [{"key": "a" * 16, "rows": 7}, {"key": "b" * 16, "rows": 30}]}))
    assert plan_shard_rows(plan, "b" * 16) == 30 and plan_shard_rows(plan, "c" * 16) == 0
    assert plan_keys(plan) == ["a" * 16, "b" * 16]
    plan.write_text(json.dumps({"shards": [{"key": "b" * 16, "rows": 12345}]}))  # another size: re-read
    assert plan_shard_rows(plan, "b" * 16) == 12345 and plan_keys(plan) == ["b" * 16]


@needs_recorded
def test_a_shard_job_logs_where_its_time_went(tmp_path, caplog):
    """reconstruct_shard logs its samples, its time and that time by phase (records read and parsed,
    answers encoded, samples built and checked, part): the phases add up to the total."""
    fam = get_family("kimi-k2")
    tok = load_tokenizer(K2, fam)
    src = tmp_path / "responses.jsonl"
    _write(src, _records(40))
    plan = tp.plan_shards(src, tmp_path / "plan.json", tmp_path / "slices", "ds", 1000)
    key = plan["shards"][0]["key"]
    paths = ps.work_paths(tmp_path, key)
    with caplog.at_level("INFO", logger="eagledata.tokens.pershard"):
        ps.reconstruct_shard(paths["slice"], paths["where"], src, tmp_path / "p.parquet", tmp_path / "s.json", tok, fam)
    m = re.search(rf"shard {key}: 40 samples in ([\d.]+) s: (.*)", caplog.text)
    assert m, caplog.text
    phases = dict(p.rsplit(" ", 1) for p in m.group(2).split(", "))
    assert list(phases) == ["records read and parsed", "answers encoded", "samples built and checked", "part"]
    assert abs(sum(map(float, phases.values())) - float(m.group(1))) <= 0.02 + 1e-9  # each rounded to 0.01

"""Stable token shards (eagledata.tokens.shards): a sample's shard depends on its id, not its line;
shards whose content did not change are left untouched (same bytes, inode and mtime), also across a
Snakemake rerun that deletes the declared ``tokens/`` directory; verdicts do not depend on sharding."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import polars as pl
import pytest

from eagledata.demo import tokenizer as dt
from eagledata.errors import EagledataError, InputError
from eagledata.text.families import get_family
from eagledata.text.tokenizer import load_tokenizer
from eagledata.tokens import shards as sh
from eagledata.tokens.policy import PolicyError, resolve_policy
from eagledata.tokens.samples import tokenize_record
from eagledata.tokens.shards import (MAX_SHARD_FACTOR, ResponsesFileError, build_token_shards, is_boundary_id,
                                     read_shards, sha256_file, shard_groups)

FAMILY = get_family("kimi-k2.5")
MSGS = [{"role": "user", "content": "What is 2+3?"}]


# ----------------------------------------------------------------------------- the rule


def _diff(old: list[list[str]], new: list[list[str]]) -> tuple[set, set]:
    a, b = {tuple(g) for g in old}, {tuple(g) for g in new}
    return a - b, b - a


def test_shards_are_cut_by_id_hash_and_average_shard_size():
    ids = [f"p-{i:05d}" for i in range(4000)]
    groups = shard_groups(reversed(ids), 8)  # input order does not matter
    assert [x for g in groups for x in g] == sorted(ids)
    assert all(1 <= len(g) <= MAX_SHARD_FACTOR * 8 for g in groups)
    for prev, g in zip(groups, groups[1:]):
        assert is_boundary_id(g[0], 8) or len(prev) == MAX_SHARD_FACTOR * 8
        assert not any(is_boundary_id(x, 8) for x in g[1:])
    assert 6 <= len(ids) / len(groups) <= 10
    assert shard_groups([], 8) == [[]]
    assert all(len(g) == 1 for g in shard_groups(ids[:50], 1))
    with pytest.raises(InputError):
        shard_groups(ids, 0)


def test_hard_maximum_cuts_a_shard_without_boundaries():
    plain = [x for x in (f"x{i}" for i in range(2000)) if not is_boundary_id(x, 3)][:30]
    assert [len(g) for g in shard_groups(plain, 3)] == [12, 12, 6]


@pytest.mark.parametrize("new_id", ["a-top", "p-02000x", "z-end"])
def test_inserting_or_removing_one_id_changes_one_shard(new_id):
    ids = [f"p-{i:05d}" for i in range(4000)]
    old = shard_groups(ids, 8)
    new = shard_groups(ids + [new_id], 8)
    gone, added = _diff(old, new)
    assert len(gone) == 1 and len(added) == (2 if is_boundary_id(new_id, 8) else 1)
    assert new_id in {x for g in added for x in g}
    # removing one id: one shard changes (two merge when it was a boundary id)
    victim = ids[1234]
    gone, added = _diff(old, shard_groups([x for x in ids if x != victim], 8))
    assert len(added) == 1 and len(gone) == (2 if is_boundary_id(victim, 8) else 1)


def test_error_classes_share_the_base():
    assert issubclass(PolicyError, EagledataError) and issubclass(PolicyError, ValueError)
    assert issubclass(ResponsesFileError, EagledataError) and issubclass(ResponsesFileError, ValueError)
    with pytest.raises(EagledataError):
        resolve_policy("no-such-policy")


# ----------------------------------------------------------------------------- files left untouched


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = dt.build_demo_tokenizer(None, tmp_path_factory.mktemp("demo") / "tokenizer")
    return load_tokenizer(path, FAMILY)


def _record(tok, rid: str, content: str = " It is 5.") -> dict:
    msg = {"role": "assistant", "content": content, "reasoning": " Two plus three."}
    body = {"id": f"gen-{rid}", "provider": "Good AI", "model": "moonshotai/kimi-k2.5",
            "choices": [{"index": 0, "finish_reason": "stop", "message": msg}], "usage": {}}
    rec = {"id": rid, "request": {"model": "moonshotai/kimi-k2.5", "messages": MSGS}, "status": 200,
           "response_raw": json.dumps(body)}
    s = tokenize_record(rec, tok, FAMILY, rid)
    body["usage"] = {"prompt_tokens": len(s.prompt_ids), "completion_tokens": len(s.completion.ids)}
    rec["response_raw"] = json.dumps(body)
    return rec


def _write(path: Path, recs: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")


def _files(d: Path) -> dict[str, tuple[str, int, int]]:
    return {p.name: (sha256_file(p), p.stat().st_mtime_ns, p.stat().st_ino) for p in sorted(d.glob("shard-*.parquet"))}


def _run(tok, root: Path, recs: list[dict], shard_size: int = 4):
    """One tokens job as Snakemake runs it: the declared output directory is deleted first."""
    _write(root / "responses.jsonl", recs)
    shutil.rmtree(root / "tokens", ignore_errors=True)
    return build_token_shards(root / "responses.jsonl", root / "tokens", tok, FAMILY, "syn",
                              shard_size=shard_size, store_dir=root / "tokens.store")


def test_one_new_prompt_rewrites_only_its_shard(tok, tmp_path):
    recs = [_record(tok, f"s-{i:03d}", f" It is {i}.") for i in range(40)]
    first = _run(tok, tmp_path, recs)
    m1 = first.manifest
    assert len(m1["shards"]) >= 5 and first.kept == [] and len(first.written) == len(m1["shards"])
    assert m1["sharding"]["shard_size"] == 4 and m1["sharding"]["store"] == "../tokens.store"
    again = _run(tok, tmp_path, recs)  # nothing changed: nothing rewritten
    assert again.written == [] and again.manifest["shards"] == m1["shards"]

    for new_id, where in (("a-new", 0), ("s-019x", 20), ("z-new", len(recs))):
        assert not is_boundary_id(new_id, 4)  # else it splits a shard: two change
        before_store, before_out = _files(tmp_path / "tokens.store"), _files(tmp_path / "tokens")
        old_shards = json.loads((tmp_path / "tokens" / "manifest.json").read_text())["shards"]
        recs.insert(where, _record(tok, new_id, " It is new."))
        res = _run(tok, tmp_path, recs)
        shards = res.manifest["shards"]
        holder = [s["file"] for s in shards if s["first_id"] <= new_id <= s["last_id"]]
        assert res.written == holder and len(res.kept) == len(shards) - 1
        gone = {s["file"] for s in old_shards} - {s["file"] for s in shards}
        assert len(gone) == 1 and len(old_shards) == len(shards)
        after_store, after_out = _files(tmp_path / "tokens.store"), _files(tmp_path / "tokens")
        assert set(after_store) == set(after_out) == {s["file"] for s in shards}  # old file pruned
        for name in res.kept:  # same bytes, same inode, same mtime, in the store and in tokens/
            assert after_store[name] == before_store[name]
            assert after_out[name][:2] == before_out[name][:2] and after_out[name] == after_store[name]
        # downstream readers see every sample, in id order
        df = read_shards(tmp_path / "tokens", columns=["id", "verdict"])
        assert list(df["id"]) == sorted(r["id"] for r in recs) and set(df["verdict"]) == {"exact"}


def test_without_a_store_unchanged_shards_stay_in_out_dir(tok, tmp_path):
    recs = [_record(tok, f"s-{i:03d}") for i in range(20)]
    _write(tmp_path / "r.jsonl", recs)
    build_token_shards(tmp_path / "r.jsonl", tmp_path / "t", tok, FAMILY, "syn", shard_size=4)
    before = _files(tmp_path / "t")
    _write(tmp_path / "r.jsonl", recs + [_record(tok, "z-new")])
    res = build_token_shards(tmp_path / "r.jsonl", tmp_path / "t", tok, FAMILY, "syn", shard_size=4)
    after = _files(tmp_path / "t")
    assert len(res.written) == 1 and set(after) == {s["file"] for s in res.manifest["shards"]}
    assert all(after[n] == before[n] for n in res.kept) and res.manifest["sharding"]["store"] is None


def test_copies_keep_mtime_where_links_fail(tok, tmp_path, monkeypatch):
    def no_link(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(sh.os, "link", no_link)
    res = _run(tok, tmp_path, [_record(tok, f"s-{i:03d}") for i in range(12)])
    store, out = _files(tmp_path / "tokens.store"), _files(tmp_path / "tokens")
    assert set(out) == {s["file"] for s in res.manifest["shards"]}
    assert all(out[n][:2] == store[n][:2] and out[n][2] != store[n][2] for n in out)


def test_a_changed_convention_legitimately_rewrites_other_shards(tok, tmp_path):
    """Conventions are learned over the whole dataset: new samples that flip the provider's count
    convention change verdicts (and so files) in shards that did not get a sample."""
    recs = [_record(tok, f"s-{i:03d}") for i in range(16)]
    first = _run(tok, tmp_path, recs)
    assert first.manifest["conventions"]["Good AI"]["convention"] == "counts_eot"
    extra = []
    for i in range(40):  # a majority billed without <|im_end|>: the provider now "excludes_eot"
        r = _record(tok, f"t-{i:03d}")
        body = json.loads(r["response_raw"])
        body["usage"]["completion_tokens"] -= 1
        r["response_raw"] = json.dumps(body)
        extra.append(r)
    res = _run(tok, tmp_path, recs + extra)
    assert res.manifest["conventions"]["Good AI"]["convention"] == "excludes_eot"
    old_files = {s["file"] for s in first.manifest["shards"]}
    assert not old_files & set(res.kept)  # every old shard's verdicts changed


# ----------------------------------------------------------------------------- verdicts unchanged


def _per_id(tokens_dir: Path) -> dict[str, dict]:
    df = read_shards(tokens_dir)
    return {row.pop("id"): row for row in df.iter_rows(named=True)}


def test_verdicts_do_not_depend_on_sharding(k2, recorded, tmp_path, monkeypatch):
    """On the recorded K2 traffic: every column of every sample (verdicts, reasons, input_ids, counts,
    repairs) and the learned conventions are the same with one shard, with id-hashed shards of 4, and
    with the old layout (file order, cut every shard_size lines)."""
    tok, fam = k2
    path = tmp_path / "rec.jsonl"
    _write(path, recorded)
    single = build_token_shards(path, tmp_path / "single", tok, fam, "recorded", shard_size=10**9)
    small = build_token_shards(path, tmp_path / "small", tok, fam, "recorded", shard_size=4)
    assert len(single.manifest["shards"]) == 1 and len(small.manifest["shards"]) > 20
    monkeypatch.setattr(sh, "shard_groups", lambda ids, n: [list(ids)[i:i + n] for i in range(0, len(ids), n)] or [[]])
    by_line = build_token_shards(path, tmp_path / "by_line", tok, fam, "recorded", shard_size=7)
    assert [s["rows"] for s in by_line.manifest["shards"]][:2] == [7, 7]
    want = _per_id(tmp_path / "single")
    assert len(want) == len(recorded)
    assert {r["verdict"] for r in want.values()} >= {"exact", "mismatch"}
    for d, res in (("small", small), ("by_line", by_line)):
        assert _per_id(tmp_path / d) == want, d
        assert res.manifest["conventions"] == single.manifest["conventions"]
        assert [st.provider for st in res.stats] == [st.provider for st in single.stats]


def test_reason_lists_are_built_as_polars_builds_them():
    """few_distinct_lists (the verdicts' reasons column) equals polars' own construction of the same lists,
    empty lists and empty input included."""
    import random

    import polars as pl

    from eagledata.tokens.shards import few_distinct_lists

    rng = random.Random(7)
    codes = ["completion_count_mismatch", "tool_id_rebuilt", "prompt_count_mismatch", "whitespace_restored"]
    cases = [[], [[]], [[]] * 3, [["a"], [], ["a", "b"], ["b", "a"], ["a"]]]
    cases.append([rng.sample(codes, rng.randint(0, 3)) for _ in range(300)])
    for lists in cases:
        built = few_distinct_lists("reasons", lists)
        assert built.equals(pl.Series("reasons", lists, dtype=pl.List(pl.Utf8)))
        assert built.to_list() == lists and built.name == "reasons"

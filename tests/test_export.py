"""Exports read back the way each trainer reads them (SpecForge: walk a directory for *.ckpt and
torch.load each; vLLM speculators: safetensors load_file of hidden_states/hs_{i}.safetensors),
checked for shapes, dtypes and values against our hidden-state shards."""
from __future__ import annotations

import json
import os
from pathlib import Path

import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from eagledata.export import trainers as xp
from eagledata.extract import core as ex
from eagledata.extract.base import ExtractionError
from eagledata.extract.storage import read_index
from eagledata.demo.model import build_demo_model

from test_extract import VOCAB, make_rows, write_tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("export")
    weights = build_demo_model(root / "model", VOCAB, seed=0)
    model = ex.load_model(weights, device="cpu")
    rows = [make_rows(11, 7, "x"), make_rows(12, 6, "y")]
    tokens = write_tokens(root / "tokens", rows)
    after = root / "hidden-after"
    before = root / "hidden-before"
    ex.extract_dataset(tokens, after, weights, dtype="bfloat16", device="cpu", batch_tokens=120, model=model)
    ex.extract_dataset(tokens, before, weights, final_norm="before", dtype="float32", device="cpu", model=model)
    train = [r for shard in rows for r in shard if r["train"]]
    return {"root": root, "after": after, "before": before, "train": train}


def _ours(hidden):
    """sample id -> (input_ids, loss_mask, aux, final) straight from our shards."""
    idx = read_index(hidden)
    shards = {name: load_file(hidden / name) for name in idx["shard"].unique().to_list()}
    out = {}
    for row in idx.iter_rows(named=True):
        t = shards[row["shard"]]
        a, b = row["offset"], row["offset"] + row["length"]
        out[row["id"]] = (t["input_ids"][a:b], t["loss_mask"][a:b], t["aux_hidden_states"][a:b], t["hidden_state"][a:b])
    return out


def test_specforge_export_read_back_like_specforge(setup, tmp_path):
    out = tmp_path / "specforge"
    meta = xp.export_specforge(setup["after"], out, group_size=4, work_dir=tmp_path / ".specforge.partial")
    assert not (tmp_path / ".specforge.partial").exists()
    n = len(setup["train"])
    assert meta["samples"] == n and meta["final_norm"] == "after" and meta["group_size"] == 4
    # SpecForge: walk the directory for *.ckpt, torch.load each
    files = sorted(Path(r) / f for r, _, fs in os.walk(out) for f in fs if f.endswith(".ckpt"))
    assert len(files) == n
    groups = sorted({p.parent.name for p in files}, key=lambda s: int(s.split("_")[1].split("-")[0]))
    assert groups == ["rows_0-4", "rows_4-8", f"rows_8-{n}"]  # 2000 in production; last group truncated as SpecForge names it
    mapping = pl.read_parquet(out / "mapping.parquet")
    assert mapping["id"].to_list() == [r["id"] for r in setup["train"]]
    ours = _ours(setup["after"])
    for row in mapping.iter_rows(named=True):
        assert row["file"] == f"rows_{row['sample'] // 4 * 4}-{min(row['sample'] // 4 * 4 + 4, n)}/data_{row['sample']}.ckpt"
        d = torch.load(out / row["file"], weights_only=True)
        assert set(d) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        ids, mask, aux, final = ours[row["id"]]
        t = ids.shape[0]
        assert d["input_ids"].dtype == torch.int64 and d["input_ids"].shape == (t,)
        assert d["loss_mask"].dtype == torch.int64 and d["loss_mask"].shape == (t,)
        assert d["hidden_state"].shape == (1, t, 64) and d["hidden_state"].dtype == torch.bfloat16
        assert d["aux_hidden_state"].shape == (1, t, 3 * 64) and d["aux_hidden_state"].dtype == torch.bfloat16
        assert torch.equal(d["input_ids"], ids) and torch.equal(d["loss_mask"], mask.long())
        src = next(r for r in setup["train"] if r["id"] == row["id"])
        assert d["input_ids"].tolist() == src["input_ids"] and int(d["loss_mask"].sum()) == src["completion_len"]
        assert torch.equal(d["hidden_state"][0], final)
        # SpecForge's aux: torch.cat((layer_a, layer_b, layer_c), dim=-1)
        assert torch.equal(d["aux_hidden_state"][0], torch.cat([aux[:, 0], aux[:, 1], aux[:, 2]], dim=-1))
        assert os.path.getsize(out / row["file"]) < 4 * t * 4 * 64 * 2 + 4096  # a copy of the sample, not of the shard
    assert json.loads((out / "export.json").read_text())["specforge_aux_hidden_states_layers"] == [1, 3, 4]


def test_speculators_export_read_back_like_speculators(setup, tmp_path):
    out = tmp_path / "speculators"
    meta = xp.export_speculators(setup["before"], out)
    n = len(setup["train"])
    assert meta["samples"] == n and meta["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5, 8]
    mapping = pl.read_parquet(out / "mapping.parquet")
    ours = _ours(setup["before"])
    for row in mapping.iter_rows(named=True):
        assert row["file"] == f"hidden_states/hs_{row['sample']}.safetensors"
        loaded = load_file(out / "hidden_states" / f"hs_{row['sample']}.safetensors")  # speculators FileTransfer
        assert set(loaded) == {"token_ids", "hidden_states"}
        ids, mask, aux, final = ours[row["id"]]
        t = ids.shape[0]
        assert loaded["token_ids"].dtype == torch.int64 and torch.equal(loaded["token_ids"], ids)
        assert loaded["hidden_states"].shape == (t, 4, 64) and loaded["hidden_states"].dtype == torch.float32
        # speculators: aux = hidden_states[:, :-1].flatten(1); verifier last = hidden_states[:, -1]
        assert torch.equal(loaded["hidden_states"][:, :-1].flatten(1), aux.flatten(1))
        assert torch.equal(loaded["hidden_states"][:, -1], final)
        assert row["input_ids"] == ids.tolist() and row["seq_len"] == t
        assert row["loss_mask"] == mask.tolist()


def test_exports_refuse_the_wrong_final_norm(setup, tmp_path):
    with pytest.raises(ExtractionError, match="SpecForge export needs the final hidden state AFTER"):
        xp.export_specforge(setup["before"], tmp_path / "a")
    with pytest.raises(ExtractionError, match="speculators export needs the final hidden state BEFORE"):
        xp.export_speculators(setup["after"], tmp_path / "b")


def test_interrupted_export_resumes(setup, tmp_path, monkeypatch):
    out, work = tmp_path / "sf", tmp_path / ".sf.partial"
    real_save, calls = torch.save, []

    def flaky(obj, f, *a, **k):
        calls.append(f)
        if len(calls) == 4:
            raise OSError("disk went away")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", flaky)
    with pytest.raises(OSError):
        xp.export_specforge(setup["after"], out, work_dir=work)
    assert not out.exists()
    done = {p: p.stat().st_mtime_ns for p in work.rglob("*.ckpt")}
    assert len(done) == 3 and not list(work.rglob("*.tmp-*"))
    monkeypatch.setattr(torch, "save", real_save)
    xp.export_specforge(setup["after"], out, work_dir=work)
    for p, mtime in done.items():
        assert (out / p.relative_to(work)).stat().st_mtime_ns == mtime  # kept, not rewritten
    assert len(list(out.rglob("*.ckpt"))) == len(setup["train"])

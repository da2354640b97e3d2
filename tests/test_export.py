"""Both exports from ONE extraction, read back through each trainer's loading contract.

Neither trainer is installed here (``import specforge`` / ``import speculators`` fail), so each
test re-implements the loading code of the release named in shared/BRIEF.md, read from their source:

* SpecForge a6b6b02: ``runtime/data_plane/offline_reader.list_feature_files`` (os.walk, every
  ``*.ckpt`` / ``*.ckpt.gz``, sorted), ``feature_store.load_feature_file`` (``torch.load(path,
  weights_only=False, mmap=True)``), ``algorithms/eagle3/data.normalize_offline_sample`` (keys
  mapped, cut at max_len, last loss-mask position zeroed), its bf16 target head applied to
  ``target``, and ``modeling/draft/base.load_vocab_mapping`` (``torch.load`` then ``t2d``/``d2t``
  buffers ``copy_``);
* speculators c05b95b: ``train/data.ArrowDataset`` (``datasets.load_from_disk``, ``seq_len`` read
  with ``with_format(None)``, ``FileTransfer`` = ``load_file(hidden_states/hs_{i}.safetensors)``,
  ``torch.equal(token_ids, input_ids)``, ``hidden_states[:, :-1].flatten(1)`` / ``[:, -1]``),
  ``data_generation/offline.check_hidden_states``, and ``scripts/train.py`` (``np.load`` of
  ``d2t.npy`` / ``t2d.npy`` from the data path; ``token_freq.pt`` with ``weights_only=True`` and
  ``build_vocab_mappings_from_distribution``).

The pre-norm -> post-norm derivation is checked against the real transformers DeepseekV3 class
(tiny random weights): its own ``output_hidden_states[-1]`` is the final norm's output.
"""
from __future__ import annotations

import os
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eagledata.export import trainers as xp
from eagledata.export.vocab import build_mapping
from eagledata.extract import core as ex
from eagledata.extract.base import ExtractionError
from eagledata.extract.norm import apply_final_norm
from eagledata.extract.storage import read_index
from eagledata.demo.model import build_demo_model

from test_extract import VOCAB, make_rows, write_tokens

pytestmark = pytest.mark.xdist_group("export_setup")  # one worker builds the module's model and exports


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("export")
    weights = build_demo_model(root / "model", VOCAB, seed=0)
    model = ex.load_model(weights, device="cpu")
    rows = [make_rows(11, 7, "x"), make_rows(12, 6, "y")]
    tokens = write_tokens(root / "tokens", rows)
    hidden = root / "hidden"
    ex.extract_dataset(tokens, hidden, weights, dtype="float32", device="cpu", batch_tokens=120, model=model)
    sf = xp.export_specforge(hidden, root / "export" / "specforge", group_size=4, draft_vocab_size=40,
                             work_dir=root / "export" / ".specforge.partial")
    sp = xp.export_speculators(hidden, root / "export" / "speculators", draft_vocab_size=40)
    return {"root": root, "hidden": hidden, "model": model, "sf": sf, "sp": sp, "weights": weights}


def _ours(hidden):
    """sample index -> (id, input_ids, loss_mask, aux, final before the norm) from our shards."""
    idx = read_index(hidden)
    shards = {name: load_file(hidden / name) for name in idx["shard"].unique().to_list()}
    out = {}
    for row in idx.iter_rows(named=True):
        t = shards[row["shard"]]
        a, b = row["offset"], row["offset"] + row["length"]
        out[row["sample"]] = (row["id"], t["input_ids"][a:b], t["loss_mask"][a:b], t["aux_hidden_states"][a:b],
                              t["hidden_state"][a:b])
    return out


# --------------------------------------------------------------------------- SpecForge's contract


def specforge_list_feature_files(path):
    files = []
    for root, _dirs, names in os.walk(path):
        files += [os.path.abspath(os.path.join(root, n)) for n in names if n.endswith((".ckpt", ".ckpt.gz"))]
    return sorted(files)


def specforge_normalize_offline_sample(raw, max_len):
    hidden_state = raw["aux_hidden_state"].squeeze(0)[:max_len].unsqueeze(0)
    target = raw["hidden_state"].squeeze(0)[:max_len].unsqueeze(0)
    input_ids = raw["input_ids"][:max_len].unsqueeze(0)
    loss_mask = raw["loss_mask"][:max_len].clone().unsqueeze(0)
    if loss_mask.numel() > 0:
        loss_mask[0, -1] = 0
    return {"attention_mask": torch.ones_like(loss_mask, dtype=torch.long), "loss_mask": loss_mask,
            "target": target, "hidden_state": hidden_state, "input_ids": input_ids}


def test_specforge_export_through_its_reader(setup):
    out = setup["root"] / "export" / "specforge"
    meta, ours = setup["sf"], _ours(setup["hidden"])
    n = len(ours)
    assert meta["samples"] == n and meta["dtype"] == "bfloat16" and meta["source_dtype"] == "float32"
    assert not (setup["root"] / "export" / ".specforge.partial").exists()
    files = specforge_list_feature_files(out)
    assert len(files) == n  # vocab_mapping.pt is not a feature file
    head = torch.nn.Linear(64, VOCAB, bias=False, dtype=torch.bfloat16)  # SpecForge's target head is bf16
    mapping = _mapping(out)
    by_path = {str((out / f).resolve()): (s, sh) for s, f, sh in zip(mapping["sample"], mapping["file"], mapping["shard"])}
    eps = meta["source_final_norm"]["eps"]
    for path in files:
        raw = torch.load(path, weights_only=False, mmap=True)
        assert set(raw) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        sample_index, shard = by_path[path]
        _id, ids, mask, aux, final = ours[sample_index]
        t = ids.numel()
        assert raw["input_ids"].dtype == raw["loss_mask"].dtype == torch.int64
        assert raw["hidden_state"].dtype == raw["aux_hidden_state"].dtype == torch.bfloat16
        assert raw["hidden_state"].shape == (1, t, 64) and raw["aux_hidden_state"].shape == (1, t, 3 * 64)
        sample = specforge_normalize_offline_sample(raw, max_len=2048)
        logits = head(sample["target"])  # float32 files failed here ("mat1 and mat2 must have the same dtype")
        assert logits.shape == (1, t, VOCAB) and torch.isfinite(logits.float()).all()
        assert torch.equal(raw["input_ids"], ids) and torch.equal(raw["loss_mask"], mask.long())
        assert torch.equal(sample["hidden_state"][0], aux.reshape(t, 3 * 64).to(torch.bfloat16))
        norm = load_file(setup["hidden"] / shard)["final_norm_weight"]
        assert torch.equal(sample["target"][0], apply_final_norm(final, norm, eps, torch.bfloat16))
    with pytest.raises(RuntimeError):  # why the dtype matters: a float32 target does not pass the head
        head(torch.zeros(1, 2, 64))


def _mapping(out):
    import polars as pl

    return pl.read_parquet(out / "mapping.parquet").to_dict(as_series=False)


def test_post_norm_state_matches_the_deepseek_v3_model(setup):
    """SpecForge's hidden_state, derived from the stored pre-norm state and the stored norm, equals
    the real DeepseekV3 model's own output_hidden_states[-1] (its final norm's output)."""
    model, out = setup["model"], setup["root"] / "export" / "specforge"
    ours, mapping = _ours(setup["hidden"]), _mapping(out)
    shard = load_file(setup["hidden"] / mapping["shard"][0])
    assert model.config.model_type == "deepseek_v3"
    for s, rel in list(zip(mapping["sample"], mapping["file"]))[:6]:
        _id, ids, _mask, _aux, final = ours[s]
        with torch.inference_mode():
            want = model.model(input_ids=ids[None], output_hidden_states=True).hidden_states[-1][0]
        derived = apply_final_norm(final, shard["final_norm_weight"], model.config.rms_norm_eps)
        torch.testing.assert_close(derived, want, rtol=1e-5, atol=1e-5)  # float32: exact up to rounding
        got = torch.load(out / rel, weights_only=False)["hidden_state"][0]
        torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2)  # the bf16 file
        assert not torch.allclose(final, want, atol=1e-2)  # the stored state really is before the norm


def test_specforge_vocab_mapping_loads_into_draft_buffers(setup):
    out = setup["root"] / "export" / "specforge"
    meta = setup["sf"]
    assert meta["vocab_mapping"] == "vocab_mapping/vocab_mapping.pt" and meta["draft_vocab_size"] == 40
    mapping = torch.load(out / meta["vocab_mapping"])  # SpecForge: torch.load(file_path), no weights_only
    d2t_buf, t2d_buf = torch.zeros(40, dtype=torch.long), torch.ones(VOCAB, dtype=torch.bool)
    t2d_buf.copy_(mapping["t2d"])
    d2t_buf.copy_(mapping["d2t"])
    assert mapping["d2t"].dtype == torch.int64 and mapping["t2d"].dtype == torch.bool
    assert int(t2d_buf.sum()) == 40
    selected = (torch.arange(40) + d2t_buf).tolist()
    assert selected == sorted(selected) and torch.nonzero(t2d_buf).flatten().tolist() == selected
    # the most frequent completion tokens
    counts = torch.zeros(VOCAB, dtype=torch.long)
    for _id, ids, mask, _a, _f in _ours(setup["hidden"]).values():
        counts += torch.bincount(ids[mask.bool()], minlength=VOCAB)
    top = sorted(range(VOCAB), key=lambda t: (-int(counts[t]), t))[:40]
    assert sorted(top) == selected


# --------------------------------------------------------------------------- speculators' contract


def speculators_check_hidden_states(data, tokens):
    assert {"token_ids", "hidden_states"} <= data.keys()
    assert data["token_ids"].tolist() == tokens
    assert data["hidden_states"].shape[0] == len(tokens)
    assert torch.isfinite(data["hidden_states"]).all()


def test_speculators_export_through_its_arrow_dataset(setup):
    out = setup["root"] / "export" / "speculators"
    meta, ours = setup["sp"], _ours(setup["hidden"])
    assert meta["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # the 3 aux layers (vLLM ids), not the final
    assert meta["dtype"] == "bfloat16"
    data = datasets.load_from_disk(str(out))  # ArrowDataset.__init__
    assert len(data) == len(ours)
    assert list(data.with_format(None)["seq_len"]) == [ours[i][1].numel() for i in range(len(ours))]
    for i in range(len(data)):
        row = data[i]
        assert isinstance(row["input_ids"], torch.Tensor) and isinstance(row["loss_mask"], torch.Tensor)
        loaded = load_file(out / "hidden_states" / f"hs_{i}.safetensors")  # FileTransfer.get_cached(i)
        speculators_check_hidden_states(loaded, row["input_ids"].tolist())
        assert torch.equal(loaded["token_ids"], row["input_ids"])  # else ArrowDataset drops the sample
        sample = {"hidden_states": loaded["hidden_states"][:, :-1].flatten(1), "input_ids": loaded["token_ids"],
                  "verifier_last_hidden_states": loaded["hidden_states"][:, -1], "loss_mask": row["loss_mask"]}
        _id, ids, mask, aux, final = ours[i]
        t = ids.numel()
        assert loaded["hidden_states"].dtype == torch.bfloat16 and loaded["hidden_states"].shape == (t, 4, 64)
        assert torch.equal(sample["hidden_states"], aux.reshape(t, 3 * 64).to(torch.bfloat16))
        assert torch.equal(sample["verifier_last_hidden_states"], final.to(torch.bfloat16))  # before the norm
        assert torch.equal(sample["loss_mask"], mask.long()) and int(row["seq_len"]) == t


def test_speculators_vocab_files_load_as_its_train_script_loads_them(setup):
    out = setup["root"] / "export" / "speculators"
    d2t, t2d = torch.from_numpy(np.load(out / "d2t.npy")), torch.from_numpy(np.load(out / "t2d.npy"))
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and d2t.shape == (40,) and t2d.shape == (VOCAB,)
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    assert all(isinstance(k, int) and isinstance(v, int) for k, v in freq.items())
    # speculators' build_vocab_mappings_from_distribution over token_freq.pt gives the same mapping
    ordered = sorted(freq, key=lambda t: (-freq[t], t))[:40]
    ordered += [t for t in range(40) if t not in ordered][: 40 - len(ordered)]
    ordered.sort()
    assert (torch.tensor(ordered) - torch.arange(40)).tolist() == d2t.tolist()
    assert torch.nonzero(t2d).flatten().tolist() == ordered
    sf = torch.load(setup["root"] / "export" / "specforge" / "vocab_mapping" / "vocab_mapping.pt")
    assert torch.equal(sf["d2t"], d2t) and torch.equal(sf["t2d"], t2d)  # one mapping for both trainers
    # release 0.9.0's train CLI (parse_vocab_mappings) looks for d2t-{D}.npy / t2d-{D}.npy, D its --draft-vocab-size
    assert np.array_equal(np.load(out / "d2t-40.npy"), d2t.numpy()) and np.array_equal(np.load(out / "t2d-40.npy"), t2d.numpy())


def test_speculators_hidden_files_are_readable_as_the_umask_allows(setup):
    """safetensors creates its files 0600; a trainer run by another user must read them as it reads the
    rest of the export (mode 0o666 & ~umask, as open() gives)."""
    out = setup["root"] / "export" / "speculators"
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.stat().st_mode & 0o777 for p in (out / "hidden_states").glob("hs_*.safetensors")}
    assert modes == {0o666 & ~mask} == {(out / "dataset_info.json").stat().st_mode & 0o777}


def test_build_mapping_pads_like_the_trainers():
    counts = torch.zeros(10, dtype=torch.long)
    counts[7], counts[3] = 5, 2
    d2t, t2d = build_mapping(counts, 4)
    assert (torch.arange(4) + d2t).tolist() == [0, 1, 3, 7]  # seen ids first, then the smallest unseen
    assert t2d.tolist() == [i in (0, 1, 3, 7) for i in range(10)]
    with pytest.raises(ExtractionError, match="draft_vocab_size"):
        build_mapping(counts, 11)


# --------------------------------------------------------------------------- per shard, incremental


def test_exports_rewrite_only_changed_shards(setup, tmp_path, monkeypatch):
    hidden = setup["hidden"]
    out, store = tmp_path / "specforge", tmp_path / "specforge.store"
    first = xp.export_specforge(hidden, out, store_dir=store)
    assert first["shards_written"] == 2
    entries = sorted(store.iterdir())
    stamp = {p: p.stat().st_mtime_ns for e in entries for p in e.iterdir()}
    again = xp.export_specforge(hidden, out, store_dir=store)
    assert again["shards_written"] == 0 and sorted(store.iterdir()) == entries
    assert {p: p.stat().st_mtime_ns for p in stamp} == stamp
    assert len(specforge_list_feature_files(out)) == first["samples"]
    # a changed setting (dtype) is another entry; the old ones are pruned
    f32 = xp.export_specforge(hidden, out, store_dir=store, dtype="float32")
    assert f32["shards_written"] == 2 and not set(entries) & set(store.iterdir())
    # another version of the code (the workflow passes its code stamp's digest) writes its own entries:
    # files older code wrote are never reused
    f32_entries = sorted(store.iterdir())
    v2 = xp.export_specforge(hidden, out, store_dir=store, dtype="float32", code_version="v2")
    assert v2["shards_written"] == 2 and not set(f32_entries) & set(store.iterdir())
    assert xp.export_speculators(hidden, tmp_path / "sp", store_dir=tmp_path / "sp.store", code_version="v2")["shards_written"] == 2
    assert xp.export_speculators(hidden, tmp_path / "sp", store_dir=tmp_path / "sp.store", code_version="v2")["shards_written"] == 0
    assert xp.export_speculators(hidden, tmp_path / "sp", store_dir=tmp_path / "sp.store", code_version="v3")["shards_written"] == 2
    # an export killed in the second shard keeps the first shard's entry for the next run
    from eagledata.export import specforge as sfm

    real, calls = sfm.specforge_sample, {"n": 0}

    def dies(*a, **k):
        calls["n"] += 1
        if calls["n"] > len(_ours(hidden)) - 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(sfm, "specforge_sample", dies)
    with pytest.raises(KeyboardInterrupt):
        xp.export_specforge(hidden, out, store_dir=store)
    monkeypatch.setattr(sfm, "specforge_sample", real)
    assert xp.export_specforge(hidden, out, store_dir=store)["shards_written"] == 1


def test_exports_refuse_old_format_and_bad_dtype(setup, tmp_path):
    import json
    import shutil

    old = tmp_path / "old"
    shutil.copytree(setup["hidden"], old)
    m = json.loads((old / "manifest.json").read_text())
    m["format"] = "eagledata-hidden/1"
    (old / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ExtractionError, match="rerun the extraction"):
        xp.export_speculators(old, tmp_path / "a")
    with pytest.raises(ExtractionError, match="export.specforge_dtype"):
        xp.export_specforge(setup["hidden"], tmp_path / "b", dtype="int8")


def test_exports_of_an_fp8_extraction_are_bf16(setup, tmp_path):
    """An FP8 extraction (extraction.dtype float8_e4m3fn, per-token scales) exports in the trainer's
    bf16: each value is the dequantized FP8 value (fp8 * scale, float32) cast to bf16; the SpecForge
    target is the norm applied to the dequantized pre-norm state."""
    from eagledata.extract.fp8 import dequantize

    tokens = write_tokens(tmp_path / "tokens", [make_rows(11, 7, "x"), make_rows(12, 6, "y")])
    hidden = tmp_path / "hidden"
    ex.extract_dataset(tokens, hidden, setup["weights"], dtype="float8_e4m3fn", device="cpu", batch_tokens=120,
                       model=setup["model"])
    sf = xp.export_specforge(hidden, tmp_path / "specforge", draft_vocab_size=40)
    sp = xp.export_speculators(hidden, tmp_path / "speculators", draft_vocab_size=40)
    assert sf["source_dtype"] == sp["source_dtype"] == "float8_e4m3fn" and sf["dtype"] == sp["dtype"] == "bfloat16"
    idx = read_index(hidden)
    data = datasets.load_from_disk(str(tmp_path / "speculators"))
    mapping = _mapping(tmp_path / "specforge")
    files = dict(zip(mapping["sample"], mapping["file"]))
    for row in idx.iter_rows(named=True):
        t = load_file(hidden / row["shard"])
        a, b = row["offset"], row["offset"] + row["length"]
        aux = dequantize(t["aux_hidden_states"][a:b], t["aux_hidden_states_scale"][a:b])
        final = dequantize(t["hidden_state"][a:b], t["hidden_state_scale"][a:b])
        loaded = load_file(tmp_path / "speculators" / "hidden_states" / f"hs_{row['sample']}.safetensors")
        assert loaded["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(loaded["hidden_states"][:, :-1], aux.to(torch.bfloat16))
        assert torch.equal(loaded["hidden_states"][:, -1], final.to(torch.bfloat16))
        assert torch.equal(loaded["token_ids"], data[row["sample"]]["input_ids"])
        raw = torch.load(tmp_path / "specforge" / files[row["sample"]], weights_only=False)
        assert raw["hidden_state"].dtype == raw["aux_hidden_state"].dtype == torch.bfloat16
        assert torch.equal(raw["aux_hidden_state"][0], aux.reshape(b - a, -1).to(torch.bfloat16))
        eps = sf["source_final_norm"]["eps"]
        assert torch.equal(raw["hidden_state"][0], apply_final_norm(final, t["final_norm_weight"], eps, torch.bfloat16))


def test_a_stores_replaced_entries_are_kept_most_recent_first_and_taken_back(tmp_path):
    """An export's per-shard store with export.keep_replaced_gb: an entry no shard uses is moved to
    replaced/ (not removed), taken back without being written again when its shard returns, the most
    recently replaced kept first up to the cap; a cap of 0 removes them."""
    import time

    from eagledata.export.common import HiddenShard, ShardStore

    shards = [HiddenShard(f"shard-{k}.safetensors", f"{k:064x}", None, []) for k in range(3)]
    written = []

    def write(d):
        written.append(d.name)
        (d / "data.bin").write_bytes(b"x" * 1000)

    def run(current, cap):
        store = ShardStore(tmp_path / "s.store", "speculators", {"dtype": "bfloat16"}, cap)
        for shard in current:
            store.ensure(shard, write)
        store.prune()
        return store

    store = run(shards, 1 << 30)
    names = [store.entry(s).name for s in shards]
    assert written == names
    run(shards[1:], 1 << 30)  # shard 0 replaced first...
    time.sleep(0.05)  # (file times advance by the kernel's clock tick)
    run(shards[2:], 1 << 30)  # ... then shard 1
    assert sorted(p.name for p in store.replaced.iterdir()) == sorted(names[:2])
    run(shards[2:], 1500)  # room for one: the most recently replaced
    assert [p.name for p in store.replaced.iterdir()] == [names[1]]
    written.clear()
    run(shards[1:], 1500)  # shard 1 back: taken, not written
    assert written == [] and (store.root / names[1] / ".done").exists() and not any(store.replaced.iterdir())
    run(shards[2:], 0)  # no cap: removed
    assert not (store.root / names[1]).exists() and not any(store.replaced.iterdir())
    # an entry a killed removal left with its .done but not all its files is neither reused nor taken
    # back: it is written again
    run(shards[1:], 1 << 30)
    run(shards[2:], 1 << 30)
    (store.replaced / names[1] / "data.bin").unlink()
    (store.root / names[2] / "data.bin").unlink()
    written.clear()
    run(shards[1:], 1 << 30)
    assert written == names[1:] and all((store.root / n / "data.bin").stat().st_size == 1000 for n in names[1:])

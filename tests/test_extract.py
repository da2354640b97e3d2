"""Hidden-state extraction (eagledata.extract.core) and the tiny demo model (eagledata.demo.model).

The layer-index tests compare against forward hooks on every decoder layer of the real
transformers DeepseekV3 class (random weights), because an off-by-one there silently trains a
drafter on the wrong layer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagledata.extract import core as ex
from eagledata.extract.base import ExtractionError
from eagledata.extract.hf import HFBackend, as_backend, find_decoder, forward_hidden
from eagledata.extract.layers import default_layers, resolve_layers
from eagledata.extract.storage import estimate_shard_bytes, read_index
from eagledata.demo.model import build_demo_model, demo_config

pytestmark = pytest.mark.xdist_group("extract_setup")  # one worker builds the module's model and extractions
VOCAB = 512
SCHEMA = {
    "id": pl.Utf8,
    "input_ids": pl.List(pl.Int64),
    "prompt_len": pl.Int32,
    "completion_len": pl.Int32,
    "train": pl.Boolean,
}


@pytest.fixture(scope="module", autouse=True)
def _threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo") / "model", VOCAB, seed=0)


@pytest.fixture(scope="module")
def model(weights):
    return ex.load_model(weights, device="cpu")


def make_rows(seed: int, n: int, prefix: str) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(n):
        t = int(rng.integers(3, 90))
        p = int(rng.integers(1, t))
        rows.append({
            "id": f"{prefix}-{k}",
            "input_ids": rng.integers(0, VOCAB, t).tolist(),
            "prompt_len": p,
            "completion_len": t - p,
            "train": k % 4 != 2,
        })
    return rows


def write_tokens(d: Path, shards: list[list[dict]], fingerprint: str = "tokfp-123") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, rows in enumerate(shards):
        name = f"shard-{i:05d}.parquet"
        pl.DataFrame(rows, schema=SCHEMA).write_parquet(d / name)
        entries.append({"file": name, "rows": len(rows), "sha256": hashlib.sha256((d / name).read_bytes()).hexdigest()})
    (d / "manifest.json").write_text(json.dumps({"dataset": "t", "tokenizer_fingerprint": fingerprint, "shards": entries}))
    return d


@pytest.fixture(scope="module")
def token_rows():
    return [make_rows(1, 14, "a"), make_rows(2, 9, "b")]


@pytest.fixture(scope="module")
def fp32_out(tmp_path_factory, weights, model, token_rows):
    root = tmp_path_factory.mktemp("fp32")
    tokens = write_tokens(root / "tokens", token_rows)
    manifest = ex.extract_dataset(tokens, root / "hidden", weights, dtype="float32", device="cpu",
                                  batch_tokens=200, model=model)
    return root, manifest


# --------------------------------------------------------------------------- layer semantics


def test_default_layers():
    assert default_layers(61) == [1, 29, 57]
    assert default_layers(8) == [1, 3, 4]
    with pytest.raises(ExtractionError):
        default_layers(4)
    with pytest.raises(ExtractionError):
        resolve_layers([1, 8], 8)
    with pytest.raises(ExtractionError):
        resolve_layers([2, 2], 8)


def _hook_outputs(decoder, ids):
    outs = {}
    handles = [
        layer.register_forward_hook(lambda _m, _a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple) else o))
        for i, layer in enumerate(decoder.layers)
    ]
    try:
        with torch.no_grad():
            res = decoder.module(input_ids=ids, output_hidden_states=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return outs, res


def test_layer_indices_match_forward_hooks_for_every_layer(model):
    dec = find_decoder(model)
    L = dec.num_layers
    assert L == 8 and len(dec.layers) == L
    ids = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(0))
    hooks, res = _hook_outputs(dec, ids)
    hs = res.hidden_states
    assert len(hs) == L + 1
    for i in range(L - 1):  # HF hidden_states[i + 1] == output of layer i
        torch.testing.assert_close(hs[i + 1], hooks[i], rtol=0, atol=0)
        if i + 2 <= L - 1:
            assert not torch.allclose(hs[i + 2], hooks[i])  # the neighbour differs: an off-by-one would show
    # the last entry is the final norm's output, not the last layer's raw output
    torch.testing.assert_close(hs[-1], dec.norm(hooks[L - 1]), rtol=0, atol=0)
    torch.testing.assert_close(hs[-1], res.last_hidden_state, rtol=0, atol=0)
    assert not torch.allclose(hs[-1], hooks[L - 1], atol=1e-3)

    # our capture, asking for EVERY layer, against the hooks
    aux, final = forward_hidden(dec, ids, None, list(range(L)))
    assert aux.shape == (2, 33, L, dec.hidden_size)
    for i in range(L):
        torch.testing.assert_close(aux[:, :, i], hooks[i], rtol=0, atol=0)
    # the final state is the last layer's raw output (before the norm), whatever layers are asked
    torch.testing.assert_close(final, hooks[L - 1], rtol=0, atol=0)
    _, before = forward_hidden(dec, ids, None, [1])
    torch.testing.assert_close(before, hooks[L - 1], rtol=0, atol=0)

    # the defaults are the outputs of layers [1, 3, 4] = HF hidden_states[2], [4], [5]
    aux_d, _ = forward_hidden(dec, ids, None, default_layers(L))
    for j, i in enumerate([1, 3, 4]):
        torch.testing.assert_close(aux_d[:, :, j], hs[i + 1], rtol=0, atol=0)


def test_plan_batches_budget_and_cover():
    lengths = [5, 50, 7, 300, 49, 1, 51, 8]
    batches = ex.plan_batches(lengths, 100)
    assert sorted(k for b in batches for k in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[k] for k in b) <= 100
    assert [3] in batches  # longer than the budget: alone


# --------------------------------------------------------------------------- shard contents


def test_shard_contents(fp32_out, token_rows, weights, model):
    root, manifest = fp32_out
    tokens_manifest = json.loads((root / "tokens" / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    total_tokens = total_samples = 0
    for rows, entry, tentry in zip(token_rows, manifest["shards"], tokens_manifest["shards"]):
        path = root / "hidden" / entry["file"]
        t = load_file(path)
        train = [r for r in rows if r["train"]]
        lens = [len(r["input_ids"]) for r in train]
        n = sum(lens)
        assert t["input_ids"].dtype == torch.int64
        assert t["input_ids"].tolist() == [i for r in train for i in r["input_ids"]]
        assert t["sample_offsets"].tolist() == np.concatenate([[0], np.cumsum(lens)]).tolist()
        assert t["loss_mask"].dtype == torch.int8
        want_mask = [int(j >= r["prompt_len"]) for r in train for j in range(len(r["input_ids"]))]
        assert t["loss_mask"].tolist() == want_mask
        assert t["aux_hidden_states"].shape == (n, 3, 64) and t["aux_hidden_states"].dtype == torch.float32
        assert t["hidden_state"].shape == (n, 64)
        with safe_open(path, "pt") as f:
            meta = f.metadata()
        assert json.loads(meta["sample_ids"]) == [r["id"] for r in train]
        assert json.loads(meta["layers"]) == [1, 3, 4]
        assert meta["final_norm"] == "before" and "BEFORE the final norm" in meta["layer_semantics"]
        assert meta["final_norm_kind"] == "rmsnorm" and float(meta["final_norm_eps"]) == model.config.rms_norm_eps
        assert meta["vocab_size"] == str(VOCAB)
        torch.testing.assert_close(t["final_norm_weight"], find_decoder(model).norm.weight.float(), rtol=0, atol=0)
        assert "output_hidden_states[2, 4, 5]" in meta["layer_semantics"]
        assert meta["dtype"] == "float32"
        assert meta["tokenizer_fingerprint"] == "tokfp-123"
        assert meta["source_sha256"] == tentry["sha256"]
        assert meta["model_path"] == str(weights)
        assert entry["tokens"] == n and entry["samples"] == len(train)
        total_tokens += n
        total_samples += len(train)
    assert manifest["tokens"] == total_tokens and manifest["samples"] == total_samples
    assert manifest["hidden_size"] == 64 and manifest["layers"] == [1, 3, 4]
    assert manifest["final_norm"]["stored"] == "before" and manifest["final_norm"]["kind"] == "rmsnorm"
    assert manifest["final_norm"]["eps"] == model.config.rms_norm_eps and manifest["vocab_size"] == VOCAB
    assert manifest["dtype"] == "float32"
    assert manifest["tokenizer_fingerprint"] == "tokfp-123"
    assert json.loads((root / "hidden" / "manifest.json").read_text()) == manifest


def test_batched_equals_single_sample_forward(fp32_out, token_rows, model):
    """Every sample of the batched (padded, length-grouped) extraction equals a direct forward of
    that sample alone."""
    root, _ = fp32_out
    dec = find_decoder(model)
    t = load_file(root / "hidden" / "shard-00000.safetensors")
    off = t["sample_offsets"].tolist()
    train = [r for r in token_rows[0] if r["train"]]
    assert len(ex.plan_batches([len(r["input_ids"]) for r in train], 200)) < len(train)  # really batched
    for k, r in enumerate(train):
        ids = torch.tensor([r["input_ids"]])
        aux, final = forward_hidden(dec, ids, None, [1, 3, 4])
        torch.testing.assert_close(t["aux_hidden_states"][off[k]:off[k + 1]], aux[0], rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(t["hidden_state"][off[k]:off[k + 1]], final[0], rtol=1e-5, atol=2e-6)


def test_bf16_paths(tmp_path, fp32_out, token_rows, weights, model):
    root, _ = fp32_out
    ref = load_file(root / "hidden" / "shard-00001.safetensors")
    tokens = write_tokens(tmp_path / "tokens", [token_rows[1]])
    # storage bf16, compute in the checkpoint's fp32: exactly the fp32 result rounded to bf16
    ex.extract_dataset(tokens, tmp_path / "h1", weights, dtype="bfloat16", device="cpu", batch_tokens=200, model=model)
    got = load_file(tmp_path / "h1" / "shard-00000.safetensors")
    assert got["aux_hidden_states"].dtype == torch.bfloat16 and got["hidden_state"].dtype == torch.bfloat16
    torch.testing.assert_close(got["aux_hidden_states"], ref["aux_hidden_states"].to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(got["hidden_state"], ref["hidden_state"].to(torch.bfloat16), rtol=0, atol=0)
    # model run in bf16 (as on a GPU): close to fp32, not equal
    ex.extract_dataset(tokens, tmp_path / "h2", weights, dtype="bfloat16", device="cpu", batch_tokens=200,
                       compute_dtype="bfloat16")
    got2 = load_file(tmp_path / "h2" / "shard-00000.safetensors")
    for key in ("aux_hidden_states", "hidden_state"):
        a, b = got2[key].float(), ref[key]
        assert got2[key].dtype == torch.bfloat16
        assert torch.isfinite(a).all()
        assert ((a - b).norm() / b.norm()).item() < 0.05
    with safe_open(tmp_path / "h2" / "shard-00000.safetensors", "pt") as f:
        assert f.metadata()["dtype"] == "bfloat16" and f.metadata()["compute_dtype"] == "bfloat16"


def test_final_state_is_before_the_norm(tmp_path, token_rows, weights, model):
    tokens = write_tokens(tmp_path / "tokens", [token_rows[1][:4]])
    ex.extract_dataset(tokens, tmp_path / "h", weights, dtype="float32", device="cpu", model=model)
    path = tmp_path / "h" / "shard-00000.safetensors"
    t = load_file(path)
    dec = find_decoder(model)
    r = [r for r in token_rows[1][:4] if r["train"]][0]
    hooks, _ = _hook_outputs(dec, torch.tensor([r["input_ids"]]))
    n = len(r["input_ids"])
    torch.testing.assert_close(t["hidden_state"][:n], hooks[dec.num_layers - 1][0], rtol=1e-5, atol=2e-6)
    with safe_open(path, "pt") as f:
        assert f.metadata()["final_norm"] == "before" and "BEFORE the final norm" in f.metadata()["layer_semantics"]


# --------------------------------------------------------------------------- resume, integrity


def test_resume_skips_finished_shards(tmp_path, token_rows, weights, model, monkeypatch):
    tokens = write_tokens(tmp_path / "tokens", token_rows)
    out = tmp_path / "hidden"
    first = ex.extract_dataset(tokens, out, weights, dtype="float32", device="cpu", model=model)
    files = sorted(out.glob("*.safetensors"))
    assert len(files) == 2
    mtimes = {p.name: p.stat().st_mtime_ns for p in files}
    (out / "stray.safetensors").write_bytes(b"junk")

    def boom(*a, **k):
        raise AssertionError("model loaded although every shard was done")

    monkeypatch.setattr(ex, "load_model", boom)
    monkeypatch.setattr(ex, "extract_shard", boom)
    again = ex.extract_dataset(tokens, out, weights, dtype="float32", device="cpu")
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")} == mtimes
    assert again["tokens"] == first["tokens"] and all(s.get("resumed") for s in again["shards"])
    monkeypatch.undo()

    # a changed setting (dtype) or a truncated file is not "done"
    with open(files[1], "r+b") as fh:
        fh.truncate(files[1].stat().st_size - 10)
    ex.extract_dataset(tokens, out, weights, dtype="float32", device="cpu", model=model)
    assert files[0].stat().st_mtime_ns == mtimes[files[0].name]
    assert files[1].stat().st_mtime_ns != mtimes[files[1].name]
    ex.extract_dataset(tokens, out, weights, dtype="float16", device="cpu", model=model)
    assert files[0].stat().st_mtime_ns != mtimes[files[0].name]
    assert load_file(files[0])["hidden_state"].dtype == torch.float16


def test_compute_dtype_spelled_as_the_checkpoints_own_resumes(tmp_path, token_rows, weights, model, monkeypatch):
    """compute_dtype "auto" computes in the dtype the checkpoint declares (Hugging Face's rule): writing
    that dtype out, or going back to auto, keeps every shard; another compute dtype re-extracts."""
    tokens = write_tokens(tmp_path / "tokens", token_rows)
    out = tmp_path / "hidden"
    assert json.loads((Path(weights) / "config.json").read_text())["dtype"] == "float32"
    ex.extract_dataset(tokens, out, weights, dtype="float32", device="cpu", model=model)
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}

    def boom(*a, **k):
        raise AssertionError("model loaded although every shard was done")

    with monkeypatch.context() as m:
        m.setattr(ex, "load_model", boom)
        m.setattr(ex, "extract_shard", boom)
        spelled = ex.extract_dataset(tokens, out, weights, dtype="float32", compute_dtype="float32", device="cpu")
        assert all(s.get("resumed") for s in spelled["shards"]) and spelled["compute_dtype"] == "float32"
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")} == mtimes
    ex.extract_dataset(tokens, out, weights, dtype="float32", compute_dtype="bfloat16", device="cpu")
    changed = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    assert all(changed[name] != mtime for name, mtime in mtimes.items())
    with monkeypatch.context() as m:  # written as bfloat16: auto (float32 here) is another computation
        m.setattr(ex, "load_model", lambda *a, **k: model)
        again = ex.extract_dataset(tokens, out, weights, dtype="float32", device="cpu")
        assert not any(s.get("resumed") for s in again["shards"])


def test_work_dir_published(tmp_path, token_rows, weights, model):
    tokens = write_tokens(tmp_path / "tokens", [token_rows[1][:3]])
    out, work = tmp_path / "hidden", tmp_path / ".hidden.partial"
    ex.extract_dataset(tokens, out, weights, dtype="float32", device="cpu", work_dir=work, model=model)
    assert not work.exists() and (out / "manifest.json").exists() and (out / "shard-00000.safetensors").exists()


def test_sha256_mismatch_raises_naming_file(tmp_path, token_rows, weights, monkeypatch):
    tokens = write_tokens(tmp_path / "tokens", token_rows)
    pl.DataFrame(token_rows[1][:2], schema=SCHEMA).write_parquet(tokens / "shard-00001.parquet")
    monkeypatch.setattr(ex, "load_model", lambda *a, **k: pytest.fail("model loaded before verification"))
    with pytest.raises(ExtractionError, match=r"sha256 mismatch.*shard-00001\.parquet"):
        ex.extract_dataset(tokens, tmp_path / "hidden", weights, device="cpu")
    assert not list((tmp_path / "hidden").glob("*.safetensors"))


def test_bad_rows_rejected(tmp_path, token_rows, weights, model):
    rows = [dict(r) for r in token_rows[1][:3]]
    rows[0]["completion_len"] += 1
    tokens = write_tokens(tmp_path / "tokens", [rows])
    with pytest.raises(ExtractionError, match="completion_len"):
        ex.extract_dataset(tokens, tmp_path / "h", weights, device="cpu", model=model)
    rows = [dict(r) for r in token_rows[1][:3]]
    rows[1]["input_ids"] = rows[1]["input_ids"][:-1] + [VOCAB]
    tokens = write_tokens(tmp_path / "tokens2", [rows])
    with pytest.raises(ExtractionError, match="outside"):
        ex.extract_dataset(tokens, tmp_path / "h2", weights, device="cpu", model=model)
    assert not list((tmp_path / "h2").glob("*.safetensors*"))


# --------------------------------------------------------------------------- demo model


def test_demo_model_deterministic(tmp_path, weights):
    from transformers import DeepseekV3Config

    cfg = demo_config(VOCAB, 0)
    assert isinstance(cfg, DeepseekV3Config)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.n_routed_experts) == (8, 64, 8)
    assert 0 < cfg.first_k_dense_replace < cfg.num_hidden_layers
    torch.manual_seed(123)
    state = torch.get_rng_state()
    again = build_demo_model(tmp_path / "again", VOCAB, seed=0)
    assert torch.equal(torch.get_rng_state(), state)  # caller's RNG untouched
    names = sorted(p.name for p in weights.iterdir())
    assert "model.safetensors" in names and "README.md" in names
    assert sorted(p.name for p in again.iterdir()) == names
    for name in names:
        assert (weights / name).read_bytes() == (again / name).read_bytes(), name
    assert "random" in (weights / "README.md").read_text().lower()
    # the weight map of a sharded checkpoint, which SpecForge's TargetHead.from_pretrained reads
    index = json.loads((weights / "model.safetensors.index.json").read_text())
    tensors = load_file(weights / "model.safetensors")
    assert index["weight_map"] == {k: "model.safetensors" for k in tensors} and "lm_head.weight" in index["weight_map"]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    other = build_demo_model(tmp_path / "other", VOCAB, seed=1)
    assert (other / "model.safetensors").read_bytes() != (weights / "model.safetensors").read_bytes()
    t = load_file(weights / "model.safetensors")
    assert any("experts" in k for k in t) and all(v.dtype == torch.float32 for v in t.values())


def test_empty_selection_and_missing_weights(tmp_path, token_rows, weights, model):
    rows = [dict(r, train=False) for r in token_rows[1][:3]]
    tokens = write_tokens(tmp_path / "tokens", [rows])
    m = ex.extract_dataset(tokens, tmp_path / "h", weights, dtype="float32", device="cpu", model=model)
    t = load_file(tmp_path / "h" / "shard-00000.safetensors")
    assert m["tokens"] == 0 and t["aux_hidden_states"].shape == (0, 3, 64) and t["sample_offsets"].tolist() == [0]
    with pytest.raises(ExtractionError, match="config.json"):
        ex.extract_dataset(tokens, tmp_path / "h2", tmp_path / "no-such-model", device="cpu")


def test_claim_gpus_wrapper_raises_extraction_error(tmp_path, monkeypatch):
    from eagledata.extract import gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "")
    try:
        assert ex.claim_gpus(0, tmp_path) == []
        assert ex.claim_gpus(1, tmp_path, candidates=["3", "5"]) == ["3"]
        assert ex.claim_gpus(1, tmp_path, candidates=["3", "5"]) == ["5"]  # 3 is held
        assert __import__("os").environ["CUDA_VISIBLE_DEVICES"] == "5"
        with pytest.raises(ExtractionError, match="could not claim"):
            ex.claim_gpus(1, tmp_path, candidates=["3", "5"], timeout_s=0, poll_s=0)
        with pytest.raises(ExtractionError, match="only 2 visible"):
            ex.claim_gpus(3, tmp_path, candidates=["3", "5"])
    finally:
        gpus.release_all()


# --------------------------------------------------------------------------- storage: index, sha256, disk space


def test_index_and_output_sha256(fp32_out, token_rows):
    root, manifest = fp32_out
    hidden = root / "hidden"
    assert manifest["complete"] is True and manifest["index"] == "index.parquet"
    for entry in manifest["shards"]:
        assert entry["sha256"] == hashlib.sha256((hidden / entry["file"]).read_bytes()).hexdigest()
        assert entry["bytes"] == (hidden / entry["file"]).stat().st_size
    idx = read_index(hidden)
    train = [(k, r) for k, rows in enumerate(token_rows) for r in rows if r["train"]]
    assert idx["id"].to_list() == [r["id"] for _, r in train]
    assert idx["sample"].to_list() == list(range(len(train)))
    assert idx["shard"].to_list() == [f"shard-{k:05d}.safetensors" for k, _ in train]
    assert idx["length"].to_list() == [len(r["input_ids"]) for _, r in train]
    assert idx["prompt_len"].to_list() == [r["prompt_len"] for _, r in train]
    # offset/length address the sample's rows: ids there are the sample's ids
    for row in idx.iter_rows(named=True):
        with safe_open(hidden / row["shard"], "pt") as f:
            ids = f.get_slice("input_ids")[row["offset"]: row["offset"] + row["length"]]
        want = next(r for _, r in train if r["id"] == row["id"])["input_ids"]
        assert ids.tolist() == want


def test_disk_space_checked_before_a_shard_starts(tmp_path, token_rows, weights, model, monkeypatch):
    import shutil as _shutil
    from collections import namedtuple

    tokens = write_tokens(tmp_path / "tokens", [token_rows[1]])
    n = sum(len(r["input_ids"]) for r in token_rows[1] if r["train"])
    s = sum(1 for r in token_rows[1] if r["train"])
    need = estimate_shard_bytes(n, s, 3, 64, "float32")
    # tokens x (layers + 1) x H x size + ids, mask, offsets + the final norm's weight (H float32)
    assert need == n * (3 + 1) * 64 * 4 + n * 9 + (s + 1) * 8 + 64 * 4
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(_shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(ExtractionError, match=r"not enough disk space for .*shard-00000\.safetensors.*needs [\d,]+ bytes.*only 1,000 bytes"):
        ex.extract_dataset(tokens, tmp_path / "h", weights, dtype="float32", device="cpu", model=model)
    assert not list((tmp_path / "h").glob("shard-*"))
    monkeypatch.setattr(_shutil, "disk_usage", lambda p: usage(10**12, 0, need + 20000))
    with pytest.raises(ExtractionError, match="reserve_disk_gb"):
        ex.extract_dataset(tokens, tmp_path / "h", weights, dtype="float32", device="cpu", model=model,
                           reserve_disk_bytes=10**6)
    ex.extract_dataset(tokens, tmp_path / "h", weights, dtype="float32", device="cpu", model=model)
    assert (tmp_path / "h" / "shard-00000.safetensors").exists()


_KILLED_CHILD = """
import sys, time, torch
from eagledata.extract import core as ex
from eagledata.extract.hf import HFBackend
torch.set_num_threads(1)
slow = HFBackend.forward
def forward(self, seqs, out_dtype):
    time.sleep(0.25)
    return slow(self, seqs, out_dtype)
HFBackend.forward = forward
tokens, out, work, weights = sys.argv[1:5]
ex.extract_dataset(tokens, out, weights, dtype="float32", device="cpu", batch_tokens=150, work_dir=work)
"""


@pytest.mark.timing  # kills the job mid-run: alone under xdist
def test_resume_after_kill_9(tmp_path, token_rows, weights, model):
    """A real extraction subprocess is killed with SIGKILL after its first shard; the rerun keeps
    that shard untouched (same bytes, same mtime, not recomputed), removes the half-written one
    and finishes the rest."""
    import os
    import signal
    import subprocess
    import sys
    import time

    shards = [token_rows[0][:7], token_rows[1][:7], token_rows[0][7:]]
    tokens = write_tokens(tmp_path / "tokens", shards)
    out, work = tmp_path / "hidden", tmp_path / ".hidden.partial"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, str(tokens), str(out), str(work), str(weights)],
                            env=env, stderr=subprocess.PIPE)
    first = work / "shard-00000.safetensors"
    deadline = time.monotonic() + 120
    while not first.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)  # into shard 1
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert not out.exists() and not (work / "shard-00002.safetensors").exists()
    partial = json.loads((work / "manifest.json").read_text())
    assert partial["complete"] is False and [s["file"] for s in partial["shards"]] == ["shard-00000.safetensors"]
    before = (first.stat().st_mtime_ns, first.read_bytes())

    manifest = ex.extract_dataset(tokens, out, weights, dtype="float32", device="cpu", batch_tokens=150,
                                  work_dir=work, model=model)
    assert not work.exists() and manifest["complete"]
    assert [s.get("resumed", False) for s in manifest["shards"]] == [True, False, False]
    kept = out / "shard-00000.safetensors"
    assert (kept.stat().st_mtime_ns, kept.read_bytes()) == before
    assert not list(out.glob("*.tmp-*"))
    assert manifest["shards"][0]["sha256"] == partial["shards"][0]["sha256"]
    ref = ex.extract_dataset(tokens, tmp_path / "ref", weights, dtype="float32", device="cpu", batch_tokens=150, model=model)
    assert ref["tokens"] == manifest["tokens"]
    for name in ("shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"):
        a, b = load_file(out / name), load_file(tmp_path / "ref" / name)
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=2e-6)


# --------------------------------------------------------------------------- backend contract


def test_hf_backend_contract(model):
    """HFBackend.forward: per sample (aux [T, n, H], final [T, H]) in the requested dtype on the
    CPU, equal to single-sample hooks; fp32 and bf16 output paths."""
    dec = find_decoder(model)
    backend = HFBackend(model, [1, 3, 4])
    assert (backend.num_layers, backend.hidden_size, backend.vocab_size) == (8, 64, VOCAB)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, VOCAB, (t,), generator=g) for t in (17, 5, 30)]
    for dtype, tol in ((torch.float32, dict(rtol=1e-5, atol=2e-6)), (torch.bfloat16, dict(rtol=8e-3, atol=1e-5))):
        out = backend.forward(seqs, dtype)  # batched (padded); bf16 may differ by one rounding step
        for s, (aux, final) in zip(seqs, out):
            assert aux.shape == (len(s), 3, 64) and final.shape == (len(s), 64)
            assert aux.dtype == final.dtype == dtype and aux.device.type == "cpu"
            hooks, res = _hook_outputs(dec, s[None])
            for j, i in enumerate([1, 3, 4]):
                torch.testing.assert_close(aux[:, j].float(), hooks[i][0].to(dtype).float(), **tol)
            torch.testing.assert_close(final.float(), hooks[dec.num_layers - 1][0].to(dtype).float(), **tol)
    with pytest.raises(ExtractionError, match="backend captures layers"):
        as_backend(backend, [1, 2, 3])


def test_removed_final_norm_setting_is_refused(tmp_path, token_rows, weights, model):
    tokens = write_tokens(tmp_path / "tokens", [token_rows[1][:2]])
    for value in ("after", "before"):
        with pytest.raises(ExtractionError, match="extraction.final_norm .* was removed.*delete the key"):
            ex.extract_dataset(tokens, tmp_path / "h", weights, final_norm=value, device="cpu", model=model)


def test_non_rms_final_norm_is_refused(model):
    """A final norm the stored weight + eps cannot reproduce (Gemma-style 1 + weight) is refused
    before anything is extracted."""
    import copy

    from eagledata.extract.norm import check_rms_norm, final_norm_of

    dec = find_decoder(model)
    check_rms_norm(dec.norm, final_norm_of(dec.norm))
    odd = copy.deepcopy(dec.norm)
    forward = odd.forward
    odd.forward = lambda x: forward(x) + x * 0.5
    with pytest.raises(ExtractionError, match="is not x \\* rsqrt"):
        check_rms_norm(odd, final_norm_of(odd))


# --------------------------------------------------------------------------- sanity checks (issue 12 point 8)


def test_clean_run_records_rms_and_rerun_diff(fp32_out, token_rows):
    """Each shard's manifest entry holds the per-layer RMS of its stored values and the max abs
    diff of one sample re-run alone against its batched result (within float32 tolerance)."""
    root, manifest = fp32_out
    for entry in manifest["shards"]:
        t = load_file(root / "hidden" / entry["file"])
        rms = entry["checks"]["rms"]
        assert list(rms) == ["layer_1", "layer_3", "layer_4", "final"]
        for j, name in enumerate(["layer_1", "layer_3", "layer_4"]):
            want = float(t["aux_hidden_states"][:, j].double().pow(2).mean().sqrt())
            assert rms[name] == pytest.approx(want, rel=1e-5)
        assert rms["final"] == pytest.approx(float(t["hidden_state"].double().pow(2).mean().sqrt()), rel=1e-5)
        rerun = entry["checks"]["rerun"]
        ids = json.loads(safe_open(root / "hidden" / entry["file"], "pt").metadata()["sample_ids"])
        assert rerun["sample"] in ids
        assert 0 <= rerun["max_abs_diff"] < 1e-4 and 0 <= rerun["max_token_rel_diff"] < 1e-5 and rerun["rtol"] == 1e-3


def test_rerun_sample_is_batched_with_others():
    from eagledata.extract.checks import pick_rerun_sample, rerun_rtol

    # batches run longest first: the last sample of the last multi-sample batch is the most padded one
    assert pick_rerun_sample([[3], [1, 0, 2]]) == 2
    assert pick_rerun_sample([[3], [1, 0], [4, 5, 6], [7]]) == 6
    assert pick_rerun_sample([[3], [1]]) == 3
    assert pick_rerun_sample([]) is None
    assert rerun_rtol("float32", "bfloat16") == rerun_rtol("bfloat16", "float32") > rerun_rtol("float32", "float32")


def test_rerun_check_tolerates_rounding_and_catches_a_changed_token():
    """The batched-vs-alone check works token by token: the rounding a 16-bit batch brings (measured on
    an H200 at K2.5's width: up to 0.035 of a token's norm by layer 23, single values off by 0.13 of
    (|value| + rms), which the former per-value check refused) passes; one token changed as a batching
    bug changes it (another position's state) fails, naming the token."""
    from eagledata.extract.checks import RerunMismatchError, compare_rerun, rerun_rtol

    g = torch.Generator().manual_seed(0)
    aux, final = torch.randn(50, 3, 7168, generator=g) * 6.4, torch.randn(50, 7168, generator=g) * 8.2
    noisy = (aux * (1 + 0.04 * torch.randn(aux.shape, generator=g)), final * (1 + 0.04 * torch.randn(final.shape, generator=g)))
    rtol = rerun_rtol("bfloat16", "bfloat16")
    rec = compare_rerun("s", "x", (aux, final), noisy, rtol)
    assert 0.035 < rec["max_token_rel_diff"] < 0.05 < rtol and rec["max_abs_diff"] > 1
    moved = aux.clone()
    moved[17] = aux[16]  # token 17 holds another position's state
    with pytest.raises(RerunMismatchError, match=r"by 1\.\d+ of the hidden vector's norm at token 17"):
        compare_rerun("s", "x", (aux, final), (moved, final), rtol)
    # float32 computes tighter: the same rounding fails there
    with pytest.raises(RerunMismatchError):
        compare_rerun("s", "x", (aux, final), noisy, rerun_rtol("float32", "float32"))
    # an all-zero state matches only zeros
    z = (torch.zeros(2, 3, 4), torch.zeros(2, 4))
    assert compare_rerun("s", "x", z, z, rtol)["max_token_rel_diff"] == 0
    with pytest.raises(RerunMismatchError):
        compare_rerun("s", "x", z, (z[0], torch.ones(2, 4)), rtol)
    # a NaN in the re-run never hides a changed token (argmax would pick the NaN), nor passes alone
    nan = moved.clone()
    nan[10, 0, 3] = float("nan")
    with pytest.raises(RerunMismatchError, match="NaN or Inf"):
        compare_rerun("s", "x", (aux, final), (nan, final), rtol)
    with pytest.raises(RerunMismatchError, match="NaN or Inf"):
        compare_rerun("s", "x", (aux, final), (aux, torch.full_like(final, float("nan"))), rtol)
    # a token whose norm overflows float32 is still compared
    huge = aux.clone()
    huge[4, 1, 0] = 3e19
    changed = huge.clone()
    changed[4, 1, 0] = 1e19
    with pytest.raises(RerunMismatchError, match="at token 4"):
        compare_rerun("s", "x", (huge, final), (changed, final), rtol)
    # a compute dtype nobody knows (an SGLang server, compute_dtype auto) is taken as bf16's
    assert rerun_rtol("float32", None) == rerun_rtol("float32", "bfloat16") == rtol


def test_checks_sum_in_float32_and_a_huge_finite_value_is_not_taken_for_a_nan():
    """The RMS sums run in float32; a finite value whose square overflows float32 (beyond ~1.8e19) is
    summed again in float64 and passes; a NaN or an Inf still fails, naming the layer."""
    from eagledata.extract.checks import NonFiniteError, ShardChecks

    g = torch.Generator().manual_seed(0)
    aux, final = torch.randn(40, 3, 64, generator=g), torch.randn(40, 64, generator=g)
    checks = ShardChecks("s", [1, 3, 4])
    checks.add("a", aux.to(torch.bfloat16), final.to(torch.bfloat16))
    want = aux.to(torch.bfloat16).double().pow(2).mean(dim=(0, 2)).sqrt()
    assert [checks.rms()[f"layer_{i}"] for i in (1, 3, 4)] == pytest.approx(want.tolist(), rel=1e-5)  # 6 digits kept
    huge = aux.clone()
    huge[3, 1, 7] = 3e19
    checks.add("b", huge, final)
    assert checks.rms()["layer_3"] > 1e16
    for bad in (float("nan"), float("inf")):
        poisoned = aux.clone()
        poisoned[5, 2, 9] = bad
        with pytest.raises(NonFiniteError, match=r"sample 'c'.*first at token 5, layer layer_4"):
            checks.add("c", poisoned, final)


def test_injected_nan_fails_naming_shard_and_sample(tmp_path, token_rows, weights, model, monkeypatch):
    """A NaN in one sample's forward fails the job; the message names the shard and that sample;
    no output shard is published."""
    from eagledata.extract.checks import NonFiniteError

    victim = [r for r in token_rows[1] if r["train"]][2]
    real = HFBackend.forward

    def poisoned(self, seqs, out_dtype):
        res = real(self, seqs, out_dtype)
        for b, s in enumerate(seqs):
            if s.tolist() == victim["input_ids"]:
                aux, final = res[b]
                aux = aux.clone()
                aux[len(s) // 2, 1, 5] = float("nan")
                res[b] = (aux, final)
        return res

    monkeypatch.setattr(HFBackend, "forward", poisoned)
    tokens = write_tokens(tmp_path / "tokens", token_rows)
    with pytest.raises(NonFiniteError) as err:
        ex.extract_dataset(tokens, tmp_path / "hidden", weights, dtype="float32", device="cpu",
                           batch_tokens=200, model=model)
    msg = str(err.value)
    assert "shard-00001.parquet" in msg and repr(victim["id"]) in msg and "aux_hidden_states" in msg
    assert "layer_3" in msg
    assert not (tmp_path / "hidden" / "shard-00001.safetensors").exists()


def test_rerun_mismatch_fails(tmp_path, token_rows, weights, model, monkeypatch):
    """A backend whose single-sample result differs from its batched one fails the shard."""
    from eagledata.extract.checks import RerunMismatchError

    real = HFBackend.forward

    def drifting(self, seqs, out_dtype):
        res = real(self, seqs, out_dtype)
        return [(a + 0.5, f) for a, f in res] if len(seqs) == 1 else res

    monkeypatch.setattr(HFBackend, "forward", drifting)
    tokens = write_tokens(tmp_path / "tokens", token_rows)
    with pytest.raises(RerunMismatchError, match=r"shard-00000\.parquet: sample 'a-"):
        ex.extract_dataset(tokens, tmp_path / "hidden", weights, dtype="float32", device="cpu",
                           batch_tokens=200, model=model)


# --------------------------------------------------------------------------- length limits (issue 12 point 7)


def _limit_rows():
    rng = np.random.default_rng(7)
    spec = [("short", 4, 10), ("long", 6, 40), ("long-prompt", 25, 5), ("exact", 10, 10), ("off", 3, 50)]
    rows = []
    for sid, p, c in spec:
        rows.append({"id": sid, "input_ids": rng.integers(0, VOCAB, p + c).tolist(), "prompt_len": p,
                     "completion_len": c, "train": sid != "off"})
    return rows


@pytest.mark.parametrize("on_long", ["truncate", "skip"])
def test_max_seq_len_truncates_or_skips_and_flags(tmp_path, weights, model, on_long):
    rows = _limit_rows()
    tokens = write_tokens(tmp_path / "tokens", [rows])
    manifest = ex.extract_dataset(tokens, tmp_path / "hidden", weights, dtype="float32", device="cpu",
                                  batch_tokens=200, model=model, max_seq_len=20, on_long=on_long)
    t = load_file(tmp_path / "hidden" / "shard-00000.safetensors")
    ids = json.loads(safe_open(tmp_path / "hidden" / "shard-00000.safetensors", "pt").metadata()["sample_ids"])
    flagged = {f["id"]: f for f in manifest["shards"][0]["length_limit"]["flagged"]}
    by_id = {r["id"]: r for r in rows}
    assert flagged["long-prompt"]["action"] == "skipped" and flagged["long-prompt"]["tokens"] == 30
    if on_long == "truncate":
        assert ids == ["short", "long", "exact"]
        assert flagged["long"] == {"id": "long", "tokens": 46, "kept": 20, "action": "truncated"}
        off = t["sample_offsets"].tolist()
        assert off == [0, 14, 34, 54]
        # the prompt is kept whole, the completion cut: ids and mask are the sample's first 20 tokens
        assert t["input_ids"][14:34].tolist() == by_id["long"]["input_ids"][:20]
        assert t["loss_mask"][14:34].tolist() == [0] * 6 + [1] * 14
        assert manifest["length_limit"] | {} == {
            "max_seq_len": 20, "on_long": "truncate", "truncated": 1, "skipped": 1,
            "trainer_max_len": {"specforge": 2048, "speculators": 8192},
            "over_trainer_max": {"specforge": 0, "speculators": 0}}
        # a trainer's export says so too: its samples are the stored ones, one of them cut
        from eagledata.export.specforge import export_specforge

        meta = export_specforge(tmp_path / "hidden", tmp_path / "specforge", dtype="float32")
        assert meta["samples"] == 3 and meta["length_limit"] == manifest["length_limit"]
        assert json.loads((tmp_path / "specforge" / "export.json").read_text())["length_limit"]["truncated"] == 1
    else:
        assert ids == ["short", "exact"] and set(flagged) == {"long", "long-prompt"}
        assert manifest["length_limit"]["truncated"] == 0 and manifest["length_limit"]["skipped"] == 2
    assert "off" not in flagged  # not a train row: never counted
    assert manifest["samples"] == len(ids)
    assert read_index(tmp_path / "hidden")["id"].to_list() == ids
    # the truncated sample's states equal a forward of the cut sample alone (causal: = the first 20 rows)
    if on_long == "truncate":
        aux, final = forward_hidden(find_decoder(model), torch.tensor([by_id["long"]["input_ids"][:20]]), None,
                                    [1, 3, 4])
        torch.testing.assert_close(t["hidden_state"][14:34], final[0], rtol=1e-5, atol=2e-6)


def test_changed_limit_reextracts_and_no_limit_is_default(tmp_path, weights, model, caplog):
    rows = _limit_rows()
    tokens = write_tokens(tmp_path / "tokens", [rows])
    m0 = ex.extract_dataset(tokens, tmp_path / "hidden", weights, dtype="float32", device="cpu", model=model)
    assert m0["length_limit"]["max_seq_len"] is None and m0["length_limit"]["truncated"] == 0
    assert m0["samples"] == 4 and m0["shards"][0]["length_limit"]["flagged"] == []
    m1 = ex.extract_dataset(tokens, tmp_path / "hidden", weights, dtype="float32", device="cpu", model=model,
                            max_seq_len=20)
    assert not m1["shards"][0].get("resumed") and m1["samples"] == 3
    m2 = ex.extract_dataset(tokens, tmp_path / "hidden", weights, dtype="float32", device="cpu", model=model,
                            max_seq_len=20)
    assert m2["shards"][0]["resumed"] and m2["length_limit"]["skipped"] == 1 and m2["length_limit"]["truncated"] == 1
    with pytest.raises(ExtractionError, match="on_long"):
        ex.extract_dataset(tokens, tmp_path / "h2", weights, model=model, on_long="cut")


def test_long_samples_warned_against_trainer_defaults(tmp_path, weights, model, caplog, monkeypatch):
    """Stored samples longer than a trainer's default maximum length are counted and warned about."""
    from eagledata.extract import limits

    monkeypatch.setitem(limits.TRAINER_MAX_LEN, "specforge", 30)
    tokens = write_tokens(tmp_path / "tokens", [_limit_rows()])
    with caplog.at_level("WARNING", logger="eagledata.extract.core"):
        m = ex.extract_dataset(tokens, tmp_path / "hidden", weights, dtype="float32", device="cpu", model=model)
    assert m["length_limit"]["over_trainer_max"] == {"specforge": 1, "speculators": 0}  # "long": 46 tokens
    assert any("longer than SpecForge data.max_length's default 30" in r.getMessage() for r in caplog.records)


def test_every_sample_skipped_writes_an_empty_shard(tmp_path, weights, model):
    tokens = write_tokens(tmp_path / "tokens", [_limit_rows()])
    m = ex.extract_dataset(tokens, tmp_path / "hidden", weights, dtype="float32", device="cpu", model=model,
                           max_seq_len=5, on_long="skip")
    assert m["samples"] == 0 and m["length_limit"]["skipped"] == 4
    assert m["shards"][0]["checks"]["rerun"] is None


def test_dataset_report_counts_length_limit(tmp_path, tmp_path_factory, weights, model):
    """The dataset report shows the extraction's length-limit counts when hidden/manifest.json exists."""
    import test_report as tr
    from eagledata.report import build as rp
    from eagledata.text.tokenizer import load_tokenizer

    tok = load_tokenizer(tr.dt.build_demo_tokenizer(None, tmp_path / "tokenizer"), tr.FAMILY)
    validation, tokens = tr.build_dataset(tok, tmp_path / "results", "syn")
    ctx = rp.build_dataset_report(validation, tokens, tmp_path / "r0.html", tok)
    assert ctx["extraction"] is None and "max_seq_len" not in (tmp_path / "r0.html").read_text()
    ltokens = write_tokens(tmp_path / "ltokens", [_limit_rows()])
    ex.extract_dataset(ltokens, tmp_path / "results" / "syn" / "hidden", weights, dtype="float32", device="cpu",
                       model=model, max_seq_len=20)
    ctx = rp.build_dataset_report(validation, tokens, tmp_path / "r1.html", tok)
    assert ctx["extraction"]["truncated"] == 1 and ctx["extraction"]["skipped"] == 1
    text = (tmp_path / "r1.html").read_text()
    assert "max_seq_len 20 (truncate): 1 truncated, 1 skipped" in text
    tr.assert_well_formed(text)


# --------------------------------------------------------------------------- FP8 storage (issue 12 point 6)


def test_fp8_storage_per_token_scale(tmp_path, fp32_out, token_rows, weights, model):
    """float8_e4m3fn shards hold e4m3 values and a float32 scale per token and layer (speculators'
    per_token_scaled); dequantized they are the float32 extraction within e4m3's precision; the
    size is exactly the estimate (1 byte per value + 4 per token and layer)."""
    from eagledata.extract.fp8 import FP8_MAX, dequantize

    root, ref_manifest = fp32_out
    tokens = write_tokens(tmp_path / "tokens", token_rows)
    m = ex.extract_dataset(tokens, tmp_path / "hidden", weights, dtype="float8_e4m3fn", device="cpu",
                           batch_tokens=200, model=model)
    assert m["dtype"] == "float8_e4m3fn" and "aux_hidden_states_scale" in m["tensors"]
    for entry, ref_entry in zip(m["shards"], ref_manifest["shards"]):
        path = tmp_path / "hidden" / entry["file"]
        t = load_file(path)
        ref = load_file(root / "hidden" / ref_entry["file"])
        n = t["input_ids"].numel()
        assert t["aux_hidden_states"].dtype == torch.float8_e4m3fn and t["hidden_state"].dtype == torch.float8_e4m3fn
        assert t["aux_hidden_states_scale"].shape == (n, 3) and t["hidden_state_scale"].shape == (n,)
        assert t["aux_hidden_states_scale"].dtype == torch.float32
        aux = dequantize(t["aux_hidden_states"], t["aux_hidden_states_scale"])
        final = dequantize(t["hidden_state"], t["hidden_state_scale"])
        # each row's largest |value| maps to 448 exactly; e4m3 keeps 3 mantissa bits: <= 2^-4 relative
        assert float(t["hidden_state"].float().abs().amax(-1).min()) == FP8_MAX
        torch.testing.assert_close(aux, ref["aux_hidden_states"], rtol=2 ** -4, atol=1e-3 * 2 ** -4)
        torch.testing.assert_close(final, ref["hidden_state"], rtol=2 ** -4, atol=1e-3 * 2 ** -4)
        assert path.stat().st_size - estimate_shard_bytes(n, entry["samples"], 3, 64, "float8_e4m3fn") < 20000
        with safe_open(path, "pt") as f:
            assert f.metadata()["fp8_format"] == "per_token_scaled"
        assert entry["checks"]["rerun"]["rtol"] == 0.5 and entry["checks"]["rms"]["final"] > 0
    assert estimate_shard_bytes(10, 1, 3, 64, "float8_e4m3fn") == 10 * (4 * 64 + 4 * 4 + 9) + 16 + 64 * 4


def test_fp8_is_stored_not_computed(tmp_path, token_rows, weights, model):
    with pytest.raises(ExtractionError, match="dtype"):
        ex.extract_dataset(write_tokens(tmp_path / "t", token_rows), tmp_path / "h", weights, model=model,
                           dtype="float8_e5m2")
    with pytest.raises(ExtractionError):
        ex.check_settings("hf", "float8_e4m3fn", "float8_e4m3fn", 100)


# --------------------------------------------------------------------------- one job per shard (issue 12 point 2)


def _per_shard_plan(tokens: Path, plan: Path) -> list[dict]:
    """The plan the checkpoint extract_plan writes, for a tokens dir whose manifest has no stable keys."""
    from eagledata.extract.plan import PLAN_FORMAT

    m = json.loads((tokens / "manifest.json").read_text())
    shards = [{"key": f"{k:016x}", **e} for k, e in enumerate(m["shards"])]
    plan.write_text(json.dumps({"format": PLAN_FORMAT, "dataset": m["dataset"], "tokenizer_fingerprint":
                                m["tokenizer_fingerprint"], "token_store": str(tokens), "shards": shards}))
    return shards


def test_per_shard_jobs_give_the_one_process_extraction_and_resume_on_code_identity(tmp_path, fp32_out, token_rows,
                                                                                     weights, model):
    """extract_keyed_shard per key + gather_hidden: the same tensors, index and per-shard checks as
    extract_dataset; a second job with the same source, settings and code keeps the stored shard
    untouched (resumed, checks from the sidecar); another code fingerprint re-extracts it."""
    from eagledata.extract.gather import gather_hidden
    from eagledata.extract.pershard import ExtractionSettings, extract_keyed_shard
    from eagledata.extract.storage import read_index

    root, one_job = fp32_out
    tokens = write_tokens(tmp_path / "tokens", token_rows)
    plan = tmp_path / "plan.json"
    shards = _per_shard_plan(tokens, plan)
    store, work = tmp_path / "hidden.store", tmp_path / "hidden.work"
    settings = ExtractionSettings(weights=str(weights), dtype="float32", device="cpu", batch_tokens=200,
                                  code_fingerprint="code-1")

    def run_all(s):
        return [extract_keyed_shard(plan, e["key"], tokens / e["file"], store, work / f"{e['key']}.json", s,
                                    model=model) for e in shards]

    first = run_all(settings)
    manifest = gather_hidden(plan, [work / f"{e['key']}.json" for e in shards], tmp_path / "hidden", store, settings)
    assert [s["file"] for s in manifest["shards"]] == [s["file"] for s in one_job["shards"]]
    for ours, theirs in zip(manifest["shards"], one_job["shards"]):
        a, b = load_file(tmp_path / "hidden" / ours["file"]), load_file(root / "hidden" / theirs["file"])
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert ours["checks"] == theirs["checks"] and ours["samples"] == theirs["samples"]
    assert read_index(tmp_path / "hidden").equals(read_index(root / "hidden"))
    assert {k: manifest[k] for k in ("samples", "tokens", "layers", "final_norm", "dtype", "format")} == {
        k: one_job[k] for k in ("samples", "tokens", "layers", "final_norm", "dtype", "format")}
    assert not any(r["resumed"] for r in first)
    stamps = {p.name: p.stat().st_mtime_ns for p in store.iterdir()}
    again = run_all(settings)
    assert all(r["resumed"] for r in again) and [r["checks"] for r in again] == [r["checks"] for r in first]
    assert {p.name: p.stat().st_mtime_ns for p in store.iterdir()} == stamps
    changed = run_all(ExtractionSettings(**{**settings.__dict__, "code_fingerprint": "code-2"}))
    assert not any(r["resumed"] for r in changed)
    assert all(p.stat().st_mtime_ns != stamps[p.name] for p in store.glob("*.safetensors"))
    # another backend, or SGLang's server arguments (quantization...), is another shard: never reused
    from eagledata.extract.pershard import stored_record
    from eagledata.extract.storage import output_name

    code2 = ExtractionSettings(**{**settings.__dict__, "code_fingerprint": "code-2"})
    tokens_manifest = json.loads((tokens / "manifest.json").read_text())
    dst = store / output_name(shards[0]["file"])
    assert stored_record(code2.run(tokens_manifest, store), dst, shards[0]["sha256"]) is not None
    # without a max_seq_len, on_long decides nothing: the stored shard is reused; with one, it is not
    assert stored_record(ExtractionSettings(**{**code2.__dict__, "on_long": "skip"}).run(tokens_manifest, store),
                         dst, shards[0]["sha256"]) is not None
    # a limit acts on a shard only when one of its samples exceeds it: one that none reaches keeps the
    # stored shard (known from the source's lengths; without them the limit counts), one that some
    # sample exceeds does not
    src = tokens / shards[0]["file"]
    from eagledata.extract.storage import read_token_shard

    longest = max(read_token_shard(src).lengths)
    for limit, kept in ((10 ** 6, True), (longest, True), (longest - 1, False)):
        for on_long in ("truncate", "skip"):
            run = ExtractionSettings(**{**code2.__dict__, "max_seq_len": limit, "on_long": on_long}).run(tokens_manifest, store)
            assert (stored_record(run, dst, shards[0]["sha256"], src) is not None) == kept, (limit, on_long)
            assert stored_record(run, dst, shards[0]["sha256"]) is None
    # and the other way: shards extracted under a limit none of their samples reaches are kept without it
    code3 = {**settings.__dict__, "code_fingerprint": "code-3"}
    assert not any(r["resumed"] for r in run_all(ExtractionSettings(**{**code3, "max_seq_len": longest + 1000})))
    assert all(r["resumed"] for r in run_all(ExtractionSettings(**code3)))
    from eagledata.extract.limits import limit_summary  # and the manifest says so

    assert (limit_summary([], None, "skip")["on_long"], limit_summary([], 20, "skip")["on_long"]) == ("truncate", "skip")
    for other in ({"backend": "sglang"}, {"backend": "sglang", "backend_options": {"server_args": {"quantization": "fp8"}}}):
        run = ExtractionSettings(**{**code2.__dict__, **other}).run(tokens_manifest, store)
        assert stored_record(run, dst, shards[0]["sha256"]) is None, other
    quantized = ExtractionSettings(**{**code2.__dict__, "backend": "sglang",
                                      "backend_options": {"server_args": {"quantization": "fp8"}}})
    assert quantized.backend_args() == '{"quantization":"fp8"}' and code2.backend_args() == ""


def test_a_renamed_dataset_takes_its_shards_from_the_old_store(tmp_path, token_rows, weights, model):
    """Shard names are content names: a dataset's shard job finds a shard another dataset's store holds
    for exactly its source, settings, model and code (a renamed or copied dataset) and hard-links it
    (with its sidecar) instead of extracting; other settings extract; the old store's pruning then
    leaves the new store's files intact."""
    from eagledata.extract.gather import prune_store
    from eagledata.extract.pershard import ExtractionSettings, extract_keyed_shard

    tokens = write_tokens(tmp_path / "tokens", token_rows)
    plan = tmp_path / "plan.json"
    shards = _per_shard_plan(tokens, plan)
    settings = ExtractionSettings(weights=str(weights), dtype="float32", device="cpu", batch_tokens=200,
                                  code_fingerprint="code-1")
    results = tmp_path / "results"

    def run_all(dataset, s):
        store = results / dataset / "hidden.store"
        return store, [extract_keyed_shard(plan, e["key"], tokens / e["file"], store,
                                           results / dataset / "hidden.work" / f"{e['key']}.json", s, model=model)
                       for e in shards]

    old, first = run_all("old", settings)
    assert not any(r["resumed"] for r in first)
    new, again = run_all("new", settings)
    assert all(r["resumed"] for r in again) and [r["sha256"] for r in again] == [r["sha256"] for r in first]
    for r in again:
        assert (new / r["file"]).stat().st_ino == (old / r["file"]).stat().st_ino
    prune_store(old, [])
    assert not any(old.iterdir()) and all((new / r["file"]).is_file() for r in again)
    _, other = run_all("other", ExtractionSettings(**{**settings.__dict__, "code_fingerprint": "code-2"}))
    assert not any(r["resumed"] for r in other)


def test_a_shard_whose_job_ran_other_code_is_not_published(tmp_path, token_rows, weights, model):
    """extract_keyed_shard's ``verify`` (the job's check that the code it ran is its stamps' code) runs
    before a new shard's sidecar is written: when it raises, the shard is removed, so no later job takes
    it from the store under the stamps' key; the next job extracts it."""
    from eagledata.codeinputs import CodeChangedError
    from eagledata.extract.pershard import ExtractionSettings, extract_keyed_shard

    tokens = write_tokens(tmp_path / "tokens", token_rows)
    plan = tmp_path / "plan.json"
    entry = _per_shard_plan(tokens, plan)[0]
    settings = ExtractionSettings(weights=str(weights), dtype="float32", device="cpu", batch_tokens=200,
                                  code_fingerprint="code-1")
    store = tmp_path / "hidden.store"

    def run(verify=None):
        return extract_keyed_shard(plan, entry["key"], tokens / entry["file"], store, tmp_path / "rec.json", settings,
                                   model=model, verify=verify)

    def changed():
        raise CodeChangedError("edited while it ran")

    with pytest.raises(CodeChangedError):
        run(changed)
    assert not any(store.iterdir()), list(store.iterdir())
    assert not (tmp_path / "rec.json").exists()
    assert not run()["resumed"]
    with pytest.raises(CodeChangedError):  # a shard kept from the store is checked too (its record is an output)
        run(changed)
    assert run(lambda: None)["resumed"]


def test_a_shard_job_killed_right_after_publishing_its_shard_leaves_it_kept(tmp_path, token_rows, weights, model,
                                                                          monkeypatch):
    """A new shard's sidecar is written before the shard takes its name: a job killed just after the
    rename (while it used to hash the shard, about 100 s for a 170 GB K2.5 shard) leaves a shard the
    next job keeps, never extracts again."""
    import eagledata.extract.core as core
    from eagledata.extract.pershard import ExtractionSettings, extract_keyed_shard
    from eagledata.io import sha256_file

    tokens = write_tokens(tmp_path / "tokens", token_rows)
    plan = tmp_path / "plan.json"
    entry = _per_shard_plan(tokens, plan)[0]
    settings = ExtractionSettings(weights=str(weights), dtype="float32", device="cpu", batch_tokens=200,
                                  code_fingerprint="code-killed")  # (no other test's store holds it)
    store = tmp_path / "hidden.store"
    real_replace = os.replace

    def replace_then_killed(src, dst):
        real_replace(src, dst)
        if str(dst).endswith(".safetensors"):
            raise KeyboardInterrupt  # the job's end, right after the shard's rename

    with monkeypatch.context() as m:
        m.setattr(core.os, "replace", replace_then_killed)
        with pytest.raises(KeyboardInterrupt):
            extract_keyed_shard(plan, entry["key"], tokens / entry["file"], store, tmp_path / "rec.json", settings,
                                model=model)
    shard = next(store.glob("*.safetensors"))

    class NoModel:
        def __getattr__(self, name):
            raise AssertionError("the model was used: the shard was extracted again")

    again = extract_keyed_shard(plan, entry["key"], tokens / entry["file"], store, tmp_path / "rec.json", settings,
                                model=NoModel())
    assert again["resumed"] and again["file"] == shard.name and again["sha256"] == sha256_file(shard)


def test_shard_jobs_record_their_model_load_and_the_gather_warns_when_loads_dominate(tmp_path, token_rows, weights,
                                                                                      caplog):
    """Every extract_shard job loads the model: its record says how long, the gathered manifest sums the
    jobs' loads against their extraction (``job_time``), and warns when loads take over a quarter."""
    import logging
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from extraction_throughput import extract_per_shard, write_extraction_plan

    from eagledata.extract.gather import job_time
    from eagledata.extract.pershard import ExtractionSettings

    tokens = write_tokens(tmp_path / "tokens", token_rows)
    plan = write_extraction_plan(tokens, tmp_path / "plan.json")
    settings = ExtractionSettings(weights=str(weights), dtype="float32", compute_dtype="float32", device="cpu",
                                  batch_tokens=200)
    with caplog.at_level(logging.WARNING, logger="eagledata.extract.pershard"):
        manifest = extract_per_shard(plan, tmp_path / "hidden", settings, None)  # each shard loads the model
    loads = [s["model_load_s"] for s in manifest["shards"]]
    assert len(loads) == len(token_rows) and all(t > 0 for t in loads)
    timing = manifest["job_time"]
    assert timing == job_time(manifest["shards"]) and timing["jobs"] == len(loads)
    assert timing["model_load_s"] == pytest.approx(sum(loads), abs=1e-3)
    share = timing["model_load_s"] / (timing["model_load_s"] + timing["extract_s"])
    assert timing["load_share"] == pytest.approx(share, abs=1e-4)
    # the demo model loads in a fraction of a second: nothing worth a warning, whatever the share
    assert not [r for r in caplog.records if "loading the model took" in r.getMessage()]
    # a second run finds every shard in the store and loads nothing: no job time counted
    again = extract_per_shard(plan, tmp_path / "hidden", settings, None)
    assert all(s["resumed"] for s in again["shards"]) and again["job_time"]["jobs"] == 0
    # the rule of the warning, on made-up jobs: a third of the time and 90 s loading warns; a tenth, or
    # a third but 3 s in all, does not
    from eagledata.extract.gather import warn_model_loads

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eagledata.extract.pershard"):
        warn_model_loads(job_time([{"model_load_s": 45.0, "seconds": 90.0}] * 2))
        warn_model_loads(job_time([{"model_load_s": 10.0, "seconds": 90.0}] * 2))
        warn_model_loads(job_time([{"model_load_s": 1.5, "seconds": 3.0}] * 2))
        warn_model_loads(job_time([{"model_load_s": 45.0, "seconds": 90.0, "resumed": True}] * 2))
    assert [r.getMessage()[:36] for r in caplog.records] == ["loading the model took 33% of the ex"]


def test_the_model_fingerprint_leaves_out_tokenizer_and_sampling_files(tmp_path):
    """A weights directory's identity (a resume key of its hidden shards; the files the extraction rules
    declare) is its config, weights and other JSON (an index), not the tokenizer's files or
    generation_config.json kept beside them: editing those re-extracted every shard."""
    from eagledata.extract.weights import model_files, model_fingerprint

    files = {"config.json": '{"hidden_size": 8}', "model.safetensors": "w1", "model.safetensors.index.json": "{}",
             "generation_config.json": '{"temperature": 1.0}', "tokenizer_config.json": "{}"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    first = model_fingerprint(tmp_path)
    assert [p.name for p in model_files(tmp_path)] == ["config.json", "model.safetensors", "model.safetensors.index.json"]
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6}')
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "changed"}')
    assert model_fingerprint(tmp_path) == first
    for name, text in (("model.safetensors", "w2"), ("model.safetensors.index.json", '{"a": 1}'), ("config.json", "{}")):
        (tmp_path / name).write_text(text)
        assert model_fingerprint(tmp_path) != first, name
        first = model_fingerprint(tmp_path)


def test_a_large_models_files_count_by_content_read_once_per_version(tmp_path, monkeypatch):
    """Above the full-hash limit, a weight file's digest is remembered by (path, size, mtime, inode): a
    touch or a copy reads it again and keeps the fingerprint (the stored shards), new bytes of the same
    size change it, and an unchanged file is not read again."""
    from eagledata.extract import weights as w

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"a" * 4096)
    cache = tmp_path / "cache"
    first = w.model_fingerprint(model, full_hash_limit=1024, cache=cache)
    reads = []
    real = w._xxh3_file
    monkeypatch.setattr(w, "_xxh3_file", lambda p: reads.append(p.name) or real(p))
    assert w.model_fingerprint(model, full_hash_limit=1024, cache=cache) == first and reads == []
    os.utime(model / "model.safetensors", ns=(1, 1))  # a touch (or a copy without -p)
    assert w.model_fingerprint(model, full_hash_limit=1024, cache=cache) == first and reads == ["model.safetensors"]
    copy = tmp_path / "staged"
    shutil.copytree(model, copy)
    assert w.model_fingerprint(copy, full_hash_limit=1024, cache=cache) == first
    (model / "model.safetensors").write_bytes(b"b" * 4096)  # new weights, same size (a fine-tune)
    assert w.model_fingerprint(model, full_hash_limit=1024, cache=cache) != first
    # new bytes under the old mtime (cp -p, rsync --inplace -t): the ctime tells them apart
    st = (model / "model.safetensors").stat()
    (model / "model.safetensors").write_bytes(b"a" * 4096)
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert w.model_fingerprint(model, full_hash_limit=1024, cache=cache) == first
    for damaged in ("{damaged", "[]"):
        (cache / "weight-digests.json").write_text(damaged)
        assert w.model_fingerprint(copy, full_hash_limit=1024, cache=cache) == first
    # a cache that cannot be used (here a file where its directory should be): the files are read
    (tmp_path / "not-a-dir").write_text("")
    assert w.model_fingerprint(copy, full_hash_limit=1024, cache=tmp_path / "not-a-dir") == first


def test_compute_setting_reads_the_declared_dtype_as_auto_for_hf_only_when_auto_surely_loads_it(tmp_path):
    from eagledata.extract.weights import auto_dtype, compute_setting

    def weights(name: str, cfg: dict) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        return tmp_path / name

    new, old = weights("new", {"dtype": "bfloat16"}), weights("old", {"torch_dtype": "float16"})
    assert compute_setting("bfloat16", "hf", new) == "auto"
    assert compute_setting("float16", "hf", old) == "auto"
    assert compute_setting("float32", "hf", new) == "float32"
    assert compute_setting("bfloat16", "sglang", new) == "bfloat16"  # SGLang's auto is its own
    assert compute_setting("bfloat16", "hf", tmp_path / "missing") == "bfloat16"
    assert compute_setting("bfloat16", "hf", new, built=True) == "bfloat16"  # a job's output: not read
    assert compute_setting("auto", "hf", new) == "auto"
    # transformers 4.x: a quantizer may change a given dtype but not auto; a sub-model is built in its
    # own declared dtype under auto: no equivalence then
    assert auto_dtype(weights("quantized", {"dtype": "bfloat16", "quantization_config": {"quant_method": "awq"}})) is None
    assert auto_dtype(weights("mixed", {"dtype": "bfloat16", "text_config": {"dtype": "float32"}})) is None
    assert auto_dtype(weights("uniform", {"dtype": "bfloat16", "text_config": {"torch_dtype": "bfloat16"},
                                          "vision_config": {"hidden_size": 8}})) == "bfloat16"
    assert auto_dtype(weights("nested_q", {"torch_dtype": "bfloat16", "text_config": {"quantization_config": {}}})) is None


def test_the_default_layers_written_out_read_as_the_default_where_the_layer_count_is_plain(tmp_path):
    """extraction.layers as a shard job's param: the checkpoint's default layers written out read as
    null (the default), from the language model's count (Kimi K2.5's text_config, not its vision
    tower's); anything else, an unplain count or weights a job builds, as written."""
    from eagledata.extract.weights import declared_num_layers, layers_setting

    def weights(name: str, cfg: dict) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        return tmp_path / name

    v3 = weights("v3", {"num_hidden_layers": 61})
    k25 = weights("k25", {"text_config": {"num_hidden_layers": 61}, "vision_config": {"num_hidden_layers": 27}})
    unplain = weights("unplain", {"num_hidden_layers": 61, "language_config": {"num_hidden_layers": 30}})
    assert (declared_num_layers(v3), declared_num_layers(k25), declared_num_layers(unplain)) == (61, 61, None)
    for w in (v3, k25):
        assert layers_setting([1, 29, 57], w) is None and layers_setting(None, w) is None
        assert layers_setting([1, 29, 56], w) == [1, 29, 56] and layers_setting([29, 1, 57], w) == [29, 1, 57]
        assert layers_setting([1, 29, 57], w, built=True) == [1, 29, 57]
    assert layers_setting([1, 29, 57], unplain) == [1, 29, 57]
    assert layers_setting([1, 29, 57], tmp_path / "missing") == [1, 29, 57]


def test_replaced_shards_are_kept_most_recent_first_and_taken_back_also_from_half_moved_pairs(
        tmp_path, token_rows, weights, model):
    """The gather's prune with a cap keeps the shards it takes out in replaced/, by when they were
    replaced (the sidecar's mtime: not the inode's change time, which a chmod or a link resets), up to
    the cap; a cap of 0 empties it; a shard job takes its shard back, also when a killed job or gather
    left the pair half moved; anything else there is removed."""
    from eagledata.extract.gather import prune_store
    from eagledata.extract.pershard import ExtractionSettings, extract_keyed_shard, sidecar_of

    tokens = write_tokens(tmp_path / "tokens", token_rows)
    plan = tmp_path / "plan.json"
    shards = _per_shard_plan(tokens, plan)
    settings = ExtractionSettings(weights=str(weights), dtype="float32", device="cpu", batch_tokens=200,
                                  code_fingerprint="code-1")
    store, replaced = tmp_path / "hidden.store", tmp_path / "hidden.store" / "replaced"

    first = [extract_keyed_shard(plan, e["key"], tokens / e["file"], store, tmp_path / f"{e['key']}.json", settings,
                                 model=model) for e in shards]
    files = [r["file"] for r in first]
    facts = {f: ((store / f).stat().st_mtime_ns, (store / f).read_bytes()) for f in files}
    sizes = [(store / f).stat().st_size for f in files]
    prune_store(store, files[1:], keep_replaced_bytes=10 << 30)  # shard 0 replaced first...
    time.sleep(0.05)  # (file times advance by the kernel's clock tick)
    prune_store(store, [], keep_replaced_bytes=10 << 30)  # ... then shard 1
    assert sorted(p.name for p in replaced.glob("*.safetensors")) == sorted(files)
    os.chmod(replaced / files[0], 0o644)  # its inode's change time is now the newest
    (replaced / "junk.tmp-1").write_bytes(b"x")
    prune_store(store, [], keep_replaced_bytes=sizes[1] + 1)  # room for one: the most recently replaced
    assert sorted(p.name for p in replaced.iterdir()) == sorted([files[1], sidecar_of(Path(files[1])).name])

    prune_store(store, [], keep_replaced_bytes=10 << 30)
    os.replace(replaced / sidecar_of(Path(files[1])).name, store / sidecar_of(Path(files[1])).name)  # half moved

    def boom(*a, **k):
        raise AssertionError("extracted although the shard was kept")

    assert not (replaced / files[0]).exists()  # evicted
    again = extract_keyed_shard(plan, shards[1]["key"], tokens / shards[1]["file"], store, tmp_path / "r1.json",
                                settings, model=boom)
    assert again["resumed"] and ((store / files[1]).stat().st_mtime_ns, (store / files[1]).read_bytes()) == facts[files[1]]
    prune_store(store, [files[1]], keep_replaced_bytes=0)  # a cap of 0: replaced/ emptied
    assert not any(replaced.iterdir())


def test_the_gather_refuses_a_shard_record_of_older_tokens(tmp_path, token_rows, weights, model):
    """A shard job's record is gathered only when it was extracted from the plan's token shard: after a
    tokens rerun that changed which rows train (validation.policy default -> strict), Snakemake left the
    shard job unrun in that run (same key, record present) and the gather published the old hidden
    shard, so both exports held the samples the policy now excluded (demo: 24 of 24 chat samples
    exported, 0 admitted). Now the gather fails and says to run again; the rerun job gathers."""
    from eagledata.extract.gather import gather_hidden
    from eagledata.extract.pershard import ExtractionSettings, extract_keyed_shard
    from eagledata.extract.storage import read_index

    tokens = write_tokens(tmp_path / "tokens", token_rows)
    plan = tmp_path / "plan.json"
    shards = _per_shard_plan(tokens, plan)
    store, work = tmp_path / "hidden.store", tmp_path / "hidden.work"
    settings = ExtractionSettings(weights=str(weights), dtype="float32", device="cpu", batch_tokens=200)
    records = [work / f"{e['key']}.json" for e in shards]
    for e, rec in zip(shards, records):
        extract_keyed_shard(plan, e["key"], tokens / e["file"], store, rec, settings, model=model)
    # the tokens stage re-judged shard 0 under another policy: fewer train rows, a new content-named
    # file, the same stable key; the plan is rewritten, the shard's job has not run again
    rows = [{**r, "train": False} if n < 3 else r for n, r in enumerate(token_rows[0])]
    new = tmp_path / "tokens" / "shard-00000-strict.parquet"
    pl.DataFrame(rows, schema=SCHEMA).write_parquet(new)
    p = json.loads(plan.read_text())
    p["shards"][0].update(file=new.name, sha256=hashlib.sha256(new.read_bytes()).hexdigest())
    plan.write_text(json.dumps(p))
    with pytest.raises(ExtractionError, match="run snakemake again"):
        gather_hidden(plan, records, tmp_path / "hidden", store, settings)
    extract_keyed_shard(plan, shards[0]["key"], new, store, records[0], settings, model=model)
    gather_hidden(plan, records, tmp_path / "hidden", store, settings)
    admitted = [r["id"] for rows in ([r for r in rows], token_rows[1]) for r in rows if r["train"]]
    assert read_index(tmp_path / "hidden").sort("sample")["id"].to_list() == admitted

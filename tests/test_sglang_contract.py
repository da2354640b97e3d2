"""The SGLang backend's shared contract with the HF backend, checked on a CPU without sglang.

sglang cannot be installed or run here (it needs CUDA). What is checked instead:
* the layer mapping: our "output of layer i" == SGLang capture id i + 1, via a fake engine that
  reproduces SGLang's capture rule (``set_eagle3_layers_to_capture(ids)`` stores ids + 1; the
  decoder loop appends the residual stream *before* running each captured layer) on the real
  transformers DeepseekV3 class, against the HF backend's forward hooks;
* SGLang's output layout (aux layers concatenated on the last dim, tokens of a batch packed) and
  its conversion to our per-sample [T, n_layers, H];
* the capture-only logits processor (no logits); the final state before the norm (SGLang's fused
  add-RMSNorm input) and the norm's weight and eps reported by the engine;
* the same shards come out of extract_dataset whichever backend produced the tensors.
The numerical comparison of the two real backends on one model needs a GPU and did not run here.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagledata.extract import core as ex
from eagledata.extract.base import ExtractionError, torch_dtype
from eagledata.extract.hf import HFBackend, find_decoder
from eagledata.extract.layers import default_layers, layer_semantics
from eagledata.extract.norm import final_norm_of
from eagledata.extract import sglang as sr
from eagledata.demo.model import build_demo_model

from test_extract import VOCAB, make_rows, write_tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.set_num_threads(2)
    weights = build_demo_model(tmp_path_factory.mktemp("demo") / "model", VOCAB, seed=0)
    return weights, ex.load_model(weights, device="cpu")


class FakeSGLangEngine:
    """SGLang's capture semantics on a HF decoder: captured id k = the input of decoder layer k
    (= hidden_states + residual in SGLang's fused layout), concatenated in capture order; the final
    state is what the norm receives (its pre-hook), and ``final_norm`` is what SGLangEngine reports
    from rank 0 (the norm module's weight and eps). Tokens of the batch are packed along dim 0, as
    SGLang returns them."""

    def __init__(self, hf_model, layers, add_one=True):
        self.dec = find_decoder(hf_model)
        # what SGLang's set_eagle3_layers_to_capture(layers) stores (add_one=False: an off-by-one bug)
        self.layers_to_capture = [i + 1 for i in layers] if add_one else list(layers)
        self.final_norm = final_norm_of(self.dec.norm)
        self.closed = False

    def extend(self, batch, out_dtype):
        dt = torch_dtype(out_dtype)
        aux_all, final_all = [], []
        for ids in batch:
            got, before = {}, []

            def pre(k):
                def hook(_m, args, kwargs):
                    got[k] = args[0] if args else kwargs["hidden_states"]
                return hook

            handles = [self.dec.layers[k].register_forward_pre_hook(pre(k), with_kwargs=True)
                       for k in self.layers_to_capture if k < self.dec.num_layers]
            handles.append(self.dec.norm.register_forward_pre_hook(lambda _m, a: before.append(a[0])))
            try:
                with torch.inference_mode():
                    out = self.dec.module(input_ids=torch.tensor([ids]), use_cache=False)
            finally:
                for h in handles:
                    h.remove()
            aux_all.append(torch.cat([got[k][0] for k in self.layers_to_capture if k in got], dim=-1))
            assert out.last_hidden_state is not None
            final_all.append(before[-1][0])
        return torch.cat(aux_all).to(dt), torch.cat(final_all).to(dt)

    def close(self):
        self.closed = True


def _backend(hf_model, layers, add_one=True):
    return sr.SGLangBackend(FakeSGLangEngine(hf_model, layers, add_one), layers,
                            num_layers=8, hidden_size=64, vocab_size=VOCAB)


def test_capture_ids_mapping():
    assert sr.sglang_capture_ids(default_layers(61)) == [2, 30, 58]  # K2.5: output of [1, 29, 57]
    assert sr.sglang_capture_ids([1, 3, 4]) == [2, 4, 5]
    assert "SGLang/vLLM aux layer ids [2, 30, 58]" in layer_semantics([1, 29, 57])


def test_split_outputs_layout():
    h, n = 4, 3
    lens = [2, 5]
    layers = [torch.randn(sum(lens), h) for _ in range(n)]
    aux_cat = torch.cat(layers, dim=-1)  # SGLang: torch.cat(aux_hidden_states, dim=-1)
    final = torch.randn(sum(lens), h)
    out = sr.split_outputs(aux_cat, final, lens, n)
    assert [a.shape for a, _ in out] == [(2, n, h), (5, n, h)]
    for j in range(n):
        torch.testing.assert_close(torch.cat([a[:, j] for a, _ in out]), layers[j], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([f for _, f in out]), final, rtol=0, atol=0)
    with pytest.raises(ExtractionError, match="aux width"):
        sr.split_outputs(aux_cat[:, :-1], final, lens, n)
    with pytest.raises(ExtractionError, match="rows"):
        sr.split_outputs(aux_cat, final[:-1], lens, n)


def test_sglang_semantics_equal_hf_backend(model):
    _, hf_model = model
    layers = [1, 3, 5]
    hf = HFBackend(hf_model, layers)
    sg = _backend(hf_model, layers)
    torch.testing.assert_close(sg.final_norm.weight, hf.final_norm.weight, rtol=0, atol=0)
    assert sg.final_norm.eps == hf.final_norm.eps
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (t,), generator=g) for t in (9, 23, 4)]
    for (a1, f1), (a2, f2) in zip(hf.forward(seqs, torch.float32), sg.forward(seqs, torch.float32)):
        assert a1.shape == a2.shape and f1.shape == f2.shape
        torch.testing.assert_close(a2, a1, rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(f2, f1, rtol=1e-5, atol=2e-6)
    # the contract is sharp: capturing ids without SGLang's +1 (an off-by-one) is caught
    bad = _backend(hf_model, layers, add_one=False)
    (a_bad, _), (a_ok, _) = bad.forward(seqs[:1], torch.float32)[0], hf.forward(seqs[:1], torch.float32)[0]
    assert not torch.allclose(a_bad, a_ok, atol=1e-3)


def test_sglang_backend_rejects_last_layer_and_needs_sglang(model):
    _, hf_model = model
    with pytest.raises(ExtractionError, match="cannot be captured"):
        _backend(hf_model, [1, 3, 7])
    if not sr.sglang_available():
        with pytest.raises(ExtractionError, match="sglang is not importable"):
            sr.SGLangBackend.launch(model[0], None)
        with pytest.raises(ExtractionError, match="sglang is not importable"):
            ex.make_backend("sglang", model[0], None)
    with pytest.raises(ExtractionError, match="backend must be one of"):
        ex.make_backend("vllm", model[0], None)
    engine = FakeSGLangEngine(hf_model, [1, 3, 4])
    engine.final_norm = None  # an engine that did not report its norm
    with pytest.raises(ExtractionError, match="did not report its final norm"):
        sr.SGLangBackend(engine, [1, 3, 4], num_layers=8, hidden_size=64, vocab_size=VOCAB)


def test_capture_only_logits_processor_computes_no_logits():
    class LogitsProcessor(torch.nn.Module):  # stands in for sglang's
        pass

    m = sr.CaptureOnly.make(torch.nn, LogitsProcessor())
    h = torch.randn(6, 4)
    aux = [torch.randn(6, 4) for _ in range(3)]

    class Head:  # any use of the LM head would fail
        def __getattr__(self, name):
            raise AssertionError(f"lm_head.{name} used")

    out = m(torch.arange(6), h, Head(), object(), aux)
    torch.testing.assert_close(out.aux_hidden_states, torch.cat(aux, dim=-1), rtol=0, atol=0)
    assert out.last_hidden_states is h and out.next_token_logits is None


def test_kwargs_filtered_to_signature():
    def f(a, b=1):
        return a, b

    def g(a, **kw):
        return a, kw

    assert sr.kwargs_for(f, a=1, b=2, c=3) == {"a": 1, "b": 2}
    assert sr.kwargs_for(g, a=1, c=3) == {"a": 1, "c": 3}


def test_extract_dataset_same_shards_from_either_backend(tmp_path, model):
    weights, hf_model = model
    tokens = write_tokens(tmp_path / "tokens", [make_rows(5, 6, "s")])
    m_hf = ex.extract_dataset(tokens, tmp_path / "hf", weights, dtype="bfloat16", device="cpu", batch_tokens=100,
                              model=hf_model)
    sg = _backend(hf_model, [1, 3, 4])
    m_sg = ex.extract_dataset(tokens, tmp_path / "sg", weights, dtype="bfloat16", device="cpu", batch_tokens=100,
                              model=sg)
    assert m_sg["tokens"] == m_hf["tokens"] and m_sg["layers"] == m_hf["layers"] == [1, 3, 4]
    a, b = load_file(tmp_path / "hf" / "shard-00000.safetensors"), load_file(tmp_path / "sg" / "shard-00000.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape
        torch.testing.assert_close(b[key].float(), a[key].float(), rtol=8e-3, atol=1e-5)  # bf16 rounding of batched vs packed
    with safe_open(tmp_path / "sg" / "shard-00000.safetensors", "pt") as f:
        assert f.metadata()["backend"] == "sglang" and json.loads(f.metadata()["layers"]) == [1, 3, 4]
    assert not sg.engine.closed  # a backend passed in is the caller's to close

"""SGLang backend: SGLang's model runner in-process (tensor parallel), for models too large for
Hugging Face to run fast (Kimi K2.5 on 8 GPUs).

Written against SGLang's own objects, as SpecForge's offline data preparation uses them:
``ServerArgs``/``PortArgs`` -> ``ModelConfig.from_server_args`` -> ``ModelRunner`` (one process per
tensor-parallel rank, device ``gpu_id = rank`` among the job's claimed ``CUDA_VISIBLE_DEVICES``),
requests as ``Req`` in a ``ScheduleBatch`` prepared for extend (prefill only), run as a
``ForwardBatch`` with ``capture_hidden_mode = CaptureHiddenMode.FULL``.

Layer semantics, the shared contract with :class:`eagledata.extract.hf.HFBackend`:

* our ``layers`` mean "output of decoder layer i". SGLang's ``set_eagle3_layers_to_capture(ids)``
  stores ``layers_to_capture = [i + 1 for i in ids]`` and its decoder loop appends
  ``hidden_states + residual`` *before* running layer ``k`` for each ``k`` in that list, i.e. the
  input of layer ``i + 1`` = the output of layer ``i``. So our indices are passed unchanged and
  the captured ids are :func:`sglang_capture_ids` (``[2, 30, 58]`` for K2.5's ``[1, 29, 57]``).
* the aux states come back concatenated along the last dim, ``[N, len(layers) * H]`` in capture
  order (:func:`split_outputs` turns them into our ``[T, len(layers), H]``);
* the final state is stored BEFORE the final norm: taken by a forward pre-hook on the model's
  final norm module (SGLang's fused add-RMSNorm receives ``(hidden_states, residual)``: the
  residual stream is their sum). The norm's weight and epsilon come back from rank 0 when it is
  ready (RMSNorm weights are replicated across tensor-parallel ranks), so the export can derive
  the after-norm state (:mod:`eagledata.extract.norm`).
* no logits: SGLang's ``LogitsProcessor`` modules are replaced by :class:`CaptureOnly`, which
  returns the captured states and never multiplies by the LM head.

sglang is an optional dependency (``pip install -e .[gpu]``) that needs CUDA; nothing here imports it
at module import time. What could not be verified without a GPU: the SGLang calls themselves
(their signatures drift between SGLang releases; keyword arguments are filtered against the
installed version's signatures) and numerical agreement with the HF backend on the same model
(expected within bf16 tolerance). The CPU tests check the contract with a fake engine that
reproduces SGLang's capture rule on a real transformers model.
"""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Any, Sequence

from eagledata.codeinputs import verify_inherited_code
from eagledata.extract.base import ExtractionBackend, ExtractionError, text_config, torch_dtype
from eagledata.extract.layers import resolve_layers
from eagledata.extract.norm import FinalNorm, final_norm_of

log = logging.getLogger("eagledata.extract.sglang")


def sglang_available() -> bool:
    try:
        import sglang  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means unavailable
        return False
    return True


def sglang_capture_ids(layers: Sequence[int]) -> list[int]:
    """SGLang's ``layers_to_capture`` for our "output of layer i" indices (it adds 1 itself)."""
    return [int(i) + 1 for i in layers]


def split_outputs(aux_cat: "Any", final: "Any", lengths: Sequence[int], n_layers: int) -> list[tuple[Any, Any]]:
    """Per-sample ``(aux [T, n_layers, H], final [T, H])`` from SGLang's flat outputs:
    ``aux_cat`` [sum(T), n_layers * H] (layers concatenated on the last dim, capture order) and
    ``final`` [sum(T), H]."""
    total = int(sum(lengths))
    if aux_cat.shape[0] != total or final.shape[0] != total:
        raise ExtractionError(f"SGLang returned {aux_cat.shape[0]} aux / {final.shape[0]} final rows for {total} tokens")
    h = final.shape[-1]
    if aux_cat.shape[-1] != n_layers * h:
        raise ExtractionError(f"SGLang aux width {aux_cat.shape[-1]} != {n_layers} layers x hidden {h}")
    aux = aux_cat.reshape(total, n_layers, h)
    out, a = [], 0
    for t in lengths:
        out.append((aux[a : a + t], final[a : a + t]))
        a += t
    return out


def kwargs_for(fn: Any, **kwargs: Any) -> dict[str, Any]:
    """``kwargs`` restricted to the parameters ``fn`` accepts (SGLang signatures drift)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


class CaptureOnly:
    """Stand-in for SGLang's ``LogitsProcessor``: returns captured hidden states, computes no
    logits. Built lazily as an ``nn.Module`` subclass (torch is imported in the worker only)."""

    @staticmethod
    def make(torch_nn: Any, original: Any) -> Any:
        class CaptureOnlyModule(torch_nn.Module):
            def __init__(self, orig):
                super().__init__()
                self.orig = orig  # kept for attributes other code may read

            def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None, *args, **kwargs):
                import torch

                aux = torch.cat(list(aux_hidden_states), dim=-1) if aux_hidden_states is not None else None
                return Captured(aux_hidden_states=aux, last_hidden_states=hidden_states)

        return CaptureOnlyModule(original)


class Captured:
    """What the model's forward returns under :class:`CaptureOnly` (read by the rank worker)."""

    def __init__(self, aux_hidden_states: Any, last_hidden_states: Any):
        self.aux_hidden_states = aux_hidden_states
        self.last_hidden_states = last_hidden_states
        # attributes SGLang's runner may touch on a logits output
        self.next_token_logits = None
        self.hidden_states = aux_hidden_states


def _find_final_norm(model: Any) -> Any:
    for path in ("model.norm", "language_model.model.norm", "model.model.norm"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None:
            return obj
    raise ExtractionError(f"cannot find the final norm of SGLang model {type(model).__name__}")


class _RankState:
    """One tensor-parallel rank: a loaded SGLang ``ModelRunner`` set up for capture."""

    def __init__(self, server_kwargs: dict[str, Any], port_args: Any, rank: int, layers: list[int]):
        import torch
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.layers.logits_processor import LogitsProcessor
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.server_args import ServerArgs

        server_args = ServerArgs(**server_kwargs)
        self.server_args = server_args
        try:  # environment SGLang's own engine sets up before creating runners (NCCL, kernels)
            from sglang.srt.entrypoints.engine import _set_envs_and_config
        except ImportError:
            _set_envs_and_config = None
        if _set_envs_and_config is not None:
            _set_envs_and_config(server_args)
        model_config = ModelConfig.from_server_args(server_args)
        ep = getattr(server_args, "ep_size", 1) or 1
        self.runner = ModelRunner(**kwargs_for(
            ModelRunner.__init__,
            model_config=model_config,
            mem_fraction_static=server_args.mem_fraction_static,
            gpu_id=rank,
            tp_rank=rank,
            tp_size=server_args.tp_size,
            moe_ep_rank=rank // max(1, server_args.tp_size // ep),
            moe_ep_size=ep,
            pp_rank=0,
            pp_size=1,
            nccl_port=port_args.nccl_port,
            server_args=server_args,
            is_draft_worker=False,
        ))
        model = self.runner.model
        for name, sub in list(model.named_modules()):
            if isinstance(sub, LogitsProcessor):
                parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
                setattr(parent, name.rsplit(".", 1)[-1], CaptureOnly.make(torch.nn, sub))
        if not hasattr(model, "set_eagle3_layers_to_capture"):
            raise ExtractionError(f"SGLang model {type(model).__name__} has no set_eagle3_layers_to_capture: "
                                  "it cannot capture aux hidden states (use extraction.backend: hf)")
        model.set_eagle3_layers_to_capture(list(layers))  # SGLang adds 1: captures ids layers[j] + 1
        self.before: list[Any] = []

        def pre_hook(_module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            residual = args[1] if len(args) > 1 else kwargs.get("residual")
            self.before.append(x + residual if residual is not None else x)

        norm = _find_final_norm(model)
        norm.register_forward_pre_hook(pre_hook, with_kwargs=True)
        fn = final_norm_of(norm)
        self.final_norm = (fn.weight, fn.eps)

    def extend(self, batch: list[list[int]], out_dtype: str) -> tuple[Any, Any] | None:
        """Prefill ``batch`` (token id lists); returns ``(aux_cat, final)`` on the CPU in
        ``out_dtype`` on rank 0 (``None`` elsewhere)."""
        import torch
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        runner = self.runner
        reqs = []
        for k, ids in enumerate(batch):
            req = Req(**kwargs_for(Req.__init__, rid=str(k), origin_input_text="", origin_input_ids=list(ids),
                                    sampling_params=SamplingParams(temperature=0, max_new_tokens=1)))
            req.prefix_indices = []
            req.fill_ids = req.origin_input_ids
            req.extend_input_len = len(req.fill_ids)
            req.logprob_start_len = len(req.origin_input_ids) - 1
            reqs.append(req)
        batch_obj = ScheduleBatch.init_new(**kwargs_for(
            ScheduleBatch.init_new,
            reqs=reqs,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            tree_cache=None,
            model_config=runner.model_config,
            enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        ))
        batch_obj.prepare_for_extend()
        fb = ForwardBatch.init_new(batch_obj.get_model_worker_batch(), runner)
        fb.capture_hidden_mode = CaptureHiddenMode.FULL
        self.before.clear()
        with torch.inference_mode():
            out = runner.forward(fb)
        captured = getattr(out, "logits_output", None) or (out[0] if isinstance(out, tuple) else out)
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()
        if runner.tp_rank != 0:
            return None
        if not isinstance(captured, Captured) or captured.aux_hidden_states is None:
            raise ExtractionError("SGLang forward returned no aux hidden states (capture not enabled?)")
        if not self.before:
            raise ExtractionError("SGLang forward never reached the final norm (pre-norm state not captured)")
        final = self.before[-1]
        dt = torch_dtype(out_dtype)
        return captured.aux_hidden_states.to(dt).cpu(), final.to(dt).cpu()


def _rank_main(rank: int, server_kwargs: dict[str, Any], port_args: Any, layers: list[int],
               inbox: Any, outbox: Any) -> None:  # pragma: no cover - needs GPUs and sglang
    """Worker process of one TP rank: load, report ready (with the final norm's weight and eps),
    then serve ``("extend", batch, dtype)`` until ``None``. Rank 0 puts results (or the error
    text) on ``outbox``."""
    try:
        verify_inherited_code()  # a spawned rank imports the code on disk now: the job's stamps' code?
        state = _RankState(server_kwargs, port_args, rank, layers)
        outbox.put(("ready", (rank, state.final_norm)))
        while True:
            msg = inbox.get()
            if msg is None:
                return
            _, batch, out_dtype = msg
            res = state.extend(batch, out_dtype)
            if rank == 0:
                outbox.put(("ok", res))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        outbox.put(("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}"))


class SGLangEngine:  # pragma: no cover - needs GPUs and sglang
    """``tp_size`` rank processes running :class:`_RankState`; :meth:`extend` sends every rank the
    same batch (tensor parallel) and returns rank 0's result; ``final_norm`` is rank 0's final norm
    (:class:`~eagledata.extract.norm.FinalNorm`)."""

    def __init__(self, weights: str | Path, layers: list[int], *, tp_size: int = 1,
                 compute_dtype: str = "auto", mem_fraction_static: float = 0.85, context_length: int | None = None,
                 server_args: dict[str, Any] | None = None, start_timeout_s: float = 3600):
        import torch.multiprocessing as mp
        from sglang.srt.server_args import PortArgs, ServerArgs

        kwargs = dict(model_path=str(weights), tp_size=int(tp_size), dtype=compute_dtype,
                      mem_fraction_static=mem_fraction_static, enable_return_hidden_states=True,
                      disable_cuda_graph=True, disable_radix_cache=True, trust_remote_code=False)
        if context_length:
            kwargs["context_length"] = int(context_length)
        kwargs.update(server_args or {})
        kwargs = kwargs_for(ServerArgs.__init__, **kwargs)
        port_args = PortArgs.init_new(ServerArgs(**kwargs))
        ctx = mp.get_context("spawn")
        self._inboxes = [ctx.Queue() for _ in range(tp_size)]
        self._outbox = ctx.Queue()
        self._procs = [ctx.Process(target=_rank_main, args=(r, kwargs, port_args, layers,
                                                            self._inboxes[r], self._outbox), daemon=True)
                       for r in range(tp_size)]
        for p in self._procs:
            p.start()
        ready = 0
        self.final_norm: FinalNorm | None = None
        while ready < tp_size:
            kind, payload = self._outbox.get(timeout=start_timeout_s)
            if kind == "error":
                self.close()
                raise ExtractionError(f"SGLang worker failed to start: {payload}")
            rank, (weight, eps) = payload
            if rank == 0:
                self.final_norm = FinalNorm(weight, float(eps))
            ready += 1

    def extend(self, batch: list[list[int]], out_dtype: str) -> tuple[Any, Any]:
        for q in self._inboxes:
            q.put(("extend", batch, out_dtype))
        kind, payload = self._outbox.get()
        if kind == "error":
            raise ExtractionError(f"SGLang forward failed: {payload}")
        return payload

    def close(self) -> None:
        for q in self._inboxes:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


class SGLangBackend(ExtractionBackend):
    """:class:`~eagledata.extract.base.ExtractionBackend` over an engine with
    ``extend(batch: list[list[int]], out_dtype: str) -> (aux_cat [N, n*H], final [N, H])`` in
    SGLang's output layout, ``final`` before the final norm, and ``final_norm`` (a
    :class:`~eagledata.extract.norm.FinalNorm`) (:class:`SGLangEngine` on GPUs; tests pass a fake)."""

    name = "sglang"

    def __init__(self, engine: Any, layers: Sequence[int], num_layers: int, hidden_size: int,
                 vocab_size: int, compute_dtype: str = "auto"):
        if not isinstance(getattr(engine, "final_norm", None), FinalNorm):
            raise ExtractionError("SGLang engine did not report its final norm (weight, eps)")
        self.engine = engine
        self.num_layers = int(num_layers)
        self.hidden_size = int(hidden_size)
        self.vocab_size = int(vocab_size)
        self.layers = resolve_layers(layers, self.num_layers)
        if self.layers and max(self.layers) >= self.num_layers - 1:
            # capture id L would be "before layer L", which SGLang's decoder loop never reaches
            raise ExtractionError(
                f"layer {self.num_layers - 1} (the last) cannot be captured as an aux layer by SGLang "
                f"(capture id {self.num_layers} is past its decoder loop); use layers < {self.num_layers - 1} "
                "or the hf backend")
        self.final_norm = engine.final_norm
        self.compute_dtype = compute_dtype

    @classmethod
    def launch(cls, weights: str | Path, layers: Sequence[int] | None, *, compute_dtype: str = "auto",
               tp_size: int | None = None, **engine_options: Any) -> "SGLangBackend":
        """Start :class:`SGLangEngine` over the job's GPUs (``tp_size`` defaults to the number of
        visible devices, i.e. the claimed ones)."""
        if not sglang_available():
            raise ExtractionError("extraction.backend is 'sglang' but sglang is not importable here; "
                                  "install it on the GPU machine (pip install -e '.[gpu]') or use backend 'hf'")
        cfg = text_config(weights)
        num_layers = int(cfg.num_hidden_layers)
        resolved = resolve_layers(layers, num_layers)
        if tp_size is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            tp_size = max(1, len([g for g in visible.split(",") if g.strip()]))
        engine = SGLangEngine(weights, resolved, tp_size=tp_size, compute_dtype=compute_dtype, **engine_options)
        return cls(engine, resolved, num_layers, int(cfg.hidden_size), int(cfg.vocab_size), compute_dtype)

    def forward(self, seqs, out_dtype):
        lengths = [int(s.numel()) for s in seqs]
        name = str(out_dtype).removeprefix("torch.")
        aux_cat, final = self.engine.extend([s.tolist() for s in seqs], name)
        return split_outputs(aux_cat, final, lengths, len(self.layers))

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

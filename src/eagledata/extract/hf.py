"""The Hugging Face backend: any HF causal LM (``device_map`` across the job's GPUs), run as the base
decoder only (no LM head, no logits), layers captured with forward hooks (:func:`forward_hidden`).
torch and transformers are imported inside functions."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from eagledata.extract.base import (
    ExtractionBackend,
    ExtractionError,
    check_weights_dir,
    torch_dtype,
)
from eagledata.extract.layers import resolve_layers
from eagledata.extract.norm import check_rms_norm, final_norm_of

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(frozen=True)
class Decoder:
    """The base (decoder-only) model and its parts: ``module(input_ids, attention_mask)`` returns
    ``last_hidden_state`` (= output of ``norm``); ``layers[i]`` is decoder layer i."""

    module: Any
    layers: Any
    norm: Any
    num_layers: int
    hidden_size: int


def find_decoder(model: Any) -> Decoder:
    """Locate the decoder stack of a HF model (CausalLM wrapper, base model, or a multimodal
    wrapper with ``language_model``, e.g. Kimi K2.5). Never uses the LM head."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model
    if not hasattr(dec, "layers") and hasattr(dec, "model"):
        dec = dec.model
    if not hasattr(dec, "layers") or not hasattr(dec, "norm"):
        raise ExtractionError(f"cannot find decoder layers and final norm in {type(model).__name__}")
    cfg = dec.config.get_text_config() if hasattr(dec.config, "get_text_config") else dec.config
    n = int(getattr(cfg, "num_hidden_layers", len(dec.layers)))
    return Decoder(dec, dec.layers, dec.norm, n, int(cfg.hidden_size))


def resolve_device(device: str) -> str:
    """``"auto"`` = ``"cuda"`` when CUDA is available, else ``"cpu"``; anything else unchanged."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_model(weights: str | Path, compute_dtype: str = "auto", device: str = "auto") -> Any:
    """Load the model from a HF weights directory, in eval mode, on ``device``.

    ``compute_dtype="auto"`` keeps the checkpoint's dtype (use ``"bfloat16"`` on GPUs).
    ``device="auto"``/``"cuda"`` with several visible GPUs (the job's claimed ones) spreads the
    layers over them (``device_map="auto"``). Uses ``AutoModelForCausalLM``,
    falling back to ``AutoModel`` for configs without a causal-LM class (e.g. ``kimi_k25``)."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    check_weights_dir(weights)
    dev = resolve_device(device)
    kw: dict[str, Any] = {
        "dtype": "auto" if compute_dtype == "auto" else torch_dtype(compute_dtype),
        "local_files_only": True,
    }
    # Several GPUs visible to this job (its claimed ones): spread the layers over them.
    spread = device in ("auto", "cuda") and dev == "cuda" and torch.cuda.device_count() > 1
    if spread:
        kw["device_map"] = "auto"
    try:
        model = AutoModelForCausalLM.from_pretrained(str(weights), **kw)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        model = AutoModel.from_pretrained(str(weights), **kw)
    if not spread:
        model = model.to(dev)
    return model.eval()


# --------------------------------------------------------------------------- capture


def first_output(output: Any) -> "torch.Tensor":
    """A module's output tensor (decoder layers return a tuple whose first entry is the hidden state)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def forward_hidden(
    decoder: Decoder,
    input_ids: "torch.Tensor",
    attention_mask: "torch.Tensor | None",
    layers: Sequence[int],
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """One forward of the base model (no logits), capturing with forward hooks.

    Returns ``aux`` [B, T, len(layers), H] (output of decoder layer ``layers[j]``) and ``final``
    [B, T, H] (the last decoder layer's raw output, BEFORE the final norm: HF's
    ``hidden_states[-1]`` is the norm's output and never holds it), in the model's dtype, on the
    device of the final state."""
    import torch

    last = decoder.num_layers - 1
    wanted = set(layers) | {last}
    captured: dict[int, torch.Tensor] = {}

    def hook_for(i: int):
        def hook(_module, _args, output):
            captured[i] = first_output(output)

        return hook

    handles = [decoder.layers[i].register_forward_hook(hook_for(i)) for i in sorted(wanted)]
    try:
        with torch.inference_mode():
            out = decoder.module(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    missing = wanted - captured.keys()
    if missing:
        raise ExtractionError(f"forward hooks did not fire for layers {sorted(missing)}")
    del out  # the norm's output (last_hidden_state) is derived at export time
    final = captured[last]
    aux = torch.stack([captured[i].to(final.device) for i in layers], dim=2)
    return aux, final


class HFBackend(ExtractionBackend):
    """A loaded Hugging Face model (any wrapper :func:`find_decoder` understands), run as the base
    decoder only: the LM head never runs, so no logits are computed. Layers are captured with
    forward hooks; padded batches are cast to ``out_dtype`` on the device and copied to the CPU
    once per batch. ``final_norm`` is read from the decoder's norm module and checked against the
    RMSNorm formula (:func:`~eagledata.extract.norm.check_rms_norm`)."""

    name = "hf"

    def __init__(self, model: Any, layers: Sequence[int] | None = None, compute_dtype: str = "auto"):
        self.model = model
        self.decoder = find_decoder(model)
        self.num_layers = self.decoder.num_layers
        self.hidden_size = self.decoder.hidden_size
        self.vocab_size = int(self.decoder.module.get_input_embeddings().num_embeddings)
        self.layers = resolve_layers(layers, self.num_layers)
        self.final_norm = final_norm_of(self.decoder.norm)
        check_rms_norm(self.decoder.norm, self.final_norm)
        self.compute_dtype = compute_dtype
        self.model_dtype = str(self.decoder.module.get_input_embeddings().weight.dtype).removeprefix("torch.")

    def forward(self, seqs, out_dtype):
        import torch

        dev = self.decoder.module.get_input_embeddings().weight.device
        lens = [int(s.numel()) for s in seqs]
        t = max(lens)
        ids = torch.zeros((len(seqs), t), dtype=torch.long)
        mask = torch.zeros((len(seqs), t), dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, : lens[b]] = s
            mask[b, : lens[b]] = 1
        aux, final = forward_hidden(self.decoder, ids.to(dev), mask.to(dev), self.layers)
        aux = aux.to(out_dtype).to("cpu")
        final = final.to(out_dtype).to("cpu")
        return [(aux[b, : lens[b]], final[b, : lens[b]]) for b in range(len(seqs))]

    def close(self) -> None:
        self.model = None


def as_backend(model: Any, layers: Sequence[int] | None, compute_dtype: str = "auto") -> ExtractionBackend:
    """``model`` itself when it is a backend (its layers must match), else an :class:`HFBackend`
    around it."""
    if isinstance(model, ExtractionBackend):
        if layers is not None and list(layers) != list(model.layers):
            raise ExtractionError(f"backend captures layers {model.layers}, extraction asked for {list(layers)}")
        return model
    return HFBackend(model, layers, compute_dtype)

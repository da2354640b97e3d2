"""What every extraction backend shares: the error class, the settings' allowed values, the
:class:`ExtractionBackend` base class (``forward(seqs, out_dtype)`` -> per sample ``(aux, final)``),
and reading a weights directory's text config. torch and transformers are imported inside functions
only (:mod:`eagledata.extract.gpus` must set ``CUDA_VISIBLE_DEVICES`` before torch is imported)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from eagledata.errors import EagledataError

if TYPE_CHECKING:  # pragma: no cover
    import torch

DTYPES = ("float32", "bfloat16", "float16")
#: what a shard may be stored in: :data:`DTYPES` or FP8 with a per-token scale (:mod:`eagledata.extract.fp8`)
STORED_DTYPES = DTYPES + ("float8_e4m3fn",)
BACKENDS = ("hf", "sglang")


class ExtractionError(EagledataError):
    """Extraction cannot proceed without producing wrong data (bad input, bad settings)."""


def refuse_final_norm_setting(final_norm: object) -> None:
    """Raise :class:`ExtractionError` for the removed ``final_norm`` setting (any value but ``None``)."""
    if final_norm is not None:
        raise ExtractionError(
            f"extraction.final_norm ({final_norm!r}) was removed: every extraction stores the final hidden state "
            "BEFORE the final norm together with the norm's weight and epsilon, and the SpecForge export derives "
            "the after-norm state from them (vLLM speculators reads the before-norm one); delete the key")


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype named ``name`` (one of :data:`DTYPES`)."""
    import torch

    if name not in DTYPES:
        raise ExtractionError(f"dtype must be one of {DTYPES}, got {name!r}")
    return getattr(torch, name)


def check_weights_dir(weights: str | Path) -> None:
    """Raise :class:`ExtractionError` unless ``weights`` is a local HF model directory."""
    if not (Path(weights) / "config.json").is_file():
        raise ExtractionError(f"model weights directory {weights} has no config.json (a local HF model dir is required)")


def text_config(weights: str | Path) -> Any:
    """The text model's config of a HF weights directory (the language model of a multimodal one)."""
    from transformers import AutoConfig

    check_weights_dir(weights)
    cfg = AutoConfig.from_pretrained(str(weights), local_files_only=True)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


class ExtractionBackend:
    """What extraction needs from a model, whatever runs it.

    ``forward(seqs, out_dtype)`` takes 1-D int64 CPU tensors (one per sample, unpadded) and returns,
    per sample and in order, ``(aux, final)`` on the CPU in ``out_dtype``: ``aux`` [T, len(layers), H]
    with ``aux[:, j]`` the output of decoder layer ``layers[j]`` (0-based), ``final`` [T, H] the
    last decoder layer's output BEFORE the model's final norm. ``final_norm`` is that norm's
    :class:`~eagledata.extract.norm.FinalNorm` (weight, eps), stored with the shards."""

    name = "base"
    num_layers: int
    hidden_size: int
    vocab_size: int
    layers: list[int]
    final_norm: Any  # eagledata.extract.norm.FinalNorm
    compute_dtype: str = "auto"

    def forward(self, seqs: Sequence["torch.Tensor"], out_dtype: "torch.dtype") -> list[tuple["torch.Tensor", "torch.Tensor"]]:
        raise NotImplementedError

    def close(self) -> None:
        """Release the model (processes, GPU memory)."""

"""Hidden-state extraction: token shards -> EAGLE-3 training tensors (token-major safetensors).

Layer convention (the classic off-by-one, pinned by tests against forward hooks):

* ``layers`` are 0-based decoder-layer indices meaning "the OUTPUT of decoder layer i" (the
  residual stream after layer i). That is Hugging Face ``output_hidden_states[i + 1]`` (entry 0 is
  the embeddings) and what SGLang/vLLM name aux layer ``i + 1`` (the input of layer i + 1; SGLang's
  ``set_eagle3_layers_to_capture(layers)`` stores ``layers_to_capture = [i + 1 for i in layers]``).
  Default ``[1, L//2 - 1, L - 4]``: ``[1, 29, 57]`` for L = 61 (HF/SGLang/vLLM ``[2, 30, 58]``).
  Exception: asking for ``i = L - 1`` gives that layer's raw output, whereas HF's last entry
  ``hidden_states[L]`` is the final-norm output.
* ``final_norm="after"``: ``hidden_state`` is the output of the model's final norm (HF
  ``hidden_states[-1]``; SpecForge's convention: its trainer applies only ``lm_head``).
  ``"before"``: the raw output of the last decoder layer (vLLM speculators' convention: vLLM aux id
  ``L``); HF's ``hidden_states`` never contains it, so it is taken with a hook.

Backends (:class:`ExtractionBackend`): :class:`HFBackend` here (any HF causal LM, device_map across
the job's GPUs, no LM head / logits), and ``eagledata.extract.sglang.SGLangBackend`` (SGLang's model
runner in-process, tensor parallel). Both return, per sample, ``aux`` [T, n_layers, H] and
``final`` [T, H] with the semantics above; everything after that (layout, files) is shared.

Output (one safetensors file per token shard, token-major; S samples, N tokens in total):

* ``input_ids`` [N] int64, ``loss_mask`` [N] int8 (1 on completion positions, index >=
  ``prompt_len``), ``aux_hidden_states`` [N, n_layers, H] and ``hidden_state`` [N, H] in the target
  dtype, ``sample_offsets`` [S + 1] int64 (sample k is rows ``offsets[k]:offsets[k+1]``);
* string metadata: ``sample_ids`` (JSON list), ``layers`` (JSON list), ``layer_semantics``,
  ``final_norm``, ``dtype``, ``compute_dtype``, ``backend``, ``model_path``, ``model_fingerprint``,
  ``tokenizer_fingerprint``, ``source_file``, ``source_sha256``, ``samples``, ``tokens``,
  ``hidden_size``, ``num_layers``, ``format``.

Beside the shards: ``index.parquet`` (one row per sample: ``id``, ``shard``, ``row``, ``offset``,
``length``, ``prompt_len``, ``sample``) and ``manifest.json`` (settings, per-shard counts, bytes and
sha256 of every output shard).

Files are streamed to disk (the header is computed up front from the token counts, so a shard's
tensors are never all held in memory: K2.5 produces ~57 KB per token), written by a background
thread while the next batch runs, checked against free disk space before a shard starts, and
published atomically (``shard.tmp-PID`` then ``os.replace``).

torch and transformers are imported inside functions so that :func:`eagledata.extract.gpus.claim_gpus` can
set ``CUDA_VISIBLE_DEVICES`` before torch is ever imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import queue
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("eagledata.extract.core")

FORMAT = "eagledata-hidden/1"
FINAL_NORM_CHOICES = ("after", "before")
DTYPES = ("float32", "bfloat16", "float16")
_ST_CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64", "int8": "I8"}
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int8": 1}
_TOKEN_COLUMNS = ["id", "input_ids", "prompt_len", "completion_len", "train"]
BACKENDS = ("hf", "sglang")


class ExtractionError(Exception):
    """Extraction cannot proceed without producing wrong data (bad input, bad settings)."""


# --------------------------------------------------------------------------- layer semantics


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's three target layers ``[1, L//2 - 1, L - 4]`` as "output of decoder layer i".

    = HF ``output_hidden_states[i + 1]`` and SGLang/vLLM aux layer ids ``i + 1``.
    ``default_layers(61) == [1, 29, 57]``. Requires ``num_layers >= 5`` (all three distinct)."""
    if num_layers < 5:
        raise ExtractionError(f"default EAGLE-3 layers need at least 5 decoder layers, model has {num_layers}")
    return [1, num_layers // 2 - 1, num_layers - 4]


def resolve_layers(layers: Sequence[int] | None, num_layers: int) -> list[int]:
    """``layers`` validated against the model (each 0 <= i < L, no duplicates, order kept), or
    :func:`default_layers` when ``None``."""
    if layers is None:
        return default_layers(num_layers)
    out = [int(i) for i in layers]
    if not out:
        raise ExtractionError("extraction layers must not be empty")
    bad = [i for i in out if not 0 <= i < num_layers]
    if bad:
        raise ExtractionError(f"layers {bad} out of range for a {num_layers}-layer model (0-based 'output of layer i')")
    if len(set(out)) != len(out):
        raise ExtractionError(f"duplicate layers in {out}")
    return out


def layer_semantics(layers: Sequence[int], final_norm: str) -> str:
    """Human-readable statement of what the stored tensors are (written into every shard)."""
    hf = [i + 1 for i in layers]
    final = (
        "hidden_state is the output of the model's final norm (HF output_hidden_states[-1]; SpecForge convention)"
        if final_norm == "after"
        else "hidden_state is the raw output of the last decoder layer, BEFORE the final norm "
        "(vLLM speculators convention; not in HF output_hidden_states)"
    )
    return (
        f"aux_hidden_states[:, j, :] is the output of decoder layer layers[j] (0-based) for layers={list(layers)}; "
        f"= HF output_hidden_states{hf} (index 0 = embeddings) = SGLang/vLLM aux layer ids {hf}. {final}."
    )


# --------------------------------------------------------------------------- hashing / io


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def model_fingerprint(weights: str | Path, full_hash_limit: int = 256 << 20) -> str:
    """Identity of a weights directory: sha256 over ``config.json`` and the weight files' contents
    when they total at most ``full_hash_limit`` bytes, else over their names, sizes and mtimes
    (hashing hundreds of GB to decide a resume is not worth it; a rebuild then forces a rerun)."""
    root = Path(weights)
    h = hashlib.sha256()
    cfg = root / "config.json"
    h.update(cfg.read_bytes() if cfg.exists() else str(root).encode())
    files = sorted(p for p in root.glob("*") if p.suffix in (".safetensors", ".bin", ".json") and p.name != "config.json")
    total = sum(p.stat().st_size for p in files)
    for p in files:
        h.update(p.name.encode() + b"\0")
        if total <= full_hash_limit:
            h.update(sha256_file(p).encode())
        else:
            st = p.stat()
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- streaming safetensors


class SafetensorsStreamWriter:
    """Write a safetensors file whose tensor shapes are known up front, rows in any order.

    The header (with ``__metadata__``) is written first; each tensor's first dimension is then
    filled by :meth:`write_rows`. :meth:`close` raises unless every row of every tensor was written
    exactly as many times as it has rows. Little-endian host assumed (x86, ARM)."""

    def __init__(self, path: str | Path, specs: Sequence[tuple[str, str, Sequence[int]]], metadata: dict[str, str]):
        header: dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
        self._layout: dict[str, tuple[int, int, str, tuple[int, ...]]] = {}
        off = 0
        for name, dtype, shape in specs:
            shape = tuple(int(s) for s in shape)
            row = math.prod(shape[1:]) * _ITEMSIZE[dtype]
            nbytes = shape[0] * row
            header[name] = {"dtype": _ST_CODES[dtype], "shape": list(shape), "data_offsets": [off, off + nbytes]}
            self._layout[name] = (off, row, dtype, shape)
            off += nbytes
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
        raw += b" " * (-len(raw) % 8)
        self._fh = open(path, "wb")
        self._fh.write(struct.pack("<Q", len(raw)))
        self._fh.write(raw)
        self._base = 8 + len(raw)
        self._fh.truncate(self._base + off)
        self._rows_written = {name: 0 for name in self._layout}

    def write_rows(self, name: str, row_start: int, tensor: "torch.Tensor") -> None:
        import torch

        off, row, dtype, shape = self._layout[name]
        t = tensor.detach().to("cpu").contiguous()
        if str(t.dtype).removeprefix("torch.") != dtype or tuple(t.shape[1:]) != shape[1:]:
            raise ExtractionError(f"{name}: got {t.dtype} {tuple(t.shape)}, expected {dtype} [*, {shape[1:]}]")
        if row_start < 0 or row_start + t.shape[0] > shape[0]:
            raise ExtractionError(f"{name}: rows {row_start}..{row_start + t.shape[0]} outside [0, {shape[0]})")
        self._fh.seek(self._base + off + row_start * row)
        self._fh.write(memoryview(t.view(torch.uint8).numpy() if t.numel() else b""))
        self._rows_written[name] += t.shape[0]

    def close(self) -> None:
        incomplete = {n: (w, self._layout[n][3][0]) for n, w in self._rows_written.items() if w != self._layout[n][3][0]}
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        if incomplete:
            raise ExtractionError(f"incomplete safetensors write (rows written, expected): {incomplete}")

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._fh.close()


# --------------------------------------------------------------------------- model access


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


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    if name not in DTYPES:
        raise ExtractionError(f"dtype must be one of {DTYPES}, got {name!r}")
    return getattr(torch, name)


def _check_weights_dir(weights: str | Path) -> None:
    if not (Path(weights) / "config.json").is_file():
        raise ExtractionError(f"model weights directory {weights} has no config.json (a local HF model dir is required)")


def load_model(weights: str | Path, compute_dtype: str = "auto", device: str = "auto") -> Any:
    """Load the model from a HF weights directory, in eval mode, on ``device``.

    ``compute_dtype="auto"`` keeps the checkpoint's dtype (use ``"bfloat16"`` on GPUs).
    ``device="auto"``/``"cuda"`` with several visible GPUs (the job's claimed ones) spreads the
    layers over them (``device_map="auto"``). Uses ``AutoModelForCausalLM``,
    falling back to ``AutoModel`` for configs without a causal-LM class (e.g. ``kimi_k25``)."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    _check_weights_dir(weights)
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


def _first(output: Any) -> "torch.Tensor":
    return output[0] if isinstance(output, (tuple, list)) else output


def forward_hidden(
    decoder: Decoder,
    input_ids: "torch.Tensor",
    attention_mask: "torch.Tensor | None",
    layers: Sequence[int],
    final_norm: str = "after",
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """One forward of the base model (no logits), capturing with forward hooks.

    Returns ``aux`` [B, T, len(layers), H] (output of decoder layer ``layers[j]``) and ``final``
    [B, T, H] (final-norm output for ``"after"``, raw last-layer output for ``"before"``), in the
    model's dtype, on the device of the final state."""
    import torch

    if final_norm not in FINAL_NORM_CHOICES:
        raise ExtractionError(f"final_norm must be one of {FINAL_NORM_CHOICES}, got {final_norm!r}")
    last = decoder.num_layers - 1
    wanted = set(layers) | ({last} if final_norm == "before" else set())
    captured: dict[int, torch.Tensor] = {}

    def hook_for(i: int):
        def hook(_module, _args, output):
            captured[i] = _first(output)

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
    final = out.last_hidden_state if final_norm == "after" else captured[last]
    aux = torch.stack([captured[i].to(final.device) for i in layers], dim=2)
    return aux, final


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group sample indices into batches of similar length, longest first, so that
    ``len(batch) * max_length <= batch_tokens`` (padded size); a sample longer than the budget
    forms a batch of its own. Every index appears exactly once."""
    if batch_tokens < 1:
        raise ExtractionError(f"batch_tokens must be >= 1, got {batch_tokens}")
    order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))
    batches: list[list[int]] = []
    cur: list[int] = []
    for k in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(k)
    if cur:
        batches.append(cur)
    return batches


def forward_batch(
    decoder: Decoder,
    seqs: Sequence["torch.Tensor"],
    layers: Sequence[int],
    final_norm: str = "after",
    pad_id: int = 0,
) -> list[tuple["torch.Tensor", "torch.Tensor"]]:
    """Right-pad ``seqs`` (1-D int64) into one batch with an attention mask, run
    :func:`forward_hidden`, and return per sample ``(aux [T, n, H], final [T, H])`` with pad
    positions dropped. Right padding leaves real positions' position ids and causal attention
    unchanged; pad tokens are routed through MoE experts too, which (no capacity limit in the HF
    implementation) does not affect other tokens."""
    import torch

    dev = decoder.module.get_input_embeddings().weight.device
    lens = [int(s.numel()) for s in seqs]
    t = max(lens)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), t), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : lens[b]] = s
        mask[b, : lens[b]] = 1
    aux, final = forward_hidden(decoder, ids.to(dev), mask.to(dev), layers, final_norm)
    return [(aux[b, : lens[b]], final[b, : lens[b]]) for b in range(len(seqs))]


# --------------------------------------------------------------------------- backends


class ExtractionBackend:
    """What extraction needs from a model, whatever runs it.

    ``forward(seqs, out_dtype)`` takes 1-D int64 CPU tensors (one per sample, unpadded) and returns,
    per sample and in order, ``(aux, final)`` on the CPU in ``out_dtype``: ``aux`` [T, len(layers), H]
    with ``aux[:, j]`` the output of decoder layer ``layers[j]`` (0-based), ``final`` [T, H] the
    final state after (``final_norm="after"``) or before (``"before"``) the model's final norm."""

    name = "base"
    num_layers: int
    hidden_size: int
    vocab_size: int
    layers: list[int]
    final_norm: str
    compute_dtype: str = "auto"

    def forward(self, seqs: Sequence["torch.Tensor"], out_dtype: "torch.dtype") -> list[tuple["torch.Tensor", "torch.Tensor"]]:
        raise NotImplementedError

    def close(self) -> None:
        """Release the model (processes, GPU memory)."""


class HFBackend(ExtractionBackend):
    """A loaded Hugging Face model (any wrapper :func:`find_decoder` understands), run as the base
    decoder only: the LM head never runs, so no logits are computed. Layers are captured with
    forward hooks; padded batches are cast to ``out_dtype`` on the device and copied to the CPU
    once per batch."""

    name = "hf"

    def __init__(self, model: Any, layers: Sequence[int] | None = None, final_norm: str = "after",
                 compute_dtype: str = "auto"):
        if final_norm not in FINAL_NORM_CHOICES:
            raise ExtractionError(f"final_norm must be one of {FINAL_NORM_CHOICES}, got {final_norm!r}")
        self.model = model
        self.decoder = find_decoder(model)
        self.num_layers = self.decoder.num_layers
        self.hidden_size = self.decoder.hidden_size
        self.vocab_size = int(self.decoder.module.get_input_embeddings().num_embeddings)
        self.layers = resolve_layers(layers, self.num_layers)
        self.final_norm = final_norm
        self.compute_dtype = compute_dtype

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
        aux, final = forward_hidden(self.decoder, ids.to(dev), mask.to(dev), self.layers, self.final_norm)
        aux = aux.to(out_dtype).to("cpu")
        final = final.to(out_dtype).to("cpu")
        return [(aux[b, : lens[b]], final[b, : lens[b]]) for b in range(len(seqs))]

    def close(self) -> None:
        self.model = None


def as_backend(model: Any, layers: Sequence[int] | None, final_norm: str, compute_dtype: str = "auto") -> ExtractionBackend:
    """``model`` itself when it is a backend (its layers and final_norm must match), else an
    :class:`HFBackend` around it."""
    if isinstance(model, ExtractionBackend):
        if layers is not None and list(layers) != list(model.layers):
            raise ExtractionError(f"backend captures layers {model.layers}, extraction asked for {list(layers)}")
        if final_norm != model.final_norm:
            raise ExtractionError(f"backend final_norm {model.final_norm!r} != requested {final_norm!r}")
        return model
    return HFBackend(model, layers, final_norm, compute_dtype)


# --------------------------------------------------------------------------- shards


@dataclass
class TokenShard:
    """The ``train`` rows of one token shard, in shard order."""

    ids: list[str]
    input_ids: Any  # numpy int64, all samples concatenated
    offsets: Any  # numpy int64 [S + 1]
    prompt_lens: Any  # numpy int64 [S]

    @property
    def lengths(self) -> list[int]:
        import numpy as np

        return np.diff(self.offsets).tolist()


def read_token_shard(path: str | Path) -> TokenShard:
    """Read a tokens parquet shard, keep rows with ``train == True``, and check each row:
    ``prompt_len + completion_len == len(input_ids) > 0``, ``0 <= prompt_len``, ``completion_len >= 0``."""
    import numpy as np
    import polars as pl

    df = pl.read_parquet(path)
    missing = [c for c in _TOKEN_COLUMNS if c not in df.columns]
    if missing:
        raise ExtractionError(f"{path}: missing columns {missing}")
    df = df.filter(pl.col("train"))
    lens = df["input_ids"].list.len().fill_null(0).to_numpy().astype(np.int64)
    plen = df["prompt_len"].to_numpy().astype(np.int64)
    clen = df["completion_len"].to_numpy().astype(np.int64)
    ids = df["id"].cast(pl.Utf8).to_list()
    bad = np.nonzero((lens <= 0) | (plen < 0) | (clen < 0) | (plen + clen != lens))[0]
    if bad.size:
        k = int(bad[0])
        raise ExtractionError(
            f"{path}: row id={ids[k]!r}: prompt_len {plen[k]} + completion_len {clen[k]} != len(input_ids) {lens[k]} "
            f"(or empty); {bad.size} bad row(s)"
        )
    if len(set(ids)) != len(ids):
        raise ExtractionError(f"{path}: duplicate sample ids among train rows")
    flat = df["input_ids"].explode().to_numpy().astype(np.int64) if len(df) else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return TokenShard(ids, flat, offsets, plen)


def loss_mask_for(prompt_lens: Sequence[int], offsets: Sequence[int]) -> Any:
    """int8 [N]: 1 at completion positions (index within the sample >= prompt_len), 0 on the prompt."""
    import numpy as np

    n = int(offsets[-1])
    mask = np.zeros(n, dtype=np.int8)
    for k, p in enumerate(prompt_lens):
        mask[int(offsets[k]) + int(p) : int(offsets[k + 1])] = 1
    return mask


def output_name(source_file: str) -> str:
    """``shard-00000.parquet`` -> ``shard-00000.safetensors``."""
    return Path(source_file).with_suffix(".safetensors").name


def read_shard_metadata(path: str | Path) -> dict[str, str] | None:
    """The ``__metadata__`` of a safetensors file, or ``None`` when missing or unreadable."""
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100 << 20:
                return None
            header = json.loads(fh.read(n))
        size = os.path.getsize(path)
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if size != 8 + n + end:
            return None
        return header.get("__metadata__") or {}
    except (OSError, ValueError, KeyError, struct.error):
        return None


#: Metadata keys that must match for an existing output shard to be reused.
RESUME_KEYS = ("format", "source_sha256", "layers", "final_norm", "dtype", "compute_dtype", "model_fingerprint")


def shard_specs(n_tokens: int, n_samples: int, n_layers: int, hidden: int, dtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """Tensor layout of one output shard (names, dtypes, shapes)."""
    return [
        ("input_ids", "int64", (n_tokens,)),
        ("loss_mask", "int8", (n_tokens,)),
        ("sample_offsets", "int64", (n_samples + 1,)),
        ("aux_hidden_states", dtype, (n_tokens, n_layers, hidden)),
        ("hidden_state", dtype, (n_tokens, hidden)),
    ]


def estimate_shard_bytes(n_tokens: int, n_samples: int, n_layers: int, hidden: int, dtype: str,
                         header_bytes: int = 0) -> int:
    """Exact data bytes of a shard (tokens x (n_layers + 1) x H x dtype size, plus ids, mask and
    offsets) plus ``header_bytes``."""
    return header_bytes + sum(math.prod(shape) * _ITEMSIZE[dt] for _, dt, shape in shard_specs(
        n_tokens, n_samples, n_layers, hidden, dtype))


def check_disk_space(path: str | Path, need_bytes: int, reserve_bytes: int = 0) -> None:
    """Raise :class:`ExtractionError` naming ``path`` and the numbers when the filesystem holding
    ``path`` has less than ``need_bytes + reserve_bytes`` free."""
    path = Path(path)
    probe = path if path.exists() else path.parent
    free = shutil.disk_usage(probe).free
    if free < need_bytes + reserve_bytes:
        gib = 1 << 30
        raise ExtractionError(
            f"not enough disk space for {path}: the shard needs {need_bytes:,} bytes ({need_bytes / gib:.2f} GiB)"
            + (f" + {reserve_bytes:,} reserved (extraction.reserve_disk_bytes)" if reserve_bytes else "")
            + f", but only {free:,} bytes ({free / gib:.2f} GiB) are free on the filesystem of {probe}")


class _BackgroundWriter:
    """Writes rows on a thread so the next batch's forward overlaps the disk writes. At most
    ``depth`` batches wait in the queue (bounded memory). The first write error is re-raised by
    :meth:`put` or :meth:`finish`."""

    def __init__(self, writer: SafetensorsStreamWriter, depth: int = 2):
        self._writer = writer
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._err: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="eagledata-shard-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            items = self._q.get()
            if items is None:
                return
            if self._err is not None:
                continue
            try:
                for name, row, tensor in items:
                    self._writer.write_rows(name, row, tensor)
            except BaseException as exc:  # noqa: BLE001 - handed to the producer thread
                self._err = exc

    def put(self, items: list[tuple[str, int, Any]]) -> None:
        if self._err is not None:
            raise self._err
        self._q.put(items)

    def finish(self) -> None:
        self._q.put(None)
        self._thread.join()
        if self._err is not None:
            raise self._err


def extract_shard(
    model: Any,
    src: str | Path,
    dst: str | Path,
    *,
    layers: Sequence[int] | None = None,
    final_norm: str = "after",
    dtype: str = "bfloat16",
    batch_tokens: int = 8192,
    source_sha256: str | None = None,
    tokenizer_fingerprint: str = "",
    model_path: str = "",
    model_fp: str = "",
    compute_dtype: str = "auto",
    reserve_disk_bytes: int = 0,
) -> dict[str, Any]:
    """Extract one token shard ``src`` into the safetensors file ``dst`` (format in the module
    docstring), written to ``dst.tmp-PID`` and published with ``os.replace``.

    ``model``: an :class:`ExtractionBackend`, or a loaded HF model (wrapped in :class:`HFBackend`).
    Samples are the shard's ``train`` rows in shard order; batching (:func:`plan_batches`) does not
    change values beyond float rounding of different batch shapes. Before anything is written the
    free disk space is checked against the shard's exact size (+ ``reserve_disk_bytes``). Returns
    per-shard stats (samples, tokens, seconds, forward_seconds, tokens_per_s)."""
    import torch

    src, dst = Path(src), Path(dst)
    backend = as_backend(model, layers, final_norm, compute_dtype)
    layers = backend.layers
    out_dtype = torch_dtype(dtype)
    source_sha256 = source_sha256 or sha256_file(src)
    t0 = time.perf_counter()
    shard = read_token_shard(src)
    vocab = backend.vocab_size
    if shard.input_ids.size and (shard.input_ids.min() < 0 or shard.input_ids.max() >= vocab):
        raise ExtractionError(
            f"{src}: token ids outside [0, {vocab}) of the model's embedding "
            f"(min {shard.input_ids.min()}, max {shard.input_ids.max()}): wrong model for this tokenizer?"
        )
    n, s, h, nl = int(shard.offsets[-1]), len(shard.ids), backend.hidden_size, len(layers)
    meta = {
        "format": FORMAT,
        "sample_ids": json.dumps(shard.ids, ensure_ascii=False),
        "layers": json.dumps(layers),
        "layer_semantics": layer_semantics(layers, final_norm),
        "final_norm": final_norm,
        "dtype": dtype,
        "compute_dtype": compute_dtype,
        "backend": backend.name,
        "model_path": str(model_path),
        "model_fingerprint": model_fp,
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "source_file": src.name,
        "source_sha256": source_sha256,
        "samples": str(s),
        "tokens": str(n),
        "hidden_size": str(h),
        "num_layers": str(backend.num_layers),
    }
    specs = shard_specs(n, s, nl, h, dtype)
    dst.parent.mkdir(parents=True, exist_ok=True)
    # header is < 100 bytes per sample (ids) + a few KB: count it generously
    need = estimate_shard_bytes(n, s, nl, h, dtype, header_bytes=len(meta["sample_ids"]) + 16384)
    check_disk_space(dst, need, reserve_disk_bytes)
    tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid()}")
    writer = SafetensorsStreamWriter(tmp, specs, meta)
    bg: _BackgroundWriter | None = None
    fwd_s = 0.0
    try:
        writer.write_rows("input_ids", 0, torch.from_numpy(shard.input_ids))
        writer.write_rows("loss_mask", 0, torch.from_numpy(loss_mask_for(shard.prompt_lens, shard.offsets)))
        writer.write_rows("sample_offsets", 0, torch.from_numpy(shard.offsets))
        bg = _BackgroundWriter(writer)
        all_ids = torch.from_numpy(shard.input_ids)
        for batch in plan_batches(shard.lengths, batch_tokens):
            seqs = [all_ids[int(shard.offsets[k]) : int(shard.offsets[k + 1])] for k in batch]
            tf = time.perf_counter()
            results = backend.forward(seqs, out_dtype)
            fwd_s += time.perf_counter() - tf
            items = []
            for k, (aux, final) in zip(batch, results):
                items.append(("aux_hidden_states", int(shard.offsets[k]), aux))
                items.append(("hidden_state", int(shard.offsets[k]), final))
            bg.put(items)
        bg.finish()
        bg = None
        writer.close()
        os.replace(tmp, dst)
    except BaseException:
        if bg is not None:
            with contextlib.suppress(BaseException):
                bg.finish()
        writer.abort()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    secs = time.perf_counter() - t0
    stats = {
        "file": dst.name,
        "source": src.name,
        "source_sha256": source_sha256,
        "samples": s,
        "tokens": n,
        "seconds": round(secs, 3),
        "forward_seconds": round(fwd_s, 3),
        "tokens_per_s": round(n / secs, 1) if secs > 0 else None,
    }
    log.info("%s -> %s: %d samples, %d tokens, %.2f s (forward %.2f s), %.0f tokens/s",
             src.name, dst, s, n, secs, fwd_s, n / secs if secs > 0 else float("nan"))
    return stats


# --------------------------------------------------------------------------- dataset


def read_tokens_manifest(tokens_dir: str | Path, verify: bool = True) -> dict[str, Any]:
    """Load ``tokens_dir/manifest.json``; with ``verify``, check every listed shard exists and
    matches its sha256 (raises :class:`ExtractionError` naming the file)."""
    tokens_dir = Path(tokens_dir)
    path = tokens_dir / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExtractionError(f"tokens manifest not found: {path}") from None
    for entry in manifest.get("shards", []):
        f = tokens_dir / entry["file"]
        if not f.exists():
            raise ExtractionError(f"token shard listed in {path} is missing: {f}")
        if verify:
            got = sha256_file(f)
            if got != entry["sha256"]:
                raise ExtractionError(f"sha256 mismatch for token shard {f}: manifest says {entry['sha256']}, file is {got}")
    return manifest


def _text_config(weights: str | Path) -> Any:
    from transformers import AutoConfig

    _check_weights_dir(weights)
    cfg = AutoConfig.from_pretrained(str(weights), local_files_only=True)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _file_sha256(path: Path, previous: dict[str, dict[str, Any]]) -> str:
    """sha256 of an output shard, reusing the previous manifest's value when the file's size and
    mtime are unchanged (hashing tens of GB again on every resume is not free)."""
    st = path.stat()
    old = previous.get(path.name)
    if old and old.get("sha256") and old.get("bytes") == st.st_size and old.get("mtime_ns") == st.st_mtime_ns:
        return old["sha256"]
    return sha256_file(path)


def write_index(out: str | Path, shards: Sequence[dict[str, Any]], target: str | Path) -> int:
    """Write ``index.parquet`` (atomically) from the output shards' headers: one row per sample,
    columns ``id``, ``shard``, ``row`` (index within the shard), ``offset`` and ``length`` (token
    rows in the shard), ``prompt_len``, ``sample`` (global index, shard order). Returns the rows."""
    import numpy as np
    import polars as pl
    from safetensors import safe_open

    cols: dict[str, list] = {k: [] for k in ("id", "shard", "row", "offset", "length", "prompt_len", "sample")}
    g = 0
    for entry in shards:
        path = Path(target) / entry["file"]
        with safe_open(str(path), "pt") as f:
            ids = json.loads(f.metadata()["sample_ids"])
            offsets = f.get_tensor("sample_offsets").numpy()
            mask = f.get_slice("loss_mask")
            for r, sid in enumerate(ids):
                a, b = int(offsets[r]), int(offsets[r + 1])
                m = mask[a:b].numpy()
                nz = np.flatnonzero(m)
                cols["id"].append(sid)
                cols["shard"].append(entry["file"])
                cols["row"].append(r)
                cols["offset"].append(a)
                cols["length"].append(b - a)
                cols["prompt_len"].append(int(nz[0]) if nz.size else b - a)
                cols["sample"].append(g)
                g += 1
    df = pl.DataFrame(cols, schema={"id": pl.Utf8, "shard": pl.Utf8, "row": pl.Int64, "offset": pl.Int64,
                                    "length": pl.Int64, "prompt_len": pl.Int64, "sample": pl.Int64})
    out = Path(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    df.write_parquet(tmp)
    os.replace(tmp, out)
    return len(df)


def read_index(hidden_dir: str | Path) -> Any:
    """``hidden_dir/index.parquet`` as a polars DataFrame (see :func:`write_index`)."""
    import polars as pl

    path = Path(hidden_dir) / "index.parquet"
    if not path.exists():
        raise ExtractionError(f"hidden-state index not found: {path}")
    return pl.read_parquet(path)


def make_backend(kind: str, weights: str | Path, layers: Sequence[int] | None, final_norm: str,
                 compute_dtype: str = "auto", device: str = "auto", **options: Any) -> ExtractionBackend:
    """Load the model behind backend ``kind`` (``"hf"`` or ``"sglang"``). ``options`` go to the
    SGLang backend (``tp_size``, ``mem_fraction_static``, ``server_args``)."""
    if kind == "hf":
        return HFBackend(load_model(weights, compute_dtype, device), layers, final_norm, compute_dtype)
    if kind == "sglang":
        from eagledata.extract.sglang import SGLangBackend

        return SGLangBackend.launch(weights, layers, final_norm, compute_dtype=compute_dtype, **options)
    raise ExtractionError(f"extraction backend must be one of {BACKENDS}, got {kind!r}")


def extract_dataset(
    tokens_dir: str | Path,
    out_dir: str | Path,
    weights: str | Path,
    layers: Sequence[int] | None = None,
    final_norm: str = "after",
    dtype: str = "bfloat16",
    device: str = "auto",
    batch_tokens: int = 8192,
    *,
    compute_dtype: str = "auto",
    work_dir: str | Path | None = None,
    model: Any = None,
    backend: str = "hf",
    backend_options: dict[str, Any] | None = None,
    reserve_disk_bytes: int = 0,
) -> dict[str, Any]:
    """Extract every shard of ``tokens_dir/manifest.json`` into ``out_dir``; write
    ``index.parquet`` and ``manifest.json`` there. Returns the manifest.

    * Every token shard's sha256 is verified before the model is loaded.
    * The model is loaded once (:func:`make_backend`; ``model`` may be passed in instead: a HF
      model or an :class:`ExtractionBackend`), and not at all when every output shard is done.
    * Resume: an existing output shard whose metadata matches on :data:`RESUME_KEYS` (source
      sha256, layers, final_norm, dtype, compute dtype, model fingerprint) is kept untouched. After
      each shard ``manifest.json`` is rewritten (``"complete": false``) so a resumed run reuses the
      sha256 of finished shards; leftover ``*.tmp-PID`` files of a killed run are removed.
    * Files in the output directory that belong to no current shard are removed.
    * ``work_dir``: write there and finally rename it to ``out_dir`` (for Snakemake, which deletes a
      failed job's declared outputs: an undeclared ``work_dir`` survives for the next try).
    * ``compute_dtype``: dtype the model runs in; ``"auto"`` = the checkpoint's. Outputs are cast to
      ``dtype``.
    """
    if final_norm not in FINAL_NORM_CHOICES:
        raise ExtractionError(f"final_norm must be one of {FINAL_NORM_CHOICES}, got {final_norm!r}")
    if backend not in BACKENDS:
        raise ExtractionError(f"extraction backend must be one of {BACKENDS}, got {backend!r}")
    torch_dtype(dtype)
    if compute_dtype != "auto":
        torch_dtype(compute_dtype)
    if batch_tokens < 1:
        raise ExtractionError(f"batch_tokens must be >= 1, got {batch_tokens}")
    tokens_dir, out_dir = Path(tokens_dir), Path(out_dir)
    target = Path(work_dir) if work_dir is not None else out_dir
    target.mkdir(parents=True, exist_ok=True)
    tmanifest = read_tokens_manifest(tokens_dir, verify=True)
    cfg = _text_config(weights)
    num_layers, hidden = int(cfg.num_hidden_layers), int(cfg.hidden_size)
    layers = resolve_layers(layers, num_layers)
    fp = model_fingerprint(weights)
    tok_fp = str(tmanifest.get("tokenizer_fingerprint", ""))
    want = {
        "format": FORMAT,
        "layers": json.dumps(layers),
        "final_norm": final_norm,
        "dtype": dtype,
        "compute_dtype": compute_dtype,
        "model_fingerprint": fp,
    }
    log.info("extracting %s -> %s: backend %s, layers %s, final_norm %s, dtype %s, model %s",
             tokens_dir, out_dir, backend, layers, final_norm, dtype, weights)
    for stale in target.glob("*.tmp-*"):
        log.info("removing leftover %s of an interrupted run", stale)
        stale.unlink()
    previous: dict[str, dict[str, Any]] = {}
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
        previous = {e["file"]: e for e in json.loads((target / "manifest.json").read_text())["shards"]}

    def manifest_for(shards_out: list[dict[str, Any]], complete: bool) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "complete": complete,
            "dataset": tmanifest.get("dataset"),
            "shards": shards_out,
            "tokens": sum(s["tokens"] for s in shards_out),
            "samples": sum(s["samples"] for s in shards_out),
            "layers": layers,
            "layer_semantics": layer_semantics(layers, final_norm),
            "final_norm": final_norm,
            "dtype": dtype,
            "compute_dtype": compute_dtype,
            "backend": backend,
            "hidden_size": hidden,
            "num_layers": num_layers,
            "model_path": str(weights),
            "model_fingerprint": fp,
            "tokenizer_fingerprint": tok_fp,
            "index": "index.parquet",
            "tensors": {
                "input_ids": "[N] int64",
                "loss_mask": "[N] int8, 1 on completion tokens",
                "aux_hidden_states": f"[N, {len(layers)}, {hidden}] {dtype}",
                "hidden_state": f"[N, {hidden}] {dtype}",
                "sample_offsets": "[S+1] int64",
            },
        }

    shards_out: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    new_tokens = 0
    runner: ExtractionBackend | None = None
    own_runner = False
    try:
        for entry in tmanifest.get("shards", []):
            src = tokens_dir / entry["file"]
            dst = target / output_name(entry["file"])
            meta = read_shard_metadata(dst) if dst.exists() else None
            if meta is not None and all(meta.get(k) == v for k, v in {**want, "source_sha256": entry["sha256"]}.items()):
                log.info("%s: done already (source sha256 and settings match), skipped", dst.name)
                stats = {"file": dst.name, "source": src.name, "source_sha256": entry["sha256"],
                         "samples": int(meta["samples"]), "tokens": int(meta["tokens"]), "resumed": True}
            else:
                if runner is None:
                    if model is not None:
                        runner = as_backend(model, layers, final_norm, compute_dtype)
                    else:
                        log.info("loading model %s (backend %s, device %s, compute dtype %s)",
                                 weights, backend, device, compute_dtype)
                        runner = make_backend(backend, weights, layers, final_norm, compute_dtype, device,
                                              **(backend_options or {}))
                        own_runner = True
                stats = extract_shard(
                    runner, src, dst, layers=layers, final_norm=final_norm, dtype=dtype, batch_tokens=batch_tokens,
                    source_sha256=entry["sha256"], tokenizer_fingerprint=tok_fp, model_path=str(weights),
                    model_fp=fp, compute_dtype=compute_dtype, reserve_disk_bytes=reserve_disk_bytes,
                )
                new_tokens += stats["tokens"]
            st = dst.stat()
            stats["bytes"] = st.st_size
            stats["mtime_ns"] = st.st_mtime_ns
            stats["sha256"] = _file_sha256(dst, previous)
            shards_out.append(stats)
            _atomic_write_text(target / "manifest.json",
                               json.dumps(manifest_for(shards_out, False), indent=2, ensure_ascii=False) + "\n")
    finally:
        if own_runner and runner is not None:
            runner.close()

    keep = {s["file"] for s in shards_out} | {"manifest.json", "index.parquet"}
    for p in target.iterdir():
        if p.name not in keep and p.is_file():
            log.info("removing stale %s", p)
            p.unlink()
    write_index(target / "index.parquet", shards_out, target)
    manifest = manifest_for(shards_out, True)
    _atomic_write_text(target / "manifest.json", json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    if work_dir is not None:
        publish_dir(target, out_dir)
    log.info("done: %d samples, %d tokens (%d newly extracted) in %.1f s",
             manifest["samples"], manifest["tokens"], new_tokens, time.perf_counter() - t0)
    return manifest


def publish_dir(src: str | Path, dst: str | Path) -> None:
    """Move directory ``src`` to ``dst`` (same filesystem, atomic rename); an existing ``dst`` is
    removed first."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.replace(src, dst)


# --------------------------------------------------------------------------- GPU claiming


def claim_gpus(n: int, lock_dir: str | Path | None = None, timeout_s: float = 24 * 3600, poll_s: float = 2.0,
               candidates: Iterable[str] | None = None) -> list[str]:
    """:func:`eagledata.extract.gpus.claim_gpus`, raising :class:`ExtractionError` on failure."""
    from eagledata.extract import gpus

    try:
        return gpus.claim_gpus(n, lock_dir, timeout_s=timeout_s, poll_s=poll_s, candidates=candidates)
    except gpus.GpuClaimError as exc:
        raise ExtractionError(str(exc)) from None

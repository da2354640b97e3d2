"""Hidden-state extraction (Hugging Face backend): token shards -> EAGLE-3 training tensors.

Layer convention (the classic off-by-one, pinned by tests against forward hooks):

* ``layers`` are 0-based decoder-layer indices meaning "the OUTPUT of decoder layer i" (the
  residual stream after layer i). That is Hugging Face ``output_hidden_states[i + 1]`` (entry 0 is
  the embeddings) and what SGLang/vLLM name aux layer ``i + 1`` (the input of layer i + 1).
  Default ``[1, L//2 - 1, L - 4]``: ``[1, 29, 57]`` for L = 61 (HF/SGLang/vLLM ``[2, 30, 58]``).
  Exception: asking for ``i = L - 1`` gives that layer's raw output, whereas HF's last entry
  ``hidden_states[L]`` is the final-norm output.
* ``final_norm="after"``: ``hidden_state`` is the output of the model's final norm (HF
  ``hidden_states[-1]``; SpecForge's convention). ``"before"``: the raw output of the last decoder
  layer (vLLM speculators' convention); HF's ``hidden_states`` never contains it, so it is taken
  with a hook.

Output (one safetensors file per token shard, token-major; S samples, N tokens in total):

* ``input_ids`` [N] int64, ``loss_mask`` [N] int8 (1 on completion positions, index >=
  ``prompt_len``), ``aux_hidden_states`` [N, n_layers, H] and ``hidden_state`` [N, H] in the target
  dtype, ``sample_offsets`` [S + 1] int64 (sample k is rows ``offsets[k]:offsets[k+1]``);
* string metadata: ``sample_ids`` (JSON list), ``layers`` (JSON list), ``layer_semantics``,
  ``final_norm``, ``dtype``, ``compute_dtype``, ``model_path``, ``model_fingerprint``,
  ``tokenizer_fingerprint``, ``source_file``, ``source_sha256``, ``samples``, ``tokens``,
  ``hidden_size``, ``num_layers``, ``format``.

Files are streamed to disk (the header is computed up front from the token counts, so a shard's
tensors are never all held in memory: K2.5 produces ~57 KB per token) and published atomically.

torch and transformers are imported inside functions so that :func:`claim_gpus` can set
``CUDA_VISIBLE_DEVICES`` before torch is ever imported.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("eagledata.extract")

FORMAT = "eagledata-hidden/1"
FINAL_NORM_CHOICES = ("after", "before")
DTYPES = ("float32", "bfloat16", "float16")
_ST_CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64", "int8": "I8"}
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int8": 1}
_TOKEN_COLUMNS = ["id", "input_ids", "prompt_len", "completion_len", "train"]
DEFAULT_GPU_LOCK_DIR = os.environ.get("EAGLEDATA_GPU_LOCK_DIR", "/tmp/eagledata-gpu-locks")


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

    ``compute_dtype="auto"`` keeps the checkpoint's dtype. ``device="auto"`` with several visible
    GPUs spreads the layers over them (``device_map="auto"``). Uses ``AutoModelForCausalLM``,
    falling back to ``AutoModel`` for configs without a causal-LM class (e.g. ``kimi_k25``)."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    _check_weights_dir(weights)
    dev = resolve_device(device)
    kw: dict[str, Any] = {
        "dtype": "auto" if compute_dtype == "auto" else torch_dtype(compute_dtype),
        "local_files_only": True,
    }
    spread = device == "auto" and dev == "cuda" and torch.cuda.device_count() > 1
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
) -> dict[str, Any]:
    """Extract one token shard ``src`` into the safetensors file ``dst`` (format in the module
    docstring), written to ``dst.tmp-PID`` and published with ``os.replace``.

    ``model``: a loaded HF model (any wrapper :func:`find_decoder` understands). Samples are the
    shard's ``train`` rows in shard order; batching (:func:`plan_batches`) does not change values
    beyond float rounding of different batch shapes. Returns per-shard stats (samples, tokens,
    seconds, forward_seconds, tokens_per_s)."""
    import numpy as np
    import torch

    src, dst = Path(src), Path(dst)
    decoder = find_decoder(model)
    layers = resolve_layers(layers, decoder.num_layers)
    out_dtype = torch_dtype(dtype)
    if final_norm not in FINAL_NORM_CHOICES:
        raise ExtractionError(f"final_norm must be one of {FINAL_NORM_CHOICES}, got {final_norm!r}")
    source_sha256 = source_sha256 or sha256_file(src)
    t0 = time.perf_counter()
    shard = read_token_shard(src)
    vocab = decoder.module.get_input_embeddings().num_embeddings
    if shard.input_ids.size and (shard.input_ids.min() < 0 or shard.input_ids.max() >= vocab):
        raise ExtractionError(
            f"{src}: token ids outside [0, {vocab}) of the model's embedding "
            f"(min {shard.input_ids.min()}, max {shard.input_ids.max()}): wrong model for this tokenizer?"
        )
    n, s, h, nl = int(shard.offsets[-1]), len(shard.ids), decoder.hidden_size, len(layers)
    meta = {
        "format": FORMAT,
        "sample_ids": json.dumps(shard.ids, ensure_ascii=False),
        "layers": json.dumps(layers),
        "layer_semantics": layer_semantics(layers, final_norm),
        "final_norm": final_norm,
        "dtype": dtype,
        "compute_dtype": compute_dtype,
        "model_path": str(model_path),
        "model_fingerprint": model_fp,
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "source_file": src.name,
        "source_sha256": source_sha256,
        "samples": str(s),
        "tokens": str(n),
        "hidden_size": str(h),
        "num_layers": str(decoder.num_layers),
    }
    specs = [
        ("input_ids", "int64", (n,)),
        ("loss_mask", "int8", (n,)),
        ("sample_offsets", "int64", (s + 1,)),
        ("aux_hidden_states", dtype, (n, nl, h)),
        ("hidden_state", dtype, (n, h)),
    ]
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid()}")
    writer = SafetensorsStreamWriter(tmp, specs, meta)
    fwd_s = 0.0
    try:
        writer.write_rows("input_ids", 0, torch.from_numpy(shard.input_ids))
        writer.write_rows("loss_mask", 0, torch.from_numpy(loss_mask_for(shard.prompt_lens, shard.offsets)))
        writer.write_rows("sample_offsets", 0, torch.from_numpy(shard.offsets))
        all_ids = torch.from_numpy(shard.input_ids)
        for batch in plan_batches(shard.lengths, batch_tokens):
            seqs = [all_ids[int(shard.offsets[k]) : int(shard.offsets[k + 1])] for k in batch]
            tf = time.perf_counter()
            results = forward_batch(decoder, seqs, layers, final_norm)
            fwd_s += time.perf_counter() - tf
            for k, (aux, final) in zip(batch, results):
                writer.write_rows("aux_hidden_states", int(shard.offsets[k]), aux.to(out_dtype))
                writer.write_rows("hidden_state", int(shard.offsets[k]), final.to(out_dtype))
        writer.close()
        os.replace(tmp, dst)
    except BaseException:
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
) -> dict[str, Any]:
    """Extract every shard of ``tokens_dir/manifest.json`` into ``out_dir`` and write
    ``out_dir/manifest.json``. Returns the manifest.

    * Every token shard's sha256 is verified before the model is loaded.
    * The model is loaded once (:func:`load_model`; ``model`` may be passed in instead), and not at
      all when every output shard is already done.
    * Resume: an existing output shard whose metadata matches on :data:`RESUME_KEYS` (source
      sha256, layers, final_norm, dtype, compute dtype, model fingerprint) is kept untouched.
    * Files in the output directory that belong to no current shard are removed.
    * ``work_dir``: write there and finally rename it to ``out_dir`` (for Snakemake, which deletes a
      failed job's declared outputs: an undeclared ``work_dir`` survives for the next try).
    * ``compute_dtype``: dtype the model runs in; ``"auto"`` = the checkpoint's. Outputs are cast to
      ``dtype``.
    """
    if final_norm not in FINAL_NORM_CHOICES:
        raise ExtractionError(f"final_norm must be one of {FINAL_NORM_CHOICES}, got {final_norm!r}")
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
    log.info("extracting %s -> %s: layers %s, final_norm %s, dtype %s, model %s",
             tokens_dir, out_dir, layers, final_norm, dtype, weights)

    shards_out: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    new_tokens = 0
    for entry in tmanifest.get("shards", []):
        src = tokens_dir / entry["file"]
        dst = target / output_name(entry["file"])
        meta = read_shard_metadata(dst) if dst.exists() else None
        if meta is not None and all(meta.get(k) == v for k, v in {**want, "source_sha256": entry["sha256"]}.items()):
            log.info("%s: done already (source sha256 and settings match), skipped", dst.name)
            stats = {"file": dst.name, "source": src.name, "source_sha256": entry["sha256"],
                     "samples": int(meta["samples"]), "tokens": int(meta["tokens"]), "resumed": True}
        else:
            if model is None:
                log.info("loading model %s (device %s, compute dtype %s)", weights, device, compute_dtype)
                model = load_model(weights, compute_dtype, device)
            stats = extract_shard(
                model, src, dst, layers=layers, final_norm=final_norm, dtype=dtype, batch_tokens=batch_tokens,
                source_sha256=entry["sha256"], tokenizer_fingerprint=tok_fp, model_path=str(weights),
                model_fp=fp, compute_dtype=compute_dtype,
            )
            new_tokens += stats["tokens"]
        stats["bytes"] = dst.stat().st_size
        shards_out.append(stats)

    keep = {s["file"] for s in shards_out} | {"manifest.json"}
    for p in target.iterdir():
        if p.name not in keep and p.is_file():
            log.info("removing stale %s", p)
            p.unlink()

    elapsed = time.perf_counter() - t0
    manifest = {
        "format": FORMAT,
        "dataset": tmanifest.get("dataset"),
        "shards": shards_out,
        "tokens": sum(s["tokens"] for s in shards_out),
        "samples": sum(s["samples"] for s in shards_out),
        "layers": layers,
        "layer_semantics": layer_semantics(layers, final_norm),
        "final_norm": final_norm,
        "dtype": dtype,
        "compute_dtype": compute_dtype,
        "hidden_size": hidden,
        "num_layers": num_layers,
        "model_path": str(weights),
        "model_fingerprint": fp,
        "tokenizer_fingerprint": tok_fp,
        "tensors": {
            "input_ids": "[N] int64",
            "loss_mask": "[N] int8, 1 on completion tokens",
            "aux_hidden_states": f"[N, {len(layers)}, {hidden}] {dtype}",
            "hidden_state": f"[N, {hidden}] {dtype}",
            "sample_offsets": "[S+1] int64",
        },
    }
    _atomic_write_text(target / "manifest.json", json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    if work_dir is not None:
        publish_dir(target, out_dir)
    log.info("done: %d samples, %d tokens (%d newly extracted) in %.1f s",
             manifest["samples"], manifest["tokens"], new_tokens, elapsed)
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

_HELD_LOCKS: list[Any] = []


def _gpu_candidates() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def claim_gpus(n: int, lock_dir: str | Path = DEFAULT_GPU_LOCK_DIR, timeout_s: float = 24 * 3600,
               poll_s: float = 5.0, candidates: Iterable[str] | None = None) -> list[str]:
    """Claim ``n`` GPUs for this process and set ``CUDA_VISIBLE_DEVICES`` to them.

    Snakemake's ``resources: gpu=N`` only limits how many jobs run at once; it assigns no device.
    Each GPU is claimed by a non-blocking ``flock`` on ``lock_dir/gpu-<id>.lock``, held until this
    process exits. Must run before torch initialises CUDA (this module imports torch lazily for
    that reason). Candidates: ``CUDA_VISIBLE_DEVICES`` if set, else ``nvidia-smi``'s indices
    (``CUDA_DEVICE_ORDER=PCI_BUS_ID`` is set so they match CUDA ordinals). Returns the claimed ids;
    ``[]`` when ``n <= 0`` or no GPU is visible. Waits up to ``timeout_s`` for busy GPUs."""
    cands = list(candidates) if candidates is not None else _gpu_candidates()
    if n <= 0 or not cands:
        return []
    if n > len(cands):
        raise ExtractionError(f"{n} GPUs requested per job, only {len(cands)} visible: {cands}")
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    while True:
        held: list[tuple[str, Any]] = []
        for g in cands:
            fh = open(lock_dir / f"gpu-{g}.lock", "a+")
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                fh.close()
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                continue
            held.append((g, fh))
            if len(held) == n:
                break
        if len(held) == n:
            _HELD_LOCKS.extend(fh for _, fh in held)
            ids = [g for g, _ in held]
            os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
            log.info("claimed GPUs %s (locks in %s)", ids, lock_dir)
            return ids
        for _, fh in held:
            fh.close()
        if time.monotonic() > deadline:
            raise ExtractionError(f"could not claim {n} free GPUs of {cands} within {timeout_s} s (locks in {lock_dir})")
        time.sleep(poll_s)

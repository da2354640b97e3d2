"""Hidden-state extraction: token shards -> EAGLE-3 training tensors (token-major safetensors).

Layer convention (the classic off-by-one, pinned by tests against forward hooks):

* ``layers`` are 0-based decoder-layer indices meaning "the OUTPUT of decoder layer i" (the
  residual stream after layer i). That is Hugging Face ``output_hidden_states[i + 1]`` (entry 0 is
  the embeddings) and what SGLang/vLLM name aux layer ``i + 1`` (the input of layer i + 1; SGLang's
  ``set_eagle3_layers_to_capture(layers)`` stores ``layers_to_capture = [i + 1 for i in layers]``).
  Default ``[1, L//2 - 1, L - 4]``: ``[1, 29, 57]`` for L = 61 (HF/SGLang/vLLM ``[2, 30, 58]``).
  Exception: asking for ``i = L - 1`` gives that layer's raw output, whereas HF's last entry
  ``hidden_states[L]`` is the final-norm output.
* ``hidden_state`` is the raw output of the last decoder layer, BEFORE the final norm (vLLM
  speculators' convention: vLLM aux id ``L``; HF's ``hidden_states`` never contains it, so it is
  taken with a hook). The norm's weight (``final_norm_weight``, float32) and epsilon
  (``final_norm_eps``) are stored with it, so one extraction serves both trainers: the SpecForge
  export derives the after-norm state (its trainer applies only ``lm_head``) with
  :func:`eagledata.extract.norm.apply_final_norm`.

Backends (:class:`~eagledata.extract.base.ExtractionBackend`): :class:`~eagledata.extract.hf.HFBackend`
(any HF causal LM, device_map across the job's GPUs, no LM head / logits), and
:class:`~eagledata.extract.sglang.SGLangBackend` (SGLang's model
runner in-process, tensor parallel). Both return, per sample, ``aux`` [T, n_layers, H] and
``final`` [T, H] with the semantics above; everything after that (layout, files) is shared.

Output (one safetensors file per token shard, token-major; S samples, N tokens in total):

* ``input_ids`` [N] int64, ``loss_mask`` [N] int8 (1 on completion positions, index >=
  ``prompt_len``), ``aux_hidden_states`` [N, n_layers, H] and ``hidden_state`` [N, H] in the target
  dtype, ``sample_offsets`` [S + 1] int64 (sample k is rows ``offsets[k]:offsets[k+1]``),
  ``final_norm_weight`` [H] float32;
* string metadata: ``sample_ids`` (JSON list), ``layers`` (JSON list), ``layer_semantics``,
  ``final_norm`` (``before``), ``final_norm_kind`` (``rmsnorm``), ``final_norm_eps``, ``vocab_size``,
  ``dtype``, ``compute_dtype``, ``backend``, ``model_path``, ``model_fingerprint``,
  ``tokenizer_fingerprint``, ``source_file``, ``source_sha256``, ``samples``, ``tokens``,
  ``hidden_size``, ``num_layers``, ``format``.

Beside the shards: ``index.parquet`` (one row per sample: ``id``, ``shard``, ``row``, ``offset``,
``length``, ``prompt_len``, ``sample``) and ``manifest.json`` (settings, per-shard counts, bytes and
sha256 of every output shard, and its ``checks``: per-layer ``rms`` and the ``rerun`` of one sample
alone against its batched result, :mod:`eagledata.extract.checks`; a NaN/Inf or a re-run beyond the
dtype tolerance fails the job naming the shard and the sample).

Files are streamed to disk (the header is computed up front from the token counts, so a shard's
tensors are never all held in memory: K2.5 produces ~57 KB per token), written by a background
thread while the next batch runs, checked against free disk space before a shard starts, and
published atomically (``shard.tmp-PID`` then ``os.replace``); the files are :mod:`eagledata.extract.storage`'s.
This module runs the job: batches, one shard, the dataset with resume.

torch and transformers are imported inside functions so that :func:`eagledata.extract.gpus.claim_gpus` can
set ``CUDA_VISIBLE_DEVICES`` before torch is ever imported.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from eagledata.extract.base import (
    BACKENDS,
    STORED_DTYPES,
    ExtractionBackend,
    ExtractionError,
    refuse_final_norm_setting,
    text_config,
    torch_dtype,
)
from eagledata.extract.fp8 import FORWARD_DTYPE, FP8_FORMAT, SCALES, is_fp8, stored
from eagledata.extract.checks import ShardChecks, compare_rerun, pick_rerun_sample, rerun_rtol
from eagledata.extract.hf import HFBackend, as_backend, load_model
from eagledata.extract.layers import layer_semantics, resolve_layers
from eagledata.extract.limits import (
    TRAINER_MAX_LEN,
    apply_length_limit,
    check_limit,
    length_limit,
    limit_summary,
    over_trainer_max,
)
from eagledata.extract.norm import FINAL_STORED, NORM_FORMULA, NORM_KIND
from eagledata.extract.weights import auto_dtype, model_fingerprint
from eagledata.extract.storage import (
    FORMAT,
    RESUME_KEYS,
    ResumeKeys,
    BackgroundWriter,
    SafetensorsStreamWriter,
    TokenShard,
    check_disk_space,
    estimate_shard_bytes,
    loss_mask_for,
    output_name,
    publish_dir,
    read_shard_metadata,
    read_token_shard,
    read_tokens_manifest,
    train_lengths,
    shard_sha256,
    shard_specs,
    write_index,
    write_manifest,
    resumable,
)
from eagledata.io import sha256_file, sha256_text

log = logging.getLogger("eagledata.extract.core")


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


# --------------------------------------------------------------------------- one shard


def limit_key(max_seq_len: int | None, on_long: str, lengths: Sequence[int] | None = None) -> str:
    """The ``length_limit`` metadata value of a shard (a resume key: a changed limit re-extracts), of
    the limit as it decides anything (:func:`~eagledata.extract.limits.length_limit`) on a shard of
    samples of ``lengths`` (its train rows, before the limit): one that no sample exceeds acts as no
    limit, so adding, raising or removing such a limit keeps the shard."""
    if max_seq_len is not None and lengths is not None and all(n <= max_seq_len for n in lengths):
        max_seq_len = None
    return json.dumps(length_limit(max_seq_len, on_long), sort_keys=True)


def shard_metadata(shard: TokenShard, src: Path, backend: ExtractionBackend, *, dtype: str,
                   compute_dtype: str, model_path: str, model_fp: str, tokenizer_fingerprint: str,
                   source_sha256: str, length_limit: str = limit_key(None, "truncate"),
                   code_fingerprint: str = "", backend_args: str = "") -> dict[str, str]:
    """The string metadata written into an output shard's header (see the module docstring);
    ``code_fingerprint`` identifies the extraction code that wrote it, ``backend_args`` the backend's
    output-shaping arguments (both resume keys; the latter written only when not empty)."""
    layers = backend.layers
    return {
        "format": FORMAT,
        "sample_ids": json.dumps(shard.ids, ensure_ascii=False),
        "layers": json.dumps(layers),
        "layer_semantics": layer_semantics(layers),
        "final_norm": FINAL_STORED,
        "final_norm_kind": NORM_KIND,
        "final_norm_eps": repr(float(backend.final_norm.eps)),
        "vocab_size": str(backend.vocab_size),
        "dtype": dtype,
        "compute_dtype": compute_dtype,
        "backend": backend.name,
        "model_path": str(model_path),
        "model_fingerprint": model_fp,
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "source_file": src.name,
        "source_sha256": source_sha256,
        "samples": str(len(shard.ids)),
        "tokens": str(int(shard.offsets[-1])),
        "hidden_size": str(backend.hidden_size),
        "num_layers": str(backend.num_layers),
        "length_limit": length_limit,
        "code_fingerprint": code_fingerprint,
        **({"backend_args": backend_args} if backend_args else {}),
        **({"fp8_format": FP8_FORMAT, "fp8_scales": json.dumps(SCALES)} if is_fp8(dtype) else {}),
    }


def _check_vocab(shard: TokenShard, src: Path, vocab: int) -> None:
    if shard.input_ids.size and (shard.input_ids.min() < 0 or shard.input_ids.max() >= vocab):
        raise ExtractionError(
            f"{src}: token ids outside [0, {vocab}) of the model's embedding "
            f"(min {shard.input_ids.min()}, max {shard.input_ids.max()}): wrong model for this tokenizer?"
        )


def _fill_shard(writer: SafetensorsStreamWriter, shard: TokenShard, backend: ExtractionBackend,
                dtype: str, batch_tokens: int, shard_name: str) -> tuple[float, dict[str, Any]]:
    """Write every tensor of ``shard`` through ``writer`` (forwards batch by batch, rows written on a
    background thread), checking each sample (:mod:`eagledata.extract.checks`); returns the seconds
    spent in forwards and the checks' record (``rms`` per layer, ``rerun``). FP8 (``dtype``): the
    forward hands over float32, quantized per token (:func:`eagledata.extract.fp8.stored`); the
    checks see the dequantized values."""
    import torch

    out_dtype = torch_dtype(FORWARD_DTYPE if is_fp8(dtype) else dtype)

    writer.write_rows("input_ids", 0, torch.from_numpy(shard.input_ids))
    writer.write_rows("loss_mask", 0, torch.from_numpy(loss_mask_for(shard.prompt_lens, shard.offsets)))
    writer.write_rows("sample_offsets", 0, torch.from_numpy(shard.offsets))
    writer.write_rows("final_norm_weight", 0, backend.final_norm.weight.to(torch.float32))
    checks = ShardChecks(shard_name, backend.layers)
    batches = plan_batches(shard.lengths, batch_tokens)
    rerun_k = pick_rerun_sample(batches)
    kept: tuple[Any, Any] | None = None
    bg = BackgroundWriter(writer)
    fwd_s = 0.0
    all_ids = torch.from_numpy(shard.input_ids)
    seq = lambda k: all_ids[int(shard.offsets[k]) : int(shard.offsets[k + 1])]  # noqa: E731
    try:
        for batch in batches:
            tf = time.perf_counter()
            results = backend.forward([seq(k) for k in batch], out_dtype)
            fwd_s += time.perf_counter() - tf
            items = []
            for k, (aux, final) in zip(batch, results):
                rows, values = stored(int(shard.offsets[k]), aux, final, dtype)
                checks.add(shard.ids[k], *values)
                kept = values if k == rerun_k else kept
                items += rows
            bg.put(items)
        record: dict[str, Any] = {"rms": checks.rms(), "rerun": None}
        if rerun_k is not None and kept is not None:
            alone = stored(0, *backend.forward([seq(rerun_k)], out_dtype)[0], dtype)[1]
            rtol = rerun_rtol(dtype, computed_dtype(backend))
            record["rerun"] = compare_rerun(shard_name, shard.ids[rerun_k], kept, alone, rtol)
    except BaseException:
        with contextlib.suppress(BaseException):
            bg.finish()
        raise
    bg.finish()
    return fwd_s, record


def computed_dtype(backend: ExtractionBackend) -> str | None:
    """The dtype the backend's model computes in, when known (``model_dtype``, else a set compute dtype)."""
    known = getattr(backend, "model_dtype", None)
    if known:
        return str(known).removeprefix("torch.")
    return None if backend.compute_dtype == "auto" else backend.compute_dtype


def extract_shard(
    model: Any,
    src: str | Path,
    dst: str | Path,
    *,
    layers: Sequence[int] | None = None,
    dtype: str = "bfloat16",
    batch_tokens: int = 8192,
    source_sha256: str | None = None,
    tokenizer_fingerprint: str = "",
    model_path: str = "",
    model_fp: str = "",
    compute_dtype: str = "auto",
    reserve_disk_bytes: int = 0,
    max_seq_len: int | None = None,
    on_long: str = "truncate",
    code_fingerprint: str = "",
    backend_args: str = "",
    before_publish: Callable[[Path, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Extract one token shard ``src`` into the safetensors file ``dst`` (format in the module
    docstring), written to ``dst.tmp-PID`` and published with ``os.replace``. ``before_publish(tmp,
    stats)`` runs on the finished file before that (its record written then: a rename keeps a
    file's size and mtime, so a job killed after the rename finds its shard whole and recorded);
    an exception from it removes the file.

    ``model``: an :class:`ExtractionBackend`, or a loaded HF model (wrapped in :class:`HFBackend`).
    Samples are the shard's ``train`` rows in shard order; batching (:func:`plan_batches`) does not
    change values beyond float rounding of different batch shapes. Before anything is written the
    free disk space is checked against the shard's exact size (+ ``reserve_disk_bytes``). Returns
    per-shard stats (samples, tokens, seconds, forward_seconds, tokens_per_s, checks, length_limit).
    ``max_seq_len`` / ``on_long``: the dataset's length limit (:mod:`eagledata.extract.limits`),
    applied before any forward; the flagged samples are in ``length_limit``."""
    src, dst = Path(src), Path(dst)
    backend = as_backend(model, layers, compute_dtype)
    check_stored_dtype(dtype)
    source_sha256 = source_sha256 or sha256_file(src)
    t0 = time.perf_counter()
    source = read_token_shard(src)
    shard, flags = apply_length_limit(source, max_seq_len, on_long)
    _check_vocab(shard, src, backend.vocab_size)
    n, s, h, nl = int(shard.offsets[-1]), len(shard.ids), backend.hidden_size, len(backend.layers)
    meta = shard_metadata(shard, src, backend, dtype=dtype, compute_dtype=compute_dtype,
                          model_path=model_path, model_fp=model_fp, tokenizer_fingerprint=tokenizer_fingerprint,
                          source_sha256=source_sha256, length_limit=limit_key(max_seq_len, on_long, source.lengths),
                          code_fingerprint=code_fingerprint, backend_args=backend_args)
    dst.parent.mkdir(parents=True, exist_ok=True)
    # header is < 100 bytes per sample (ids) + a few KB: count it generously
    need = estimate_shard_bytes(n, s, nl, h, dtype, header_bytes=len(meta["sample_ids"]) + 16384)
    check_disk_space(dst, need, reserve_disk_bytes)
    tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid()}")
    writer = SafetensorsStreamWriter(tmp, shard_specs(n, s, nl, h, dtype), meta)
    try:
        fwd_s, checked = _fill_shard(writer, shard, backend, dtype, batch_tokens, src.name)
        writer.close()
        secs = time.perf_counter() - t0
        stats = _shard_stats(dst, src, source_sha256, s, n, secs, fwd_s, checked, flags, shard.lengths)
        if before_publish is not None:
            before_publish(tmp, stats)
        os.replace(tmp, dst)
    except BaseException:
        writer.abort()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    log.info("%s -> %s: %d samples, %d tokens, %.2f s (forward %.2f s), %.0f tokens/s; checks: no NaN/Inf, "
             "RMS %s, re-run alone %s", src.name, dst, s, n, secs, fwd_s, n / secs if secs > 0 else float("nan"),
             checked["rms"], checked["rerun"])
    return stats


def _shard_stats(dst: Path, src: Path, source_sha256: str | None, s: int, n: int, secs: float, fwd_s: float,
                 checked: dict[str, Any], flags: Any, lengths: Any) -> dict[str, Any]:
    """A written shard's stats (:func:`extract_shard`'s return value)."""
    return {
        "file": dst.name,
        "source": src.name,
        "source_sha256": source_sha256,
        "samples": s,
        "tokens": n,
        "seconds": round(secs, 3),
        "forward_seconds": round(fwd_s, 3),
        "tokens_per_s": round(n / secs, 1) if secs > 0 else None,
        "checks": checked,
        "length_limit": {"flagged": flags, "over_trainer_max": over_trainer_max(lengths)},
    }


# --------------------------------------------------------------------------- dataset


def make_backend(kind: str, weights: str | Path, layers: Sequence[int] | None,
                 compute_dtype: str = "auto", device: str = "auto", **options: Any) -> ExtractionBackend:
    """Load the model behind backend ``kind`` (``"hf"`` or ``"sglang"``). ``options`` go to the
    SGLang backend (``tp_size``, ``mem_fraction_static``, ``server_args``)."""
    if kind == "hf":
        return HFBackend(load_model(weights, compute_dtype, device), layers, compute_dtype)
    if kind == "sglang":
        from eagledata.extract.sglang import SGLangBackend

        return SGLangBackend.launch(weights, layers, compute_dtype=compute_dtype, **options)
    raise ExtractionError(f"extraction backend must be one of {BACKENDS}, got {kind!r}")



# --------------------------------------------------------------------------- the dataset


def check_stored_dtype(dtype: str) -> None:
    """Raise :class:`ExtractionError` unless ``dtype`` is one shards can be stored in (:data:`STORED_DTYPES`)."""
    if dtype not in STORED_DTYPES:
        raise ExtractionError(f"extraction.dtype must be one of {STORED_DTYPES}, got {dtype!r}")


def check_settings(backend: str, dtype: str, compute_dtype: str, batch_tokens: int) -> None:
    """Raise :class:`ExtractionError` for a setting no extraction can run with (before any work)."""
    if backend not in BACKENDS:
        raise ExtractionError(f"extraction backend must be one of {BACKENDS}, got {backend!r}")
    check_stored_dtype(dtype)
    if compute_dtype != "auto":
        torch_dtype(compute_dtype)
    if batch_tokens < 1:
        raise ExtractionError(f"batch_tokens must be >= 1, got {batch_tokens}")


@dataclass
class DatasetRun:
    """The resolved settings of one dataset's extraction, shared by every shard."""

    tokens_dir: Path
    target: Path  # where files are written (the work dir, or the output dir)
    weights: str | Path
    tokens_manifest: dict[str, Any]
    layers: list[int]
    dtype: str
    compute_dtype: str
    backend: str
    num_layers: int
    hidden: int
    model_fp: str
    tokenizer_fp: str
    max_seq_len: int | None = None
    on_long: str = "truncate"
    code_fp: str = ""
    backend_args: str = ""  # the backend's output-shaping arguments (canonical JSON; "" for none)
    # the dtype the checkpoint declares, when the backend computes in it with compute_dtype "auto"
    # (Hugging Face's); None when not known that way
    auto_dtype: str | None = None

    def same_compute(self) -> str | frozenset[str]:
        """The ``compute_dtype`` values of a stored shard computed as this run computes: this run's,
        and with :attr:`auto_dtype` both ``auto`` and that dtype when this run's is either (written
        either way, the same forward: a setting spelled out must not re-extract)."""
        if self.auto_dtype and self.compute_dtype in ("auto", self.auto_dtype):
            return frozenset({"auto", self.auto_dtype})
        return self.compute_dtype

    def resume_keys(self, source_sha256: str, source: str | Path | None = None) -> ResumeKeys:
        """The metadata an existing output shard of token shard ``source`` (its lengths decide whether
        the length limit acts on it: read only when there is one) must carry to be kept (:data:`RESUME_KEYS`;
        a set: any of its values)."""
        lengths = train_lengths(source) if self.max_seq_len is not None and source is not None else None
        values = {"format": FORMAT, "layers": json.dumps(self.layers),
                  "dtype": self.dtype, "compute_dtype": self.same_compute(), "model_fingerprint": self.model_fp,
                  "source_sha256": source_sha256, "length_limit": limit_key(self.max_seq_len, self.on_long, lengths),
                  "code_fingerprint": self.code_fp, "backend": self.backend, "backend_args": self.backend_args}
        return {k: values[k] for k in RESUME_KEYS}

    def manifest(self, shards_out: list[dict[str, Any]], complete: bool, norm_eps: float | None = None,
                 vocab_size: int | None = None) -> dict[str, Any]:
        """The output ``manifest.json`` (``complete: false`` while shards are still being written)."""
        layers, hidden, dtype = self.layers, self.hidden, self.dtype
        return {
            "format": FORMAT,
            "complete": complete,
            "dataset": self.tokens_manifest.get("dataset"),
            "shards": shards_out,
            "tokens": sum(s["tokens"] for s in shards_out),
            "samples": sum(s["samples"] for s in shards_out),
            "layers": layers,
            "layer_semantics": layer_semantics(layers),
            "length_limit": limit_summary(shards_out, self.max_seq_len, self.on_long),
            "final_norm": {"stored": FINAL_STORED, "kind": NORM_KIND, "eps": norm_eps, "weight": "final_norm_weight",
                           "formula": NORM_FORMULA},
            "vocab_size": vocab_size,
            "dtype": dtype,
            "compute_dtype": self.compute_dtype,
            "backend": self.backend,
            "hidden_size": hidden,
            "num_layers": self.num_layers,
            "model_path": str(self.weights),
            "model_fingerprint": self.model_fp,
            "tokenizer_fingerprint": self.tokenizer_fp,
            "index": "index.parquet",
            "tensors": {
                "input_ids": "[N] int64",
                "loss_mask": "[N] int8, 1 on completion tokens",
                "aux_hidden_states": f"[N, {len(layers)}, {hidden}] {dtype}",
                "hidden_state": f"[N, {hidden}] {dtype}, before the final norm",
                "sample_offsets": "[S+1] int64",
                "final_norm_weight": f"[{hidden}] float32",
                **({"aux_hidden_states_scale": f"[N, {len(layers)}] float32, per token and layer (value = fp8 * scale)",
                    "hidden_state_scale": "[N] float32, per token"} if is_fp8(dtype) else {}),
            },
        }


def resolve_run(tokens_dir: str | Path, target: str | Path, weights: str | Path, tokens_manifest: dict[str, Any],
                layers: Sequence[int] | None, dtype: str, compute_dtype: str, backend: str, batch_tokens: int, *,
                final_norm: Any = None, max_seq_len: int | None = None, on_long: str = "truncate",
                code_fingerprint: str = "", backend_args: str = "") -> DatasetRun:
    """The settings checked (:func:`check_settings`, the length limit, the removed ``final_norm``) and
    resolved against the model's config (layers, sizes, fingerprint): one :class:`DatasetRun`."""
    refuse_final_norm_setting(final_norm)
    check_settings(backend, dtype, compute_dtype, batch_tokens)
    check_limit(max_seq_len, on_long)
    cfg = text_config(weights)
    num_layers = int(cfg.num_hidden_layers)
    return DatasetRun(Path(tokens_dir), Path(target), weights, tokens_manifest, resolve_layers(layers, num_layers),
                      dtype, compute_dtype, backend, num_layers, int(cfg.hidden_size), model_fingerprint(weights),
                      str(tokens_manifest.get("tokenizer_fingerprint", "")), max_seq_len, on_long, code_fingerprint,
                      backend_args, auto_dtype=auto_dtype(weights) if backend == "hf" else None)


def code_fingerprint(files: Iterable[str | Path]) -> str:
    """Identity of the extraction code: sha256 over the sorted (file name, content sha256) of ``files``
    (the rule's code inputs), so an edit re-extracts while a moved work directory does not."""
    return sha256_text("\n".join(sorted(f"{Path(f).name}:{sha256_file(f)}" for f in files)))


class LazyBackend:
    """The backend of a dataset run, loaded on first use (never when every shard is done already);
    ``model`` given by the caller is wrapped, never closed."""

    def __init__(self, run: DatasetRun, model: Any, device: str, options: dict[str, Any] | None):
        self.run, self.model, self.device, self.options = run, model, device, options or {}
        self.backend: ExtractionBackend | None = None
        self.owned = False
        self.load_s = 0.0  # seconds this object spent loading the model

    def get(self) -> ExtractionBackend:
        """The backend, loading it the first time."""
        if self.backend is None:
            r = self.run
            if self.model is not None:
                self.backend = as_backend(self.model, r.layers, r.compute_dtype)
            else:
                log.info("loading model %s (backend %s, device %s, compute dtype %s)",
                         r.weights, r.backend, self.device, r.compute_dtype)
                t0 = time.perf_counter()
                self.backend = make_backend(r.backend, r.weights, r.layers, r.compute_dtype, self.device,
                                            **self.options)
                self.load_s = time.perf_counter() - t0
                log.info("model loaded in %.1f s", self.load_s)
                self.owned = True
        return self.backend

    def close(self) -> None:
        """Release a backend this object loaded."""
        if self.owned and self.backend is not None:
            self.backend.close()


def _clear_leftovers(target: Path) -> dict[str, dict[str, Any]]:
    """Remove ``*.tmp-PID`` files of an interrupted run; return the previous manifest's shard
    entries by file name (empty when there is none)."""
    for stale in target.glob("*.tmp-*"):
        log.info("removing leftover %s of an interrupted run", stale)
        stale.unlink()
    previous: dict[str, dict[str, Any]] = {}
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
        previous = {e["file"]: e for e in json.loads((target / "manifest.json").read_text())["shards"]}
    return previous


def _one_shard(run: DatasetRun, entry: dict[str, Any], runner: LazyBackend, batch_tokens: int,
               reserve_disk_bytes: int, previous: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Keep the output of token shard ``entry`` when it matches (resume; its checks come from the
    previous manifest), else extract it; stats."""
    src = run.tokens_dir / entry["file"]
    dst = run.target / output_name(entry["file"])
    meta = read_shard_metadata(dst) if dst.exists() else None
    if meta is not None and resumable(meta, run.resume_keys(entry["sha256"], src)):
        log.info("%s: done already (source sha256 and settings match), skipped", dst.name)
        shard, flags = apply_length_limit(read_token_shard(src), run.max_seq_len, run.on_long)
        return {"file": dst.name, "source": src.name, "source_sha256": entry["sha256"],
                "samples": int(meta["samples"]), "tokens": int(meta["tokens"]), "resumed": True,
                "checks": (previous.get(dst.name) or {}).get("checks"),
                "length_limit": {"flagged": flags, "over_trainer_max": over_trainer_max(shard.lengths)}}
    return extract_shard(
        runner.get(), src, dst, layers=run.layers, dtype=run.dtype,
        batch_tokens=batch_tokens, source_sha256=entry["sha256"], tokenizer_fingerprint=run.tokenizer_fp,
        model_path=str(run.weights), model_fp=run.model_fp, compute_dtype=run.compute_dtype,
        reserve_disk_bytes=reserve_disk_bytes, max_seq_len=run.max_seq_len, on_long=run.on_long,
        code_fingerprint=run.code_fp, backend_args=run.backend_args,
    )


def warn_long_samples(manifest: dict[str, Any]) -> None:
    """Log the length limit's counts, and a warning per trainer whose default maximum length
    (:data:`TRAINER_MAX_LEN`) some stored samples exceed."""
    lim = manifest["length_limit"]
    if lim["max_seq_len"] is not None:
        log.info("length limit %s (%s): %d sample(s) truncated, %d skipped", lim["max_seq_len"], lim["on_long"],
                 lim["truncated"], lim["skipped"])
    option = {"specforge": "SpecForge data.max_length", "speculators": "speculators --total-seq-len"}
    for name, n in lim["over_trainer_max"].items():
        if n:
            log.warning("%d of %d stored sample(s) are longer than %s's default %d: the trainer cuts them at load "
                        "time unless it is raised (or set this dataset's extraction.max_seq_len)",
                        n, manifest["samples"], option[name], TRAINER_MAX_LEN[name])


def with_file_facts(stats: dict[str, Any], dst: Path, previous: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``stats`` with the written shard's ``bytes``, ``mtime_ns`` and ``sha256``."""
    st = dst.stat()
    return {**stats, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": shard_sha256(dst, previous)}


def norm_facts(shard: Path, seen: dict[str, Any]) -> dict[str, Any]:
    """``{"norm_eps", "vocab_size"}`` from a written shard's metadata; raise when they differ from
    those of the shards before it (one model per dataset)."""
    meta = read_shard_metadata(shard) or {}
    facts = {"norm_eps": float(meta["final_norm_eps"]), "vocab_size": int(meta["vocab_size"])}
    if seen and seen != facts:
        raise ExtractionError(f"{shard.name}: final norm eps / vocab size {facts} differ from earlier shards' {seen}")
    return facts


def _remove_stale(target: Path, shards_out: list[dict[str, Any]]) -> None:
    keep = {s["file"] for s in shards_out} | {"manifest.json", "index.parquet"}
    for p in target.iterdir():
        if p.name not in keep and p.is_file():
            log.info("removing stale %s", p)
            p.unlink()


def extract_dataset(
    tokens_dir: str | Path,
    out_dir: str | Path,
    weights: str | Path,
    layers: Sequence[int] | None = None,
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
    final_norm: Any = None,
    max_seq_len: int | None = None,
    on_long: str = "truncate",
    code_fingerprint: str = "",
) -> dict[str, Any]:
    """Extract every shard of ``tokens_dir/manifest.json`` into ``out_dir``; write
    ``index.parquet`` and ``manifest.json`` there. Returns the manifest.

    * Every token shard's sha256 is verified before the model is loaded.
    * The model is loaded once (:func:`make_backend`; ``model`` may be passed in instead: a HF
      model or an :class:`ExtractionBackend`), and not at all when every output shard is done.
    * Resume: an existing output shard whose metadata matches on :data:`RESUME_KEYS` (source
      sha256, layers, dtype, compute dtype, model fingerprint) is kept untouched. After
      each shard ``manifest.json`` is rewritten (``"complete": false``) so a resumed run reuses the
      sha256 of finished shards; leftover ``*.tmp-PID`` files of a killed run are removed.
    * Files in the output directory that belong to no current shard are removed.
    * ``work_dir``: write there and finally rename it to ``out_dir`` (for Snakemake, which deletes a
      failed job's declared outputs: an undeclared ``work_dir`` survives for the next try).
    * ``compute_dtype``: dtype the model runs in; ``"auto"`` = the checkpoint's. Outputs are cast to
      ``dtype``.
    * ``final_norm``: the removed setting; anything but ``None`` is refused with a message (the
      final state is always stored before the norm, with the norm's weight and eps).
    * ``max_seq_len`` / ``on_long``: the dataset's length limit (:mod:`eagledata.extract.limits`).
    """
    tokens_dir, out_dir = Path(tokens_dir), Path(out_dir)
    target = Path(work_dir) if work_dir is not None else out_dir
    tmanifest = read_tokens_manifest(tokens_dir, verify=True)
    run = resolve_run(tokens_dir, target, weights, tmanifest, layers, dtype, compute_dtype, backend, batch_tokens,
                      final_norm=final_norm, max_seq_len=max_seq_len, on_long=on_long,
                      code_fingerprint=code_fingerprint)
    target.mkdir(parents=True, exist_ok=True)
    log.info("extracting %s -> %s: backend %s, layers %s (final state before the norm), dtype %s, model %s",
             tokens_dir, out_dir, backend, run.layers, dtype, weights)
    previous = _clear_leftovers(target)
    shards_out: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    runner = LazyBackend(run, model, device, backend_options)
    norm: dict[str, Any] = {}
    try:
        for entry in tmanifest.get("shards", []):
            stats = _one_shard(run, entry, runner, batch_tokens, reserve_disk_bytes, previous)
            dst = target / stats["file"]
            shards_out.append(with_file_facts(stats, dst, previous))
            norm = norm_facts(dst, norm)
            write_manifest(target / "manifest.json", run.manifest(shards_out, False, **norm))
    finally:
        runner.close()
    _remove_stale(target, shards_out)
    write_index(target / "index.parquet", shards_out, target)
    manifest = run.manifest(shards_out, True, **norm)
    write_manifest(target / "manifest.json", manifest)
    warn_long_samples(manifest)
    if work_dir is not None:
        publish_dir(target, out_dir)
    new_tokens = sum(s["tokens"] for s in shards_out if not s.get("resumed"))
    log.info("done: %d samples, %d tokens (%d newly extracted) in %.1f s",
             manifest["samples"], manifest["tokens"], new_tokens, time.perf_counter() - t0)
    return manifest


# --------------------------------------------------------------------------- GPU claiming


def claim_gpus(n: int, lock_dir: str | Path | None = None, timeout_s: float = 24 * 3600, poll_s: float = 2.0,
               candidates: Iterable[str] | None = None) -> list[str]:
    """:func:`eagledata.extract.gpus.claim_gpus`, raising :class:`ExtractionError` on failure."""
    from eagledata.extract import gpus

    try:
        return gpus.claim_gpus(n, lock_dir, timeout_s=timeout_s, poll_s=poll_s, candidates=candidates)
    except gpus.GpuClaimError as exc:
        raise ExtractionError(str(exc)) from None

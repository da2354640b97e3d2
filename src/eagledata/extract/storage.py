"""Extraction's files: token shards in, safetensors shards out, and what lets a run resume.

* reading: :func:`read_tokens_manifest` (every token shard's sha256 verified), :func:`read_token_shard`
  (the ``train`` rows, checked);
* writing: :class:`SafetensorsStreamWriter` (header up front, rows streamed in any order),
  :class:`BackgroundWriter` (writes on a thread while the next batch runs), :func:`check_disk_space`
  against a shard's exact size (:func:`estimate_shard_bytes`);
* resuming: :func:`read_shard_metadata` (a shard's header, ``None`` when torn) compared on
  :data:`RESUME_KEYS` (the model's identity: :mod:`eagledata.extract.weights`), :func:`shard_sha256`
  (reused while size and mtime are unchanged);
* the dataset's files: ``index.parquet`` (:func:`write_index`, :func:`read_index`), ``manifest.json``
  (:func:`write_manifest`) and :func:`publish_dir` (a work directory renamed onto the output).

torch, numpy, polars and safetensors are imported inside functions.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import shutil
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence, TypeVar

from eagledata.extract.base import ExtractionError
from eagledata.io import atomic_path, atomic_write_json, sha256_file

T = TypeVar("T")

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: /2: the final state is stored before the final norm, with the norm's weight and eps (/1 stored either).
FORMAT = "eagledata-hidden/2"
#: safetensors dtype codes and item sizes of the dtypes a shard holds.
ST_CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64", "int8": "I8",
            "float8_e4m3fn": "F8_E4M3"}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int8": 1, "float8_e4m3fn": 1}
TOKEN_COLUMNS = ["id", "input_ids", "prompt_len", "completion_len", "train"]



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
            row = math.prod(shape[1:]) * ITEMSIZE[dtype]
            nbytes = shape[0] * row
            header[name] = {"dtype": ST_CODES[dtype], "shape": list(shape), "data_offsets": [off, off + nbytes]}
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


# --------------------------------------------------------------------------- token shards


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


def train_lengths(path: str | Path) -> list[int]:
    """The lengths (prompt + completion tokens) of a tokens parquet shard's train rows, in order, as
    :func:`read_token_shard` gives them (it checks that they are the rows' ``input_ids`` lengths)."""
    import polars as pl

    df = pl.read_parquet(path, columns=["train", "prompt_len", "completion_len"]).filter(pl.col("train"))
    return (df["prompt_len"] + df["completion_len"]).to_list()


def read_token_shard(path: str | Path) -> TokenShard:
    """Read a tokens parquet shard, keep rows with ``train == True``, and check each row:
    ``prompt_len + completion_len == len(input_ids) > 0``, ``0 <= prompt_len``, ``completion_len >= 0``."""
    import numpy as np
    import polars as pl

    df = pl.read_parquet(path)
    missing = [c for c in TOKEN_COLUMNS if c not in df.columns]
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


#: Metadata keys that must match for an existing output shard to be reused: the backend and its
#: output-shaping arguments (SGLang's server arguments: quantization, KV-cache dtype...) among them.
RESUME_KEYS = ("format", "source_sha256", "layers", "dtype", "compute_dtype", "model_fingerprint", "length_limit",
               "code_fingerprint", "backend", "backend_args")


#: Resume keys as a stored shard must carry them (:meth:`eagledata.extract.core.DatasetRun.resume_keys`):
#: a key's value, or the set of values that mean the same.
ResumeKeys = Mapping[str, "str | frozenset[str]"]


def resumable(meta: dict[str, str], keys: ResumeKeys) -> bool:
    """Whether a stored shard's header ``meta`` carries the resume ``keys``' values (a key's set of
    values: one of them); a key the header lacks reads as empty (``backend_args`` is written only
    when there are any)."""
    return all(meta.get(k, "") in v if isinstance(v, frozenset) else meta.get(k, "") == v for k, v in keys.items())


def shard_specs(n_tokens: int, n_samples: int, n_layers: int, hidden: int, dtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """Tensor layout of one output shard (names, dtypes, shapes); ``hidden_state`` is the final
    state before the final norm, ``final_norm_weight`` that norm's weight (float32). FP8 shards add
    the float32 per-token scales ``aux_hidden_states_scale`` [N, n_layers] and ``hidden_state_scale`` [N]."""
    scales = [("aux_hidden_states_scale", "float32", (n_tokens, n_layers)),
              ("hidden_state_scale", "float32", (n_tokens,))] if dtype == "float8_e4m3fn" else []
    return scales + [
        ("input_ids", "int64", (n_tokens,)),
        ("loss_mask", "int8", (n_tokens,)),
        ("sample_offsets", "int64", (n_samples + 1,)),
        ("aux_hidden_states", dtype, (n_tokens, n_layers, hidden)),
        ("hidden_state", dtype, (n_tokens, hidden)),
        ("final_norm_weight", "float32", (hidden,)),
    ]


def estimate_shard_bytes(n_tokens: int, n_samples: int, n_layers: int, hidden: int, dtype: str,
                         header_bytes: int = 0) -> int:
    """Exact data bytes of a shard (tokens x (n_layers + 1) x H x dtype size, plus ids, mask,
    offsets and the norm weight) plus ``header_bytes``."""
    return header_bytes + sum(math.prod(shape) * ITEMSIZE[dt] for _, dt, shape in shard_specs(
        n_tokens, n_samples, n_layers, hidden, dtype))


#: The directory of a store (``hidden.store/replaced/``) where its shards no current shard uses are kept
#: (``extraction.keep_replaced_gb``: :func:`eagledata.extract.gather.prune_store`).
REPLACED = "replaced"


def kept_replaced(entries: Iterable[tuple[int, int, T]], limit: int) -> list[T]:
    """Of replaced entries ``(when replaced, ns; bytes; item)``, the items kept: the most recently
    replaced first, while they fit in ``limit`` bytes (the hidden store's and the export stores')."""
    kept, total = [], 0
    for _, size, item in sorted(entries, key=lambda e: e[0], reverse=True):
        if total + size > limit:
            break
        kept.append(item)
        total += size
    return kept


def check_disk_space(path: str | Path, need_bytes: int, reserve_bytes: int = 0) -> None:
    """Raise :class:`ExtractionError` naming ``path`` and the numbers when the filesystem holding
    ``path`` has less than ``need_bytes + reserve_bytes`` free (and the replaced shards kept beside
    ``path``, which can go)."""
    path = Path(path)
    probe = path if path.exists() else path.parent
    free = shutil.disk_usage(probe).free
    if free < need_bytes + reserve_bytes:
        gib = 1 << 30
        replaced = path.parent / REPLACED
        held = sum(p.stat().st_size for p in replaced.glob("*") if p.is_file()) if replaced.is_dir() else 0
        raise ExtractionError(
            f"not enough disk space for {path}: the shard needs {need_bytes:,} bytes ({need_bytes / gib:.2f} GiB)"
            + (f" + {reserve_bytes:,} reserved (extraction.reserve_disk_gb)" if reserve_bytes else "")
            + f", but only {free:,} bytes ({free / gib:.2f} GiB) are free on the filesystem of {probe}"
            + (f"; {replaced} holds {held / gib:.2f} GiB of shards no current shard uses, kept for reverts "
               "(extraction.keep_replaced_gb): deleting it loses nothing current" if held else ""))


class BackgroundWriter:
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


# --------------------------------------------------------------------------- the dataset's files


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


def shard_sha256(path: Path, previous: dict[str, dict[str, Any]]) -> str:
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
    with atomic_path(out) as tmp:
        df.write_parquet(tmp)
    return len(df)


def read_index(hidden_dir: str | Path) -> Any:
    """``hidden_dir/index.parquet`` as a polars DataFrame (see :func:`write_index`)."""
    import polars as pl

    path = Path(hidden_dir) / "index.parquet"
    if not path.exists():
        raise ExtractionError(f"hidden-state index not found: {path}")
    return pl.read_parquet(path)


def publish_dir(src: str | Path, dst: str | Path) -> None:
    """Move directory ``src`` to ``dst`` (same filesystem, atomic rename); an existing ``dst`` is
    removed first."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.replace(src, dst)




def write_manifest(path: str | Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` atomically (fsync'ed, then renamed)."""
    atomic_write_json(path, manifest, indent=2)

"""The identity of a weights directory: what a stored hidden shard was extracted with (a resume key,
:data:`~eagledata.extract.storage.RESUME_KEYS`), and the files the workflow's extraction rules declare.

* :func:`model_files`: ``config.json``, the weights and every other ``*.json`` but
  :data:`NOT_MODEL_FILES` (the tokenizer's files and sampling defaults, often kept beside the weights).
* :func:`compute_setting`: the compute dtype as it decides the forward (a rule param).
* :func:`model_fingerprint`: the sha256 of those files' contents. A large model's files are read once
  per version of each file: their digests are remembered by (path, device, inode, size, mtime, ctime)
  in a cache directory, so a copy, a re-download or a ``touch`` costs one read of the weights (minutes) and keeps
  every stored shard (hours of GPU), while new weights of the same shapes and size are new content.
  Shard jobs started together wait on a lock while the first one reads.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import xxhash

from eagledata.io import atomic_write_json, sha256_file

#: Files of a weights directory that cannot change its hidden states: sampling defaults and the
#: tokenizer (which decides token ids, and so the token shards, extraction's input, already).
NOT_MODEL_FILES = frozenset({
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "chat_template.json", "vocab.json", "preprocessor_config.json",
})

#: Up to this many bytes of model files in all, every fingerprint reads them (no cache).
FULL_HASH_LIMIT = 256 << 20

_CHUNK = 16 << 20


def auto_dtype(weights: str | Path) -> str | None:
    """The dtype Hugging Face's ``dtype="auto"`` surely loads every weight of this checkpoint in, from
    its ``config.json``: the top-level ``dtype`` (``torch_dtype`` as older configs spell it), when the
    config has no ``quantization_config`` at any level (a quantizer may turn a given dtype into another
    but pass ``auto`` through, as AWQ does in transformers 4.x) and every sub-config declaring a dtype
    declares the same (transformers 4.x builds a sub-model in its own declared dtype under ``auto``,
    in the given one otherwise). ``None`` when it cannot say (or the config cannot be read)."""
    try:
        cfg = json.loads((Path(weights) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    declared = (cfg.get("dtype") or cfg.get("torch_dtype")) if isinstance(cfg, dict) else None
    if not isinstance(declared, str):
        return None
    declared = declared.removeprefix("torch.")

    def uniform(node: Any) -> bool:
        if isinstance(node, list):
            return all(map(uniform, node))
        if not isinstance(node, dict):
            return True
        if "quantization_config" in node:
            return False
        own = node.get("dtype") or node.get("torch_dtype")
        if own is not None and str(own).removeprefix("torch.") != declared:
            return False
        return all(map(uniform, node.values()))

    return declared if uniform(cfg) else None


def compute_setting(compute_dtype: str, backend: str, weights: str | Path, built: bool = False) -> str:
    """``extraction.compute_dtype`` as it decides the forward: ``auto`` for the checkpoint's
    :func:`auto_dtype` with the ``hf`` backend; else as given, and always for a weights directory
    a job builds (``built``: it may not exist when the workflow's jobs are planned, so the answer
    would change once it does). Light (the Snakefile's rule param): no transformers."""
    if backend != "hf" or compute_dtype == "auto" or built:
        return compute_dtype
    return "auto" if auto_dtype(weights) == compute_dtype else compute_dtype


def declared_num_layers(weights: str | Path) -> int | None:
    """The text model's decoder layer count its ``config.json`` declares, where that is plain: the
    ``text_config``'s ``num_hidden_layers`` (a multimodal checkpoint's language model, as Kimi K2.5),
    else the top level's when no other sub-config declares one. ``None`` when the config cannot be
    read or says it another way (the caller then assumes nothing). Light: no transformers."""
    try:
        cfg = json.loads((Path(weights) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    text = cfg.get("text_config")
    if isinstance(text, dict):
        n = text.get("num_hidden_layers")
        return n if isinstance(n, int) and not isinstance(n, bool) else None
    nested = any(isinstance(v, dict) and "num_hidden_layers" in v for v in cfg.values())
    n = cfg.get("num_hidden_layers")
    return n if isinstance(n, int) and not isinstance(n, bool) and not nested else None


def layers_setting(layers: Any, weights: str | Path, built: bool = False) -> Any:
    """``extraction.layers`` as it decides the shards: ``None`` (the default, EAGLE-3's three layers)
    also for the default layers written out, where the checkpoint's layer count is plain
    (:func:`declared_num_layers`); else as given, and always for a weights directory a job builds.
    Light (the Snakefile's rule param): no transformers."""
    if layers is None or built or not isinstance(layers, list):
        return layers
    from eagledata.extract.layers import default_layers

    n = declared_num_layers(weights)
    return None if n is not None and n >= 5 and list(layers) == default_layers(n) else layers


def model_files(weights: str | Path) -> list[Path]:
    """The files of a weights directory that make the model, sorted: ``config.json``, the weights
    (``*.safetensors``, ``*.bin``) and every other ``*.json`` (an index, a quantization config) but
    :data:`NOT_MODEL_FILES`."""
    root = Path(weights)
    return sorted(p for p in root.glob("*") if p.suffix in (".safetensors", ".bin", ".json")
                  and p.name not in NOT_MODEL_FILES and p.is_file()) if root.is_dir() else []


def cache_dir() -> Path:
    """Where large files' digests are remembered: ``$EAGLEDATA_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/eagledata`` (``~/.cache/eagledata``)."""
    if os.environ.get("EAGLEDATA_CACHE_DIR"):
        return Path(os.environ["EAGLEDATA_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagledata"


def model_fingerprint(weights: str | Path, full_hash_limit: int = FULL_HASH_LIMIT, cache: Path | None = None) -> str:
    """Identity of a weights directory: sha256 over ``config.json`` and, name by name, the content
    digests of the other :func:`model_files` (sha256 up to ``full_hash_limit`` bytes in all, else
    xxh3-128 remembered in ``cache``, :func:`cache_dir` by default: :func:`_remembered_digests`)."""
    root = Path(weights)
    h = hashlib.sha256()
    cfg = root / "config.json"
    h.update(cfg.read_bytes() if cfg.exists() else str(root).encode())
    files = [p for p in model_files(root) if p.name != "config.json"]
    large = sum(p.stat().st_size for p in files) > full_hash_limit
    digests = _remembered_digests(files, cache or cache_dir()) if large else [sha256_file(p) for p in files]
    for p, digest in zip(files, digests):
        h.update(p.name.encode() + b"\0" + digest.encode())
    return h.hexdigest()


def _remembered_digests(files: list[Path], cache: Path) -> list[str]:
    """xxh3-128 of each file, read only when the cache has none for its version (path, device,
    inode, size, mtime and ctime: no tool sets a ctime back, so new bytes under a restored mtime are
    read again); under an exclusive lock, so jobs started together read the weights once. A cache that
    cannot be used (another user's, a read-only home, a file system without locks) is left out: the
    files are read. Entries of files that no longer exist are dropped when the cache is written."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with open(cache / "weight-digests.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return _digests_with_book(files, cache / "weight-digests.json")
    except OSError:
        return [_xxh3_file(p) for p in files]


def _digests_with_book(files: list[Path], book: Path) -> list[str]:
    try:
        known = json.loads(book.read_text(encoding="utf-8")) if book.exists() else {}
    except ValueError:
        known = {}
    if not isinstance(known, dict):
        known = {}  # a damaged cache: read the files again
    out, changed = [], False
    for p in files:
        st = p.stat()
        key, version = str(p.resolve()), [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        entry = known.get(key)
        if not (isinstance(entry, dict) and entry.get("stat") == version and isinstance(entry.get("xxh3"), str)):
            entry = known[key] = {"stat": version, "xxh3": _xxh3_file(p)}
            changed = True
        out.append(entry["xxh3"])
    if changed:
        atomic_write_json(book, {k: v for k, v in known.items() if os.path.exists(k)})
    return out


def _xxh3_file(path: Path) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


__all__ = ["FULL_HASH_LIMIT", "NOT_MODEL_FILES", "cache_dir", "model_files", "model_fingerprint"]

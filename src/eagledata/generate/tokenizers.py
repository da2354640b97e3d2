"""The model's tokenizer for generation and planning: what is wrong with ``models.NAME.tokenizer``
that can be seen without loading it (:func:`tokenizer_problem`; where it points,
:func:`tokenizer_location_problem`, also while the workflow is parsed), whether the workflow itself builds
a path (:func:`workflow_built`), and the loaded tokenizer remembered per process
(:func:`cached_model_tokenizer`). Shared by :mod:`eagledata.generate.preflight` and
:mod:`eagledata.generate.plan`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from eagledata.config import load_model_tokenizer
from eagledata.generate.prompts import canonical_json

#: Files of which a tokenizer directory holds at least one (tiktoken, HF fast, HF slow tokenizers).
TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "spiece.model")
#: A Hugging Face hub id: ``org/name`` (a value of this form that is no local path goes to the loader).
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")

def shown_path(path: Path) -> str:
    """``path`` as written, with its absolute form when it is relative."""
    return str(path) if path.is_absolute() else f"{path} ({path.resolve()})"


def workflow_built(path: str | Path, config: Mapping[str, Any]) -> bool:
    """Whether a rule of the workflow builds ``path`` (``{results_dir}/_assets/...``: the demo
    tokenizer and model), so its absence before that rule ran is no error."""
    assets = Path(config.get("results_dir", "results")) / "_assets"
    try:
        return Path(path).resolve().is_relative_to(assets.resolve())
    except (OSError, ValueError):
        return False


def tokenizer_problem(model: Mapping[str, Any], model_name: str = "?") -> str | None:
    """What is wrong with ``models.NAME.tokenizer`` (and ``chat_template``) that can be seen without
    loading it; ``None`` when nothing is (including a hub id, left to the loader)."""
    source = str(model["tokenizer"])
    path = Path(source).expanduser()
    kind = model.get("tokenizer_kind", "auto")
    where = f"models.{model_name}.tokenizer"
    revision = model.get("tokenizer_revision")
    if revision is not None and path.exists():
        return (f"tokenizer_revision {revision!r} pins a hub id's files, and {shown_path(path)} is a local path: remove "
                f"it, or give the hub id (models.{model_name}.tokenizer_revision)")
    located = tokenizer_location_problem(model)
    if located:
        return f"{located} ({where})"
    if path.exists():
        present = [f for f in TOKENIZER_FILES if (path / f).exists()]
        if not present:
            return (f"tokenizer directory {shown_path(path)} holds no tokenizer files (expected one of "
                    f"{', '.join(TOKENIZER_FILES)}) ({where})")
        if kind == "tiktoken" and "tiktoken.model" not in present:
            return f"tokenizer directory {shown_path(path)} has no tiktoken.model (tokenizer_kind: tiktoken) ({where})"
    template = model.get("chat_template")
    if template and not Path(template).expanduser().is_file():
        return f"chat template file not found: {shown_path(Path(template).expanduser())} (models.{model_name}.chat_template)"
    return None


def tokenizer_location_problem(model: Mapping[str, Any]) -> str | None:
    """What is wrong with where a model's ``tokenizer`` points, seen from the path alone: nothing there
    that is no hub id either (a value of the form ``org/name``, unless ``tokenizer_kind: tiktoken``,
    is left to the loader), or a file; ``None`` otherwise. The part of :func:`tokenizer_problem` that
    the workflow also checks while it is parsed (:func:`eagledata.config.check_tokenizer_locations`)."""
    source = str(model["tokenizer"])
    path = Path(source).expanduser()
    if path.exists():
        return None if path.is_dir() else f"tokenizer path is a file, not a directory: {shown_path(path)}"
    if model.get("tokenizer_kind", "auto") == "tiktoken" or not HUB_ID.fullmatch(source):
        return f"tokenizer directory not found: {shown_path(path)}"
    return None


_TOKENIZERS: dict[str, Any] = {}


def _tokenizer_key(config: Mapping[str, Any], model_name: str) -> str:
    m = config["models"][model_name]
    stamps = []
    for p in (m.get("tokenizer"), m.get("chat_template")):
        path = Path(p) if p else None
        if path is not None and path.exists():
            files = sorted(path.iterdir()) if path.is_dir() else [path]
            stamps += [(str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files if f.is_file()]
    return canonical_json({"model": m, "families": config.get("families"), "files": stamps})


def cached_model_tokenizer(config: Mapping[str, Any], model_name: str) -> Any:
    """:func:`load_model_tokenizer`, remembered per process while the tokenizer files are unchanged."""
    key = _tokenizer_key(config, model_name)
    if key not in _TOKENIZERS:
        if len(_TOKENIZERS) > 8:
            _TOKENIZERS.clear()
        _TOKENIZERS[key] = load_model_tokenizer(config, model_name)
    return _TOKENIZERS[key]

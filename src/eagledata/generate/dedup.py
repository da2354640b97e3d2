"""Deduplication of prompts (dataset setting ``dedup``, default true).

Two prompt records are the same prompt when their canonical prompt ids are equal
(:func:`eagledata.generate.conversation.prompt_key`: the sha256 of the ids the model's chat template
gives the record's messages and tools), so records that differ only in JSON spelling (a string
content vs one text part, arguments as an object vs a string) are found too.

Rule: within a dataset the first record (in file order) is kept. Across datasets, a dataset drops a
record already present in a dataset listed *before* it in ``datasets:`` that is generated from
prompts with the same model and sends the same requests for them (the same backend and endpoint,
the same output-shaping settings and ``turns``: the generate rule's params, :func:`request_params`,
but ``dedup``), so the listed-first dataset's response is the one this dataset would have got. A
dataset on another backend (a stand-in rehearsal, a local server) or with other settings is other
work, whatever its prompts. Each dropped record is reported with the record it duplicates (``generation_summary.json``
``dedup`` and the log).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from eagledata.generate.conversation import prompt_key
from eagledata.generate.prompts import Prompt, read_prompts


@dataclass(frozen=True)
class Duplicate:
    """A record left out: its id and line, and the record it duplicates (``dataset:id``)."""

    id: str
    line: int
    duplicate_of: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "line": self.line, "duplicate_of": self.duplicate_of}


def dataset_option(config: Mapping[str, Any], dataset: str, key: str) -> Any:
    """A dataset's ``turns`` (default ``last``) or ``dedup`` (default true) setting."""
    default = {"turns": "last", "dedup": True}[key]
    return ((config.get("datasets") or {}).get(dataset) or {}).get(key, default)


def earlier_datasets(config: Mapping[str, Any], dataset: str) -> list[str]:
    """The datasets whose prompts this one is deduplicated against (see the module docstring)."""
    names = list(config["datasets"])
    mine, requests = config["datasets"][dataset], _requests_of(config, dataset)
    out = []
    for name in names[: names.index(dataset)]:
        ds = config["datasets"][name]
        if ds.get("prompts") and not ds.get("responses") and ds.get("model") == mine.get("model") \
                and _requests_of(config, name) == requests:
            out.append(name)
    return out


def _requests_of(config: Mapping[str, Any], dataset: str) -> dict[str, Any]:
    """What shapes a dataset's requests and answers: its generate rule's params but ``dedup``."""
    from eagledata.config import dataset_settings
    from eagledata.generate.requests import request_params

    params = request_params(dataset_settings(config, dataset), config)
    params.pop("dedup", None)
    return params


def dedup_prompts(config: Mapping[str, Any], dataset: str, prompts: Sequence[Prompt],
                  tokenizer: Any) -> tuple[list[Prompt], list[Duplicate]]:
    """``prompts`` without duplicates (within the dataset, and of earlier datasets), and the dropped ones."""
    seen: dict[str, str] = {}
    for name in earlier_datasets(config, dataset):
        for p in read_prompts(config["datasets"][name]["prompts"]):
            key = _key(tokenizer, p)
            if key is not None:
                seen.setdefault(key, f"{name}:{p.id}")
    kept, dropped = [], []
    for p in prompts:
        key = _key(tokenizer, p)
        if key is None:  # the template refuses it: kept, for the preflight to stop the job naming file:line
            kept.append(p)
            continue
        if key in seen:
            dropped.append(Duplicate(p.id, p.line, seen[key]))
            continue
        seen[key] = f"{dataset}:{p.id}"
        kept.append(p)
    return kept, dropped


def _key(tokenizer: Any, p: Prompt) -> str | None:
    try:
        return prompt_key(tokenizer, p.messages, p.tools)
    except Exception:  # noqa: BLE001 - ChatTemplateError, or a template's own TypeError
        return None

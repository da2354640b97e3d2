"""Answers cached under another spelling of the same numbers, taken instead of requested again.

YAML reads ``temperature: 1`` as an integer and ``temperature: 1.0`` as a float, and JSON writes them
differently (``1``, ``1.0``), so the body sent, and with it the cache key
(:func:`~eagledata.generate.requests.cache_key`), changes with the spelling alone, though a provider
reads the same number. Changing what the key covers would miss every answer cached under the keys
of today; instead a sample whose key is not cached is looked up once more under the other spellings
of its settings that the cache can hold.

A body's settings are everything but its content (``messages``, ``tools``, SGLang's ``input_ids``),
so the content is never respelled. Two spellings are the same settings when they are equal once every
integral float is read as the integer (a boolean stays a boolean: ``true`` is not ``1``). While the
cache loads, it keeps each settings spelling of its records that holds an integral float
(:func:`settings_spelling`, in :attr:`~eagledata.generate.cache.ResponseCache.spellings`).
:func:`respelled_keys` tries, for each sample not cached, its settings with every integral float
written as an integer and each kept spelling equal to its settings, with the sample's own content,
index and backend salt; a key found in the cache is the same request, answered. The caller points
the sample's key at that record in the cache's index (in memory: nothing is written), so the record
is output as received, with its request as it was sent.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

import orjson

from eagledata.generate.prompts import canonical_json

#: The keys of a body that are its content, not its settings.
CONTENT_KEYS = frozenset({"messages", "tools", "input_ids"})

#: normalised settings text -> the spellings of them (canonical texts) that hold an integral float
Spellings = dict[str, set[str]]


def settings_of(body: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a request body: everything but its content."""
    return {k: v for k, v in body.items() if k not in CONTENT_KEYS}


def settings_text(body: Mapping[str, Any]) -> bytes | str:
    """The settings of a body as written, fast (keys in the body's order: for telling apart the
    spellings seen before, not for comparing them)."""
    settings = settings_of(body)
    try:
        return orjson.dumps(settings)
    except TypeError:  # an integer beyond 64 bits
        return json.dumps(settings)


def as_integers(value: Any) -> Any:
    """``value`` with every integral float (``1.0``) written as the integer (``1``); booleans stay."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, dict):
        return {k: as_integers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_integers(v) for v in value]
    return value


def _has_integral_float(value: Any) -> bool:
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, dict):
        return any(_has_integral_float(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_integral_float(v) for v in value)
    return False


def settings_spelling(request: Any) -> tuple[str, str] | None:
    """``(normalised settings text, settings text)`` of a cached request whose settings hold an
    integral float; ``None`` otherwise (its spelling is the normalised one, tried anyway)."""
    if not isinstance(request, dict):
        return None
    settings = settings_of(request)
    if not _has_integral_float(settings):
        return None
    return canonical_json(as_integers(settings)), canonical_json(settings)


def respelled_keys(items: Iterable[Any], index: Mapping[str, Any], spellings: Spellings,
                   salt: Mapping[str, Any] | None) -> dict[str, str]:
    """``{sample's key: cached key}`` for the ``items`` (:class:`~eagledata.generate.requests.WorkItem`)
    not in ``index`` whose body, with its settings in another spelling of the same numbers, is."""
    from eagledata.generate.requests import cache_key

    found: dict[str, str] = {}
    variants_of: dict[bytes | str, list[dict[str, Any]]] = {}  # settings as written -> other spellings
    for it in items:
        if it.cache_key in index or it.cache_key in found:
            continue
        written = settings_text(it.request)
        variants = variants_of.get(written)
        if variants is None:
            settings = settings_of(it.request)
            variants = variants_of[written] = _other_spellings(settings, canonical_json(settings), spellings)
        if not variants:
            continue
        content = {k: v for k, v in it.request.items() if k in CONTENT_KEYS}
        for spelled in variants:
            key = cache_key({**content, **spelled}, it.sample_index, salt)
            if key in index:
                found[it.cache_key] = key
                break
    return found


def _other_spellings(settings: dict[str, Any], text: str, spellings: Spellings) -> list[dict[str, Any]]:
    """The spellings of ``settings`` (whose text is ``text``) other than its own to look up: every
    integral float as the integer, and each kept spelling with the same numbers."""
    from eagledata.io import loads_json

    normal = as_integers(settings)
    normal_text = canonical_json(normal)
    out = [normal] if normal_text != text else []
    out += [loads_json(s) for s in sorted(spellings.get(normal_text, ())) if s != text]
    return out


def take_respelled(cache: Any, items: Iterable[Any], salt: Mapping[str, Any] | None) -> int:
    """Point the key of every item in ``items`` that :func:`respelled_keys` finds at its cached
    record in ``cache.index``; returns how many."""
    if not cache.index:
        return 0
    found = respelled_keys(items, cache.index, cache.spellings, salt)
    for key, cached in found.items():
        cache.index[key] = cache.index[cached]
    return len(found)


__all__ = ["CONTENT_KEYS", "as_integers", "respelled_keys", "settings_of", "settings_spelling", "settings_text",
           "take_respelled"]

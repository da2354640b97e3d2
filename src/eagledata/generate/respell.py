"""Answers cached under another spelling of the same request (its numbers, its endpoint), taken
instead of requested again.

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
:class:`Respeller` tries, for each sample not cached, its settings with every integral float
written as an integer and each kept spelling equal to its settings, with the sample's own content,
index and backend salt; a status-200 answer found under such a key is the same request, answered.
The sample's key then points at that record in the cache's index (in memory: nothing is written,
:meth:`~eagledata.generate.cache.ResponseCache.alias`), so the record is output as received, with
its request as it was sent. With ``turns: all`` the turn planner asks it for each turn it follows.

The endpoint is part of a key too (the backend salt: :func:`~eagledata.generate.requests.endpoint_salt`),
so a sample is also looked up under the salts of the same endpoint spelled otherwise
(:func:`~eagledata.generate.requests.equivalent_salts`: ``http://localhost:30000`` and
``http://127.0.0.1:30000`` are one SGLang server).
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


def settings_spelling(request: Any) -> tuple[str, str] | None:
    """``(normalised settings text, settings text)`` of a cached request whose settings hold an
    integral float; ``None`` otherwise (its spelling is the normalised one, tried anyway)."""
    if not isinstance(request, dict):
        return None
    settings = settings_of(request)
    normal, text = canonical_json(as_integers(settings)), canonical_json(settings)
    return (normal, text) if normal != text else None


class Respeller:
    """Finds samples of one dataset cache (its salt ``salt``) under the other spellings of their
    settings, and points their keys at the answers found (:meth:`ResponseCache.alias`). Only status-200
    answers are taken: a final error under one spelling (a provider that refuses ``max_tokens: 200.0``)
    is asked again under the other. :attr:`taken` counts the samples found."""

    def __init__(self, cache: Any, salt: Mapping[str, Any] | None) -> None:
        from eagledata.generate.requests import DEFAULT_API_BASE, equivalent_salts

        self.cache, self.salt = cache, salt
        # the same endpoint spelled otherwise (localhost or 127.0.0.1, the default port written or not),
        # where the cache holds requests sent to it: else each sample not cached would hash its body once
        # more per spelling for nothing
        def sent_to(other: Mapping[str, Any] | None) -> bool:
            base = str((other or {}).get("endpoint", DEFAULT_API_BASE)).lower() + "/"
            return any(url.startswith(base) for url in cache.urls)
        self.salts: list[Mapping[str, Any] | None] = [salt, *filter(sent_to, equivalent_salts(salt))]
        self.taken = 0
        self._variants: dict[bytes | str, list[dict[str, Any]]] = {}  # settings as written -> other spellings

    def take(self, items: Iterable[Any]) -> int:
        """Alias each of ``items`` (:class:`~eagledata.generate.requests.WorkItem`) not cached whose
        other spelling is answered; returns how many."""
        n = 0
        for it in items:
            cached = self.find(it)
            if cached is not None:
                self.cache.alias(it.cache_key, cached)
                n += 1
        self.taken += n
        return n

    def find(self, item: Any) -> str | None:
        """The key of the status-200 answer to ``item``'s body in another spelling of its settings;
        ``None`` when it is cached as it is, or not found."""
        from eagledata.generate.requests import cache_key

        cache = self.cache
        if not cache.index or item.cache_key in cache.index:
            return None
        for salt in self.salts[1:]:
            found = self._answered(cache_key(item.request, item.sample_index, salt))
            if found is not None:
                return found
        written = settings_text(item.request)
        variants = self._variants.get(written)
        if variants is None:
            settings = settings_of(item.request)
            variants = self._variants[written] = _other_spellings(settings, canonical_json(settings), cache.spellings)
        if not variants:
            return None
        content = {k: v for k, v in item.request.items() if k in CONTENT_KEYS}
        for spelled in variants:
            for salt in self.salts:
                found = self._answered(cache_key({**content, **spelled}, item.sample_index, salt))
                if found is not None:
                    return found
        return None

    def _answered(self, key: str) -> str | None:
        """The key of the record ``key`` points at when it is a status-200 answer; else ``None``."""
        cache = self.cache
        if key in cache.index and key not in cache.not_answered:
            return cache.aliases.get(key, key)
        return None


def _other_spellings(settings: dict[str, Any], text: str, spellings: Spellings) -> list[dict[str, Any]]:
    """The spellings of ``settings`` (whose text is ``text``) other than its own to look up: every
    integral float as the integer, and each kept spelling with the same numbers (read back by the
    standard library, which keeps an integer beyond 64 bits exact)."""
    normal = as_integers(settings)
    normal_text = canonical_json(normal)
    out = [normal] if normal_text != text else []
    out += [json.loads(s) for s in sorted(spellings.get(normal_text, ())) if s != text]
    return out


__all__ = ["CONTENT_KEYS", "Respeller", "as_integers", "settings_of", "settings_spelling", "settings_text"]

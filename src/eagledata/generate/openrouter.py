"""OpenRouter's account endpoints, used to reconcile the budget ledger: ``GET /generation?id=``
(the cost of one generation, for a reservation whose answer was lost) and ``GET /key`` (the key's
usage); also the request headers of a backend (the API key from the environment). The stand-in
serves both endpoints too."""

from __future__ import annotations

import os
from typing import Any, Mapping
from urllib.parse import quote

from eagledata.generate.errors import GenerationError
from eagledata.generate.transport import TransportError, get_json, new_client

API_KEY_ENV = "OPENROUTER_API_KEY"
#: Statuses that stop the whole job (no request can succeed until the user acts).
FINAL_STATUSES_FATAL = {401: "the API key was rejected (401): check OPENROUTER_API_KEY",
                        402: "OpenRouter answered 402 Payment Required (insufficient credits): add credits or "
                             "lower the load, then rerun"}


def api_key(who: str) -> str:
    """The key in ``OPENROUTER_API_KEY``, without the surrounding whitespace a secret file's trailing
    line break brings. A :class:`GenerationError` (naming ``who`` and never the key) when it is unset,
    or holds whitespace, a control character or a non-ASCII character inside: an HTTP client refuses such a header with an
    error that quotes it, which would carry the key into logs and files."""
    key = (os.environ.get(API_KEY_ENV) or "").strip()
    if not key:
        raise GenerationError(f"{who}: set {API_KEY_ENV} in the environment")
    if any(c.isspace() or not c.isprintable() or not c.isascii() for c in key):
        raise GenerationError(f"{who}: {API_KEY_ENV} holds whitespace, a control character or a non-ASCII "
                              "character: set it to the key alone (it is not shown here)")
    return key


def auth_headers(backend: str, dataset: str) -> dict[str, str]:
    """The headers every request of ``backend`` carries; OpenRouter's include the key
    (:func:`api_key`)."""
    headers = {"X-Title": "eagledata"}
    if backend == "openrouter":
        headers["Authorization"] = f"Bearer {api_key(f'dataset {dataset!r} uses backend openrouter')}"
    return headers


async def reconcile_generations(ledger: Any, api_base: str, headers: Mapping[str, str], dataset: str | None = None,
                                timeout: float = 10.0, limit: int = 2000) -> dict[str, int]:
    """Settle orphans that have a generation id from ``GET {api_base}/generation?id=``
    (``total_cost``). Unknown ids (404: the request was never billed, or not yet visible) and
    unreachable answers stay orphaned. Returns the counts checked, settled and unknown."""
    rows = [r for r in ledger.orphans(dataset, with_generation_id=True) if (r["api_base"] or api_base) == api_base][:limit]
    done = missing = 0
    if not rows:
        return {"checked": 0, "settled": 0, "unknown": 0}
    async with new_client(connect_timeout_s=timeout) as client:
        for r in rows:
            try:
                status, body = await get_json(client, f"{api_base}/generation?id={quote(r['generation_id'])}", headers,
                                              timeout)
            except TransportError:
                missing += 1
                continue
            data = (body or {}).get("data") if isinstance(body, dict) else None
            if status == 200 and isinstance(data, dict) and isinstance(data.get("total_cost"), (int, float)):
                done += ledger.settle(r["ref"], float(data["total_cost"]), provider=data.get("provider_name"),
                                      prompt_tokens=data.get("native_tokens_prompt"),
                                      completion_tokens=data.get("native_tokens_completion"),
                                      note="reconciled from /generation")
            else:
                missing += 1
    return {"checked": len(rows), "settled": done, "unknown": missing}


async def key_usage(api_base: str, headers: Mapping[str, str], timeout: float = 10.0) -> float | None:
    """The key's usage (USD) from ``GET {api_base}/key``; ``None`` when unavailable."""
    async with new_client(connect_timeout_s=timeout) as client:
        try:
            status, body = await get_json(client, f"{api_base}/key", headers, timeout)
        except TransportError:
            return None
    data = body.get("data") if isinstance(body, dict) else None
    if status == 200 and isinstance(data, dict) and isinstance(data.get("usage"), (int, float)):
        return float(data["usage"])
    return None

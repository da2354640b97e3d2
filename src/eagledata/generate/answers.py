"""What one HTTP answer means (:func:`interpret`): success, or a problem and where it was (HTTP
status, an error inside a 200 body or stream, an abnormal finish, a malformed body, missing token
ids), with the cost, provider, generation id and token counts the server reported. OpenRouter-style
bodies are read by :func:`eagledata.tokens.responses.parse_response` (the same reader the tokens
stage uses); SGLang's token ids are normalised by :func:`sglang_completion_ids`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from eagledata.tokens.responses import parse_response


@dataclass
class Answer:
    """One interpreted answer; ``ok`` or a ``problem`` found at ``where``."""

    ok: bool
    problem: str = ""  # when not ok
    where: str = ""  # http | body | stream | finish | malformed | ids
    cost: float | None = None  # reported by the server
    provider: str | None = None
    generation_id: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    streamed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # token_ids etc. for the record


def sglang_completion_ids(ids: Any, finish_type: str | None, matched: Any) -> tuple[list[int] | None, dict[str, Any]]:
    """Normalise the ids an SGLang server returned into the record's ``token_ids``: exactly the
    completion the model sampled after the prompt (for K2.5 after the prompt's ``<think>``), up to
    and INCLUDING the end-of-turn id when the model stopped on it (``finish_reason`` stop /
    tool_calls with an integer ``matched_stop``); no end of turn after ``length``. Versions that
    leave the matched stop id out of the returned ids get it appended (``appended_stop``)."""
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return None, {"problem": "no token ids in the answer"}
    out = list(ids)
    info: dict[str, Any] = {"returned": len(ids), "finish": finish_type, "matched_stop": matched, "appended_stop": False}
    if finish_type in ("stop", "tool_calls") and isinstance(matched, int) and not isinstance(matched, bool):
        if not out or out[-1] != matched:
            out.append(matched)
            info["appended_stop"] = True
    return out, info


def interpret(backend: str, native: bool, status: int, text: str) -> Answer:
    """What one HTTP answer means; never raises."""
    if backend == "sglang" and native:
        try:
            body = json.loads(text)
        except ValueError as exc:
            return Answer(False, f"unparseable body ({exc})", "malformed")
        if status != 200 or not isinstance(body, dict) or "output_ids" not in body:
            msg = body.get("message") or body.get("error") if isinstance(body, dict) else None
            return Answer(False, f"HTTP {status}: {str(msg or text[:200])}", "http" if status != 200 else "body")
        meta = body.get("meta_info") or {}
        fin = meta.get("finish_reason") or {}
        ids, info = sglang_completion_ids(body.get("output_ids"), fin.get("type"), fin.get("matched"))
        if ids is None:
            return Answer(False, info["problem"], "ids")
        if fin.get("type") == "abort":
            return Answer(False, f"generation aborted: {fin.get('message') or fin}", "finish")
        return Answer(True, generation_id=meta.get("id"), provider="sglang", prompt_tokens=meta.get("prompt_tokens"),
                      completion_tokens=meta.get("completion_tokens"), extra={"token_ids": ids, "token_ids_info": info})
    parsed = parse_response(text, status)
    common = dict(cost=parsed.cost, provider=parsed.provider, generation_id=parsed.generation_id,
                  prompt_tokens=parsed.prompt_tokens, completion_tokens=parsed.completion_tokens, streamed=parsed.streamed)
    if not parsed.ok:
        err = parsed.error
        assert err is not None
        if status != 200:
            detail = f": {err.message}" if err.message and err.message != f"HTTP {status}" else ""
            return Answer(False, f"HTTP {status}{detail}", "http", **common)
        return Answer(False, f"error in 200 {'stream' if parsed.streamed else 'body'} ({err.where}, code {err.code}: "
                             f"{err.message})", err.where, **common)
    if backend != "sglang":
        return Answer(True, **common)
    try:
        choice = json.loads(text)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return Answer(False, "unparseable body", "malformed", **common)
    ids, info = sglang_completion_ids(choice.get("token_ids"), choice.get("finish_reason"), choice.get("matched_stop"))
    if ids is None:
        return Answer(False, "SGLang returned no token_ids: this server does not support return_token_ids on "
                             "/v1/chat/completions; set generation.sglang_endpoint: generate", "ids", **common)
    extra: dict[str, Any] = {"token_ids": ids, "token_ids_info": info}
    if isinstance(choice.get("prompt_token_ids"), list):
        extra["prompt_token_ids"] = choice["prompt_token_ids"]
    common["provider"] = common["provider"] or "sglang"
    return Answer(True, extra=extra, **common)



def retryable_status(status: int) -> bool:
    """408, 429 and 5xx are retried; other 4xx are final for their prompt."""
    return status in (408, 429) or status >= 500

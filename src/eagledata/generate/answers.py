"""What one HTTP answer means (:func:`interpret`): success, or a problem and where it was (HTTP
status, an error inside a 200 body or stream, an abnormal finish, a malformed body, missing token
ids), with the cost, provider, generation id and token counts the server reported. OpenRouter-style
bodies are read by :func:`eagledata.tokens.responses.parse_response` (the same reader the tokens
stage uses); SGLang's token ids are normalised by :func:`sglang_completion_ids`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from eagledata.tokens.responses import parse_response, prompt_echo


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


def sglang_completion_ids(ids: Any, finish_type: str | None, matched: Any, prompt: Any = None,
                          counted: Any = None) -> tuple[list[int] | None, dict[str, Any]]:
    """Normalise the ids an SGLang server returned into the record's ``token_ids``: exactly the
    completion the model sampled after the prompt (for K2.5 after the prompt's ``<think>``), up to
    and INCLUDING the end-of-turn id when the model stopped on it (``finish_reason`` stop /
    tool_calls with an integer ``matched_stop``); no end of turn after ``length``. Ids that leave the
    matched stop id out get it appended (``appended_stop``). Ids that begin with the prompt's last
    ``k`` ids, ``k`` more than the engine's completion count ``counted`` (SGLang releases whose
    detokenizer returned its decode window, the prompt's last 5 ids and the output, as
    ``output_ids``: sgl-project/sglang issues #10896, #17240), lose them (``prompt_echo``: ``k``),
    only when they are exactly the end of ``prompt`` (the engine's prompt ids). Where the engine
    reported ``counted``, the result has exactly that many ids, else ``(None, {"problem": ...})``:
    ids the engine's own count disagrees with are never stored."""
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return None, {"problem": "no token ids in the answer"}
    out = list(ids)
    stop = matched if finish_type in ("stop", "tool_calls") and isinstance(matched, int) \
        and not isinstance(matched, bool) else None
    info: dict[str, Any] = {"returned": len(ids), "finish": finish_type, "matched_stop": matched, "appended_stop": False}
    count = counted if isinstance(counted, int) and not isinstance(counted, bool) else None
    echo = prompt_echo(out, prompt, count, stop is not None and (not out or out[-1] != stop))
    if echo is None:
        return None, {"problem": f"{len(ids)} token ids returned for a completion the server counted as {count} "
                                 "tokens, and the ids too many are not the prompt's last ids"}
    if echo:
        out, info["prompt_echo"] = out[echo:], echo
    if stop is not None and (not out or out[-1] != stop):
        out.append(stop)
        info["appended_stop"] = True
    if count is not None and len(out) != count:
        return None, {"problem": f"{len(ids)} token ids returned for a completion the server counted as {count} "
                                 f"tokens (finish {finish_type!r}, matched stop {matched!r}): the missing ids are unknown"}
    return out, info


#: An answer without usable token ids: the server (its release, or a bug in it) answers every
#: request so, and each is a whole generation spent for nothing, so the job stops at the first.
IDS_FATAL = "ids"


def interpret(backend: str, native: bool, status: int, text: str, prompt_ids: Any = None) -> Answer:
    """What one HTTP answer means; never raises. ``prompt_ids``: the ``input_ids`` sent to SGLang's
    native endpoint (its answer's ids are checked against them)."""
    if backend == "sglang" and native:
        return interpret_native(status, text, prompt_ids)
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
    if choice.get("finish_reason") == "abort":  # a generation the server stopped part-way: asked again
        return Answer(False, "generation aborted (finish_reason abort)", "finish", **common)
    if choice.get("token_ids") is None:
        return Answer(False, "SGLang returned no token_ids: this server does not support return_token_ids on "
                             "/v1/chat/completions (SGLang before sgl-project/sglang#30917 ignores it); upgrade it, "
                             "or set generation.sglang_endpoint: generate", IDS_FATAL, **common)
    ids, info = sglang_completion_ids(choice.get("token_ids"), choice.get("finish_reason"), choice.get("matched_stop"),
                                      choice.get("prompt_token_ids"), parsed.completion_tokens)
    if ids is None:
        return Answer(False, f"SGLang's token_ids are unusable: {info['problem']}", IDS_FATAL, **common)
    extra: dict[str, Any] = {"token_ids": ids, "token_ids_info": info}
    if isinstance(choice.get("prompt_token_ids"), list):
        extra["prompt_token_ids"] = choice["prompt_token_ids"]
    common["provider"] = common["provider"] or "sglang"
    return Answer(True, extra=extra, **common)


def interpret_native(status: int, text: str, prompt_ids: Any) -> Answer:
    """An answer of SGLang's native ``/generate`` (see :func:`interpret`)."""
    try:
        body = json.loads(text)
    except ValueError as exc:
        return Answer(False, f"unparseable body ({exc})", "malformed")
    if status != 200 or not isinstance(body, dict) or "meta_info" not in body:
        msg = body.get("message") or body.get("error") if isinstance(body, dict) else None
        return Answer(False, f"HTTP {status}: {str(msg or text[:200])}", "http" if status != 200 else "body")
    meta = body.get("meta_info") or {}
    fin = meta.get("finish_reason") or {}
    if not isinstance(fin, dict):
        fin = {"type": fin}
    if fin.get("type") == "abort":
        return Answer(False, f"generation aborted: {fin.get('message') or fin}", "finish")
    if "output_ids" not in body:
        return Answer(False, "SGLang's /generate answered without output_ids: this server does not return the "
                             "generated ids", IDS_FATAL)
    ids, info = sglang_completion_ids(body.get("output_ids"), fin.get("type"), fin.get("matched"), prompt_ids,
                                      meta.get("completion_tokens"))
    if ids is None:
        return Answer(False, f"SGLang's output_ids are unusable: {info['problem']}", IDS_FATAL)
    return Answer(True, generation_id=meta.get("id"), provider="sglang", prompt_tokens=meta.get("prompt_tokens"),
                  completion_tokens=meta.get("completion_tokens"), extra={"token_ids": ids, "token_ids_info": info})


def retryable_status(status: int) -> bool:
    """408, 429 and 5xx are retried; other 4xx are final for their prompt."""
    return status in (408, 429) or status >= 500

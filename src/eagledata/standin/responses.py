"""What the stand-in sends back: one :class:`Generation` per answer, and its bodies in every shape the
server speaks: OpenRouter's JSON body (:func:`json_body`) and SSE stream (:func:`sse_events`, chunks
shaped like the recorded traffic), SGLang's ``/v1/chat/completions`` (:func:`sglang_chat_body`) and
native ``/generate`` (:func:`sglang_generate_body`). Also the request key the counters use
(:func:`prompt_hash`) and a small LRU (:class:`Memo`) for completions, which are pure functions of
the request.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from eagledata.generate.prompts import canonical_json, sha256_hex
from eagledata.standin.model import Completion
from eagledata.standin.profiles import ProviderMessage
from eagledata.text.tokenizer import Tokenizer


def prompt_hash(request: Mapping[str, Any]) -> str:
    """Key of :attr:`SimulatorServer.request_counts`: the prompt content (messages + tools; the
    prompt ids for a native SGLang request)."""
    if "messages" not in request and "input_ids" in request:
        return sha256_hex(canonical_json({"input_ids": request.get("input_ids")}))[:16]
    return sha256_hex(canonical_json({"messages": request.get("messages"), "tools": request.get("tools") or None}))[:16]


def dumps(obj: Any) -> str:
    """Compact JSON, as the recorded traffic has it."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def pieces(text: str, rng: random.Random) -> Iterator[str]:
    """Split text into stream deltas of one to three words; their concatenation is the text.
    An empty text gives one empty delta (so a client still sees the field)."""
    words = re.findall(r"\s*\S+|\s+", text) or [""]
    i = 0
    while i < len(words):
        k = rng.randint(1, 3)
        yield "".join(words[i:i + k])
        i += k


@dataclass
class SharedAnswer:
    """What every answer to one request shares: the truth, the decoded message before the
    response quirks, the usage, and (when ``shared``) the serialised choices of a JSON answer."""

    completion: Completion
    message: ProviderMessage  # decoded, counts adjusted, before response quirks
    usage: dict[str, Any]
    shared: bool  # no response quirk applies: every answer carries ``message`` unchanged
    prompt_hash: str
    choices_json: str | None = None
    usage_json: str | None = None


@dataclass
class Generation:
    """One answer: its id, truth, message as sent, usage and what it was billed."""

    id: str
    created: int
    model: str
    completion: Completion
    message: ProviderMessage
    usage: dict[str, Any]
    provider: str
    streamed: bool
    latency_ms: float
    billed: float = 0.0  # what the stand-in charged for it (0 for errors in 200 bodies)
    base: SharedAnswer | None = None


class Memo(OrderedDict):
    """A small LRU of completions (they are pure functions of the request)."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_or(self, key: Any, make: Callable[[], Any]) -> Any:
        """The value for ``key``, made with ``make()`` (and kept) when missing."""
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = make()
        self[key] = value
        if len(self) > self.size:
            self.popitem(last=False)
        return value


# ----------------------------------------------------------------------------------------------
# OpenRouter shapes


def choices_json(g: Generation) -> str:
    """The ``choices`` array of a JSON answer, serialised."""
    m = g.message
    message: dict[str, Any] = {"role": "assistant", "content": m.content, "refusal": None, "reasoning": m.reasoning}
    if m.reasoning is not None:
        message["reasoning_details"] = [{"type": "reasoning.text", "text": m.reasoning, "format": "unknown", "index": 0}]
    if m.tool_calls:
        message["tool_calls"] = [{"index": i, "id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for i, c in enumerate(m.tool_calls)]
    return dumps([{"logprobs": None, "finish_reason": m.finish_reason, "native_finish_reason": m.native_finish_reason,
                   "index": 0, "message": message}])


def json_body(g: Generation, padding: str, usage_shown: bool = True) -> str:
    """OpenRouter's non-streamed body, after its keep-alive ``padding`` (``usage_shown=False``: without
    its usage object, as a provider's answer that reports no counts)."""
    b = g.base
    if b is not None and b.shared:
        if b.choices_json is None:
            b.choices_json, b.usage_json = choices_json(g), dumps(g.usage)
        choices, usage = b.choices_json, b.usage_json
    else:
        choices, usage = choices_json(g), dumps(g.usage)
    return (f'{padding}{{"id":{dumps(g.id)},"provider":{dumps(g.provider)},"model":{dumps(g.model)},'
            f'"object":"chat.completion","created":{g.created},"choices":{choices},"system_fingerprint":null'
            + (f',"usage":{usage}}}' if usage_shown else "}"))


def sse_events(g: Generation, fail_midway: bool = False, malformed: bool = False) -> Iterator[str]:
    """The stream's ``data:`` payloads (without the ``data: `` prefix), ``[DONE]`` last."""
    return (payload for payload, _ in sse_stream(g, fail_midway, malformed))


def sse_stream(g: Generation, fail_midway: bool = False, malformed: bool = False) -> list[tuple[str, int]]:
    """The stream's events as ``(payload, generated)``: the ``data:`` payload (without the prefix)
    and how many characters of generated text it carries (reasoning, content or tool-call text;
    0 for the finish, usage, error and ``[DONE]`` events), which is what a paced stream spends its
    time on (see :func:`pace_events`)."""
    m = g.message
    rng = random.Random(g.id)
    head = {"id": g.id, "provider": g.provider, "model": g.model, "object": "chat.completion.chunk", "created": g.created}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return dumps({**head, "choices": [{"index": 0, "delta": {"role": "assistant", **delta},
                                            "finish_reason": finish, "native_finish_reason": finish,
                                            "logprobs": None}], "system_fingerprint": None, **extra})

    deltas: list[tuple[str, int]] = []
    for piece in pieces(m.reasoning, rng) if m.reasoning is not None else ():
        deltas.append((chunk({"content": "", "reasoning": piece, "reasoning_details": [
            {"type": "reasoning.text", "text": piece, "format": "unknown", "index": 0}]}), len(piece)))
    for piece in pieces(m.content, rng) if m.content else ():
        deltas.append((chunk({"content": piece}), len(piece)))
    for i, c in enumerate(m.tool_calls):
        call = {"index": i, "id": c["id"], "type": "function"}
        deltas.append((chunk({"content": None, "tool_calls": [{**call, "function": {"name": c["name"], "arguments": ""}}]}),
                       len(c["name"])))
        for piece in pieces(c["arguments"], rng):
            deltas.append((chunk({"content": None, "tool_calls": [{**call, "function": {"name": "", "arguments": piece}}]}),
                           len(piece)))
    if fail_midway:
        error = dumps({**head, "error": {"code": 502, "message": "Upstream provider disconnected mid-stream"},
                       "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error",
                                    "native_finish_reason": "error"}]})
        return deltas[: len(deltas) // 2] + [(error, 0)]
    if malformed and deltas:
        k = len(deltas) // 2
        deltas[k] = (deltas[k][0][: len(deltas[k][0]) // 2], deltas[k][1])
    return deltas + [(chunk({"content": ""}, m.finish_reason), 0), (chunk({"content": ""}, None, usage=g.usage), 0),
                     ("[DONE]", 0)]


def pace_events(generated: list[int], latency_s: float, first_token_s: float, write_s: float) -> list[float]:
    """When each event of a paced stream is sent, in seconds after the request (one per entry of
    ``generated``, the characters of text each event carries, as :func:`sse_stream` gives them).

    The stream lasts the response's latency: the first event after ``first_token_s`` (the time to
    first token, at most the latency), then the text at one constant rate (characters stand for
    tokens: a chunk of a few tokens waits for its share of the time), the last text at
    ``latency_s``, and the events that carry no text (finish, usage, ``[DONE]``) right after the
    text before them. Times are rounded up to multiples of ``write_s`` (when > 0), so the events due
    within one such interval leave in one write, as a serving stack flushes them."""
    first = min(max(first_token_s, 0.0), latency_s)
    if not generated:
        return []
    rest = sum(generated) - generated[0]
    span, done, times = latency_s - first, 0, []
    for k, chars in enumerate(generated):
        done += chars if k else 0
        times.append(first if not k else first + span * done / rest if rest else latency_s)
    if write_s > 0:
        times = [min(math.ceil(t / write_s - 1e-9) * write_s, latency_s) if t > first else t for t in times]
    return times


# ----------------------------------------------------------------------------------------------
# SGLang shapes


def sglang_chat_thinking(body: Mapping[str, Any]) -> bool | None:
    """Whether SGLang's ``/v1/chat/completions`` renders ``body`` with thinking on (``None``: the
    template's default, thinking for K2.5), by SGLang's rules (its protocol's reasoning inputs, as of
    2026): ``chat_template_kwargs`` ``thinking``/``enable_thinking`` first, then a reasoning effort
    (``reasoning_effort``, ``reasoning.effort``: ``none`` is off), then ``reasoning.enabled: true``.
    ``reasoning.enabled: false`` (OpenRouter's off switch) is not among them: it changes nothing."""
    ctk = body.get("chat_template_kwargs") if isinstance(body.get("chat_template_kwargs"), Mapping) else {}
    for key in ("thinking", "enable_thinking"):
        if ctk.get(key) is not None:
            return bool(ctk[key])
    r = body.get("reasoning") if isinstance(body.get("reasoning"), Mapping) else {}
    effort = body.get("reasoning_effort") or r.get("effort") or r.get("reasoning_effort")
    if effort is not None:
        return effort != "none"
    return True if r.get("enabled", r.get("enable")) else None


def sglang_chat_engine_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` as the stand-in's model reads it (OpenRouter's ``reasoning.enabled``) with the thinking
    SGLang would render it with (:func:`sglang_chat_thinking`)."""
    out = {k: v for k, v in body.items() if k != "reasoning"}
    thinking = sglang_chat_thinking(body)
    if thinking is not None:
        out["reasoning"] = {"enabled": thinking}
    return out


def sglang_output_ids(g: Generation, trim_stop: bool, echo: int = 0) -> tuple[list[int], int | None]:
    """The returned output ids and the matched stop id (the end of turn when the model stopped);
    ``trim_stop`` leaves the matched stop id out of the ids (no SGLang release found to; kept as a
    defence), ``echo`` puts the prompt's last ``echo`` ids before them (SGLang releases whose
    detokenizer returned its decode window, 5 prompt ids and the output, as ``output_ids``:
    sgl-project/sglang issues #10896, #17240)."""
    ids = list(g.completion.ids)
    matched = ids[-1] if g.completion.stopped else None
    if matched is not None and trim_stop:
        ids = ids[:-1]
    if echo > 0:
        ids = list(g.completion.prompt_ids[-echo:]) + ids
    return ids, matched


def sglang_chat_body(g: Generation, body: Mapping[str, Any], trim_stop: bool = False, echo: int = 0,
                     token_ids: bool = True) -> str:
    """SGLang's ``/v1/chat/completions`` answer: ``reasoning_content`` (reasoning parser),
    ``tool_calls`` (tool-call parser, native ids), ``matched_stop`` (``None`` after tool calls: SGLang's
    tool-call parser turns a ``stop`` finish into ``tool_calls`` and clears the match), the choice's
    ``token_ids`` (the output ids) with ``return_token_ids`` (``token_ids=False``: a server before
    SGLang's ``return_token_ids`` on chat, sgl-project/sglang#30917, which ignores the field) and
    ``prompt_token_ids`` with it or ``return_prompt_token_ids``; usage counts every output id
    (including the end of turn)."""
    m = g.message
    ids, matched = sglang_output_ids(g, trim_stop, echo)
    tool_calls = [{"id": c["id"], "index": i, "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                  for i, c in enumerate(m.tool_calls)] or None
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": m.content or None,
                                                      "reasoning_content": m.reasoning, "tool_calls": tool_calls},
                              "logprobs": None, "finish_reason": m.finish_reason,
                              "matched_stop": None if m.finish_reason == "tool_calls" else matched}
    token_ids = token_ids and bool(body.get("return_token_ids"))
    if token_ids:
        choice["token_ids"] = ids
    if token_ids or body.get("return_prompt_token_ids"):
        choice["prompt_token_ids"] = g.completion.prompt_ids
    if body.get("return_meta_info"):
        choice["meta_info"] = {"id": g.id, "completion_tokens": len(g.completion.ids)}
    n_out = len(g.completion.ids)
    usage = {"prompt_tokens": len(g.completion.prompt_ids), "total_tokens": len(g.completion.prompt_ids) + n_out,
             "completion_tokens": n_out, "prompt_tokens_details": None, "reasoning_tokens": m.reasoning_tokens}
    return dumps({"id": g.id.removeprefix("gen-"), "object": "chat.completion", "created": g.created, "model": g.model,
                   "choices": [choice], "usage": usage, "metadata": {"weight_version": "default"}})

def sglang_generate_body(g: Generation, body: Mapping[str, Any], tokenizer: Tokenizer, trim_stop: bool = False,
                         echo: int = 0) -> str:
    """SGLang's native ``/generate`` answer: ``text``, ``output_ids`` (see :func:`sglang_output_ids`),
    ``meta_info`` (``finish_reason`` {type, matched}, prompt/completion token counts)."""
    sp = body.get("sampling_params") or {}
    ids, matched = sglang_output_ids(g, trim_stop, echo)
    full = g.completion.ids
    text_ids = full if (sp.get("no_stop_trim") or matched is None) else full[:-1]
    if sp.get("skip_special_tokens", True):
        text_ids = [i for i in text_ids if not tokenizer.is_special_id(i)]
    finish = ({"type": "stop", "matched": matched} if matched is not None
              else {"type": "length", "length": len(full)})
    meta = {"id": g.id.removeprefix("gen-"), "finish_reason": finish, "prompt_tokens": len(g.completion.prompt_ids),
            "weight_version": "default", "completion_tokens": len(full), "cached_tokens": 0,
            "e2e_latency": round(g.latency_ms / 1000, 4)}
    return dumps({"text": tokenizer.decode(text_ids), "output_ids": ids, "meta_info": meta})


def sglang_aborted(text: str, kind: str) -> str:
    """An SGLang answer (``text``, of endpoint ``kind``: chat or generate) as the server answers a
    generation it aborted part-way (``/abort_request``, a shutdown, a request retracted for memory):
    a 200 whose finish is ``abort``, with the output up to then (here: half its ids and text)."""
    body = json.loads(text)
    if kind == "chat":
        choice = body["choices"][0]
        choice.update(finish_reason="abort", matched_stop=None)
        choice["message"].update(content=(choice["message"]["content"] or "")[: len(choice["message"]["content"] or "") // 2],
                                 tool_calls=None)
        if "token_ids" in choice:
            choice["token_ids"] = choice["token_ids"][: len(choice["token_ids"]) // 2]
        body["usage"]["completion_tokens"] //= 2
        return dumps(body)
    body["output_ids"] = body["output_ids"][: len(body["output_ids"]) // 2]
    body["text"] = body["text"][: len(body["text"]) // 2]
    meta = body["meta_info"]
    meta.update(finish_reason={"type": "abort", "message": "Abort request " + str(meta["id"])},
                completion_tokens=len(body["output_ids"]))
    return dumps(body)

"""A local stand-in for OpenRouter's chat-completions API, with ground truth.

:class:`SimulatorServer` is a real HTTP server on loopback speaking

* ``POST /api/v1/chat/completions``: JSON bodies (with OpenRouter's leading whitespace padding) and
  SSE streams (``: OPENROUTER PROCESSING`` comments, ``data: {chunk}`` lines shaped like the recorded
  traffic, ``data: [DONE]``);
* ``GET /api/v1/generation?id=``: OpenRouter's generation stats (native token counts, cost);
* ``GET /_sim/truth?id=``: the ground truth, i.e. the exact completion token ids and their segments.

Every completion is made as TOKEN IDS FIRST (:class:`CompletionModel`): reasoning text (random
sentence spans of the bundled corpus), the family's think tokens, content text, an optional tool-call
section with native ids ``functions.NAME:IDX`` (IDX counts calls across the whole conversation) and
schema-conforming JSON arguments, then the end-of-turn id; ``max_tokens`` truncates the ids (finish
``length``, no end of turn). Text segments are ``encode_plain`` of chosen text; special ids are looked
up by name. The response fields are then DECODED from the ids, as a serving stack does, and a
:class:`ProviderProfile` applies the provider's quirks (small hook functions) on top. The completion
is a pure function of (server seed, request content): :func:`CompletionModel.complete` recomputes the
truth of any recorded simulator request offline.

Faults (HTTP errors with ``Retry-After``, errors inside 200 bodies, mid-stream error chunks, hangs,
dropped connections) are injected per request number or by a callable; see :class:`Fault`.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import secrets
import socket
import string
import sys
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from functools import lru_cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Callable, Iterator, Mapping, Sequence
from urllib.parse import parse_qs, urlparse

from .chat import ChatTemplateError, prompt_ids, request_thinking
from .families import ModelFamily
from .prompts import canonical_json, sha256_hex
from .reconstruct import Segment, count_tool_calls
from .tokenizer import Tokenizer

API_PREFIX = "/api/v1"
DEFAULT_MAX_TOKENS = 16384
#: OpenRouter's keep-alive padding before a JSON body, as seen in the recorded traffic.
JSON_PADDING = "\n         \n\n"
PROCESSING_COMMENT = ": OPENROUTER PROCESSING"


# ----------------------------------------------------------------------------------------------
# Corpus


@lru_cache(maxsize=4)
def corpus_sentences(text: str | None = None) -> tuple[tuple[str, int], ...]:
    """Sentences of the corpus as (text, paragraph number), in corpus order."""
    if text is None:
        text = resources.files("eagledata").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    out: list[tuple[str, int]] = []
    for p, para in enumerate(re.split(r"\n\s*\n", text)):
        for sentence in re.split(r"(?<=[.!?])\s+", para.strip()):
            if sentence and len(sentence) <= 300:
                out.append((sentence, p))
    if not out:
        raise ValueError("simulator corpus has no sentences")
    return tuple(out)


@lru_cache(maxsize=4)
def corpus_words(text: str | None = None) -> tuple[str, ...]:
    words = {w for s, _ in corpus_sentences(text) for w in re.findall(r"[A-Za-z]{3,12}", s)}
    return tuple(sorted(words))


# ----------------------------------------------------------------------------------------------
# Completions as token ids


@dataclass
class Completion:
    """Ground truth of one completion: ``ids`` and their ``segments`` (``ids[start:end]``, the same
    kinds as :mod:`eagledata.reconstruct`)."""

    ids: list[int]
    segments: list[Segment]
    thinking: bool
    stopped: bool  # ends with the end-of-turn id
    finish_reason: str  # stop | tool_calls | length
    prompt_ids: list[int]

    def to_dict(self) -> dict[str, Any]:
        return {"ids": self.ids, "segments": [s.to_dict() for s in self.segments], "thinking": self.thinking,
                "stopped": self.stopped, "finish_reason": self.finish_reason,
                "prompt_ids": self.prompt_ids, "prompt_tokens": len(self.prompt_ids),
                "completion_tokens": len(self.ids)}


class RequestError(ValueError):
    """The request body is unusable (answered 400)."""


def _thinking_on(family: ModelFamily, request: Mapping[str, Any]) -> bool:
    return family.thinking and request_thinking(request) is not False


def request_max_tokens(request: Mapping[str, Any]) -> int:
    mt = request.get("max_tokens", request.get("max_completion_tokens"))
    if mt is None:
        return DEFAULT_MAX_TOKENS
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise RequestError(f"max_tokens must be a positive integer, got {mt!r}")
    return mt


def generation_key(request: Mapping[str, Any], seed: int) -> str:
    """What the completion depends on: the server seed and the request content. ``max_tokens``,
    ``stream``, ``usage`` and ``provider`` are left out, so a truncated response is a prefix of the
    full one and streamed/non-streamed answers carry the same completion."""
    keep = {k: request.get(k) for k in ("model", "messages", "tools", "tool_choice", "seed", "temperature",
                                         "top_p", "reasoning")}
    return sha256_hex(canonical_json({"server_seed": seed, "request": keep}))


class CompletionModel:
    """Makes completions as token ids; deterministic in (seed, request content)."""

    def __init__(self, tokenizer: Tokenizer, family: ModelFamily, seed: int = 0,
                 reasoning_tokens: tuple[int, int] = (8, 48), content_tokens: tuple[int, int] = (4, 32),
                 tool_call_probability: float = 0.6, corpus: str | None = None):
        self.tok, self.family, self.seed = tokenizer, family, seed
        self.reasoning_tokens, self.content_tokens = reasoning_tokens, content_tokens
        self.tool_call_probability = tool_call_probability
        self.sentences = corpus_sentences(corpus)
        self.words = corpus_words(corpus)
        # Special ids by name, from the tokenizer (the load-time self-check vouches for them).
        self.sid = {name: tokenizer.special_id(name) for name in family.completion_specials()}

    # -- text -----------------------------------------------------------------------------------
    def _text(self, rng: random.Random, target_tokens: int) -> str:
        i = rng.randrange(len(self.sentences))
        parts: list[str] = []
        n = 0
        para = self.sentences[i][1]
        while n < target_tokens:
            sentence, p = self.sentences[i % len(self.sentences)]
            if parts:
                parts.append("\n\n" if p != para else " ")
            parts.append(sentence)
            para = p
            n += len(self.tok.encode_plain(sentence))
            i += 1
        return "".join(parts)

    def _value(self, schema: Any, rng: random.Random, depth: int = 0) -> Any:
        if not isinstance(schema, Mapping):
            schema = {}
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return rng.choice(schema["enum"])
        kind = schema.get("type", "string")
        if isinstance(kind, list):
            kind = rng.choice([k for k in kind if k != "null"] or ["null"])
        if kind == "integer":
            lo = int(schema.get("minimum", 0))
            return rng.randint(lo, max(lo, int(schema.get("maximum", lo + 100))))
        if kind == "number":
            lo = float(schema.get("minimum", 0))
            return round(rng.uniform(lo, float(schema.get("maximum", lo + 100))), 2)
        if kind == "boolean":
            return rng.random() < 0.5
        if kind == "null":
            return None
        if kind == "array":
            return [self._value(schema.get("items"), rng, depth + 1) for _ in range(rng.randint(1, 3) if depth < 3 else 0)]
        if kind == "object":
            props = schema.get("properties") or {}
            required = set(schema.get("required") or [])
            return {k: self._value(v, rng, depth + 1) for k, v in props.items()
                    if depth < 4 and (k in required or rng.random() < 0.5)}
        return " ".join(rng.choice(self.words) for _ in range(rng.randint(1, 4)))

    # -- completion -----------------------------------------------------------------------------
    def complete(self, request: Mapping[str, Any]) -> Completion:
        """The completion for ``request`` (raises :class:`RequestError` or ChatTemplateError)."""
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list")
        tools = request.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise RequestError("tools must be a list")
        max_tokens = request_max_tokens(request)
        thinking = _thinking_on(self.family, request)
        p_ids = prompt_ids(self.tok, messages, tools, thinking=request_thinking(request))
        rng = random.Random(int(generation_key(request, self.seed)[:16], 16))
        f = self.family
        ids: list[int] = []
        segments: list[Segment] = []

        def special(kind: str, name: str, call: int | None = None) -> None:
            segments.append(Segment(kind, len(ids), len(ids) + 1, None, call))
            ids.append(self.sid[name])

        def text(kind: str, value: str, call: int | None = None) -> None:
            if value:
                start = len(ids)
                ids.extend(self.tok.encode_plain(value))
                segments.append(Segment(kind, start, len(ids), value, call))

        if thinking:
            target = rng.randint(*self.reasoning_tokens)
            rmax = (request.get("reasoning") or {}).get("max_tokens")
            if isinstance(rmax, int) and rmax > 0:
                target = min(target, rmax)
            if not f.think_in_prompt:
                special("think_open", f.think_open)
            text("reasoning", self._text(rng, target))
            special("think_close", f.think_close)

        calls = self._choose_calls(request, tools, rng)
        content = self._text(rng, rng.randint(*self.content_tokens))
        if rng.random() < 0.15:  # models write special-token text inside code; it stays plain text
            content += f" For example `{f.end_of_turn}` marks the end of a turn."
        if thinking and rng.random() < 0.3:
            content = "\n\n" + content
        if calls and rng.random() < 0.3:
            content = ""
        text("content", content)
        if calls:
            offset = count_tool_calls(messages)
            special("tool_section_begin", f.tool_section_begin)
            for n, (name, args) in enumerate(calls):
                special("tool_call_begin", f.tool_call_begin, n)
                text("tool_id", f.native_tool_call_id(name, offset + n), n)
                special("tool_argument_begin", f.tool_argument_begin, n)
                text("tool_arguments", args, n)
                special("tool_call_end", f.tool_call_end, n)
            special("tool_section_end", f.tool_section_end)
        special("end_of_turn", f.end_of_turn)

        if len(ids) <= max_tokens:
            return Completion(ids, segments, thinking, True, "tool_calls" if calls else "stop", p_ids)
        return Completion(ids[:max_tokens], self._clip(segments, ids, max_tokens), thinking, False, "length", p_ids)

    def _choose_calls(self, request: Mapping[str, Any], tools: list | None, rng: random.Random) -> list[tuple[str, str]]:
        if not tools:
            return []
        usable = [t["function"] for t in tools
                  if isinstance(t, Mapping) and isinstance(t.get("function"), Mapping) and t["function"].get("name")]
        choice = request.get("tool_choice", "auto")
        if not usable or choice == "none":
            return []
        if isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
            usable = [u for u in usable if u["name"] == choice["function"].get("name")] or usable
            forced = True
        else:
            forced = choice == "required"
        if not forced and rng.random() >= self.tool_call_probability:
            return []
        n_calls = 1 if rng.random() < 0.7 else 2
        out = []
        for _ in range(n_calls):
            fn = rng.choice(usable)
            args = self._value(fn.get("parameters") or {"type": "object"}, rng)
            out.append((fn["name"], json.dumps(args, ensure_ascii=False)))
        return out

    def _clip(self, segments: list[Segment], ids: list[int], n: int) -> list[Segment]:
        out = []
        for s in segments:
            if s.start >= n:
                break
            if s.end <= n:
                out.append(s)
            else:
                out.append(Segment(s.kind, s.start, n, self.tok.decode(ids[s.start:n]), s.call))
        return out


# ----------------------------------------------------------------------------------------------
# What a provider returns: decoded from the ids, then the provider's quirks


@dataclass
class ProviderMessage:
    """The response fields a provider builds from the completion ids (mutable by quirk hooks)."""

    reasoning: str | None
    content: str
    tool_calls: list[dict[str, str]]  # {"id", "name", "arguments"}
    finish_reason: str
    native_finish_reason: str
    completion_tokens: int
    reasoning_tokens: int


def decode_completion(ids: Sequence[int], tok: Tokenizer, family: ModelFamily, thinking: bool,
                      finish_reason: str) -> ProviderMessage:
    """Split completion ids at the family's special ids and decode each text run, as a serving
    stack's reasoning and tool-call parsers do. An unfinished tool call (truncation) is dropped."""
    sid = {name: tok.special_id(name) for name in family.completion_specials()}
    n = len(ids)

    def find(start: int, *names: str) -> int:
        targets = {sid[x] for x in names}
        for j in range(start, n):
            if ids[j] in targets:
                return j
        return n

    i = 0
    reasoning = None
    reasoning_tokens = 0
    if thinking:
        if not family.think_in_prompt and n and ids[0] == sid[family.think_open]:
            i = 1
        j = find(i, family.think_close)
        reasoning, reasoning_tokens = tok.decode(ids[i:j]), j - i
        i = min(j + 1, n)
    j = find(i, family.tool_section_begin, family.end_of_turn)
    content = tok.decode(ids[i:j])
    calls: list[dict[str, str]] = []
    if j < n and ids[j] == sid[family.tool_section_begin]:
        i = j + 1
        id_re = re.compile(family.tool_call_id_pattern)
        while i < n and ids[i] == sid[family.tool_call_begin]:
            a = find(i + 1, family.tool_argument_begin)
            e = find(a + 1, family.tool_call_end)
            if e >= n:
                break
            call_id = tok.decode(ids[i + 1:a])
            m = id_re.fullmatch(call_id)
            calls.append({"id": call_id, "name": m.group("name") if m else call_id,
                          "arguments": tok.decode(ids[a + 1:e])})
            i = e + 1
    return ProviderMessage(reasoning, content, calls, finish_reason, finish_reason, n, reasoning_tokens)


@dataclass
class QuirkContext:
    rng: random.Random
    family: ModelFamily
    request: Mapping[str, Any]


Hook = Callable[[ProviderMessage, QuirkContext], None]


def strip_leading_whitespace(msg: ProviderMessage, ctx: QuirkContext) -> None:
    msg.content = msg.content.lstrip()
    if msg.reasoning is not None:
        msg.reasoning = msg.reasoning.lstrip()


def rewrite_tool_ids(msg: ProviderMessage, ctx: QuirkContext) -> None:
    """Replace native ids with provider ids (``call_...``), as several providers do."""
    alphabet = string.ascii_letters + string.digits
    for call in msg.tool_calls:
        call["id"] = "call_" + "".join(ctx.rng.choice(alphabet) for _ in range(24))


def tool_markup_in_content(msg: ProviderMessage, ctx: QuirkContext) -> None:
    """Return the raw tool-call section inside content instead of structured tool_calls."""
    if not msg.tool_calls:
        return
    f = ctx.family
    markup = "".join(f"{f.tool_call_begin}{c['id']}{f.tool_argument_begin}{c['arguments']}{f.tool_call_end}"
                     for c in msg.tool_calls)
    msg.content += f"{f.tool_section_begin}{markup}{f.tool_section_end}"
    msg.tool_calls = []
    msg.finish_reason = "stop"


def drop_reasoning(msg: ProviderMessage, ctx: QuirkContext) -> None:
    msg.reasoning = None


@dataclass(frozen=True)
class ProviderProfile:
    """How one upstream provider reports a completion.

    ``counts_end_of_turn``: whether ``usage.completion_tokens`` counts the final end-of-turn id.
    ``reasoning_tokens_include_close``: ``reasoning_tokens`` also counts ``</think>``.
    ``hooks``: quirks applied, in order, to the decoded message (see the hook functions above);
    add a quirk by writing a hook and registering a profile with it.
    """

    name: str
    counts_end_of_turn: bool = True
    reasoning_tokens_include_close: bool = False
    provider_name: str = "Simulator"
    json_padding: str = JSON_PADDING
    hooks: tuple[Hook, ...] = ()

    def with_hooks(self, name: str, *hooks: Hook, **changes: Any) -> "ProviderProfile":
        return replace(self, name=name, hooks=self.hooks + hooks, **changes)


_EXACT = ProviderProfile("exact")
PROFILES: dict[str, ProviderProfile] = {
    p.name: p
    for p in [
        _EXACT,
        replace(_EXACT, name="no-eot", counts_end_of_turn=False),
        _EXACT.with_hooks("strip-whitespace", strip_leading_whitespace),
        _EXACT.with_hooks("call-ids", rewrite_tool_ids),
        _EXACT.with_hooks("markup-in-content", tool_markup_in_content),
        _EXACT.with_hooks("drop-reasoning", drop_reasoning),
    ]
}


def get_profile(profile: str | ProviderProfile) -> ProviderProfile:
    if isinstance(profile, ProviderProfile):
        return profile
    try:
        return PROFILES[profile]
    except KeyError:
        raise KeyError(f"unknown simulator provider profile {profile!r}; known: {sorted(PROFILES)}") from None


# ----------------------------------------------------------------------------------------------
# Faults


@dataclass(frozen=True)
class Fault:
    """One injected failure.

    ``kind``: ``http`` (``status`` with an OpenRouter error body, ``Retry-After: retry_after`` when
    set), ``error_in_200`` (an error object in a 200 JSON body, or an error chunk for a stream),
    ``mid_stream`` (a stream that stops with an error chunk, ``finish_reason: "error"``; a JSON
    request gets ``error_in_200``), ``hang`` (answer after ``seconds``), ``disconnect`` (close the
    connection without an answer).
    """

    kind: str
    status: int = 0
    retry_after: float | None = None
    seconds: float = 0.0
    message: str = ""

    @classmethod
    def http(cls, status: int, retry_after: float | None = None, message: str = "") -> "Fault":
        return cls("http", status, retry_after, 0.0, message)

    @classmethod
    def parse(cls, spec: "str | Fault") -> "Fault":
        """``"429"``, ``"429:2"`` (Retry-After 2 s), ``"502"``, ``"error-in-200"``, ``"mid-stream"``,
        ``"hang:5"``, ``"disconnect"``."""
        if isinstance(spec, Fault):
            return spec
        name, _, arg = str(spec).partition(":")
        if name.isdigit():
            status = int(name)
            retry = float(arg) if arg else (0.0 if status in (429, 503) else None)
            return cls.http(status, retry)
        kind = name.replace("-", "_")
        if kind not in ("error_in_200", "mid_stream", "hang", "disconnect"):
            raise ValueError(f"unknown fault {spec!r}")
        return cls(kind, seconds=float(arg) if arg else 0.0)


FaultPlan = Mapping[int, "Fault | str"] | Callable[[int, Mapping[str, Any]], "Fault | str | None"] | None

_ERROR_MESSAGES = {400: "Bad request", 401: "No auth credentials found", 402: "Insufficient credits",
                   403: "Input was flagged by moderation", 408: "Request timed out", 429: "Rate limit exceeded",
                   500: "Internal server error", 502: "Provider returned error", 503: "No available provider",
                   524: "Provider timed out", 529: "Provider overloaded"}


def error_body(code: int | str, message: str, provider: str = "Simulator") -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "metadata": {"provider_name": provider}}}


# ----------------------------------------------------------------------------------------------
# Responses


def prompt_hash(request: Mapping[str, Any]) -> str:
    """Key of :attr:`SimulatorServer.request_counts`: the prompt content (messages + tools)."""
    return sha256_hex(canonical_json({"messages": request.get("messages"), "tools": request.get("tools") or None}))[:16]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _pieces(text: str, rng: random.Random) -> Iterator[str]:
    """Split text into stream deltas of one to three words; their concatenation is the text.
    An empty text gives one empty delta (so a client still sees the field)."""
    words = re.findall(r"\s*\S+|\s+", text) or [""]
    i = 0
    while i < len(words):
        k = rng.randint(1, 3)
        yield "".join(words[i:i + k])
        i += k


@dataclass
class Generation:
    id: str
    created: int
    model: str
    completion: Completion
    message: ProviderMessage
    usage: dict[str, Any]
    provider: str
    streamed: bool
    latency_ms: float


class SimulatorServer:
    """The stand-in server; see the module docstring. Use as a context manager::

        with SimulatorServer(tok, family, seed=7) as sim:
            httpx.post(sim.base_url + "/chat/completions", json=body)

    ``price_per_mtok``: ``{"prompt": usd, "completion": usd}`` per million tokens (or a pair).
    ``faults``: ``{request_number: Fault | "429" | ...}`` (1-based, over chat-completion requests)
    or a callable ``(request_number, body) -> Fault | str | None``. Truth and stats are kept for
    the last ``max_generations`` responses. Extra keyword arguments go to :class:`CompletionModel`
    (``reasoning_tokens``, ``content_tokens``: (min, max) target lengths; ``tool_call_probability``).
    """

    def __init__(self, tokenizer: Tokenizer, family: ModelFamily, seed: int = 0,
                 profile: str | ProviderProfile = "exact", latency_ms: float = 0,
                 price_per_mtok: Mapping[str, float] | Sequence[float] | None = None,
                 faults: FaultPlan = None, host: str = "127.0.0.1", port: int = 0,
                 max_generations: int = 50_000, **model_options: Any):
        self.engine = CompletionModel(tokenizer, family, seed, **model_options)
        self.tokenizer, self.family, self.seed = tokenizer, family, seed
        self.profile = get_profile(profile)
        self.latency_ms = latency_ms
        if price_per_mtok is None:
            price_per_mtok = {"prompt": 0.6, "completion": 2.5}
        if not isinstance(price_per_mtok, Mapping):
            price_per_mtok = {"prompt": price_per_mtok[0], "completion": price_per_mtok[1]}
        self.price = {"prompt": float(price_per_mtok.get("prompt", 0)), "completion": float(price_per_mtok.get("completion", 0))}
        self.faults = faults
        self.host, self.port = host, port
        self.request_counts: Counter[str] = Counter()
        self.requests_total = 0
        self.authorizations: Counter[str] = Counter()
        self.generations: OrderedDict[str, Generation] = OrderedDict()  # newest last, bounded
        self.max_generations = max_generations
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}{API_PREFIX}"

    def start(self) -> "SimulatorServer":
        handler = type("Handler", (_Handler,), {"sim": self})
        self._httpd = _Server((self.host, self.port), handler)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"simulator:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "SimulatorServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- queries --------------------------------------------------------------------------------
    def truth(self, generation_id: str) -> dict[str, Any] | None:
        g = self.generations.get(generation_id)
        if g is None:
            return None
        return {"id": g.id, "provider": g.provider, **g.completion.to_dict()}

    def generation_stats(self, generation_id: str) -> dict[str, Any] | None:
        g = self.generations.get(generation_id)
        if g is None:
            return None
        u = g.usage
        return {"data": {
            "id": g.id, "created_at": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(g.created)),
            "model": g.model, "provider_name": g.provider, "streamed": g.streamed, "cancelled": False,
            "total_cost": u["cost"], "usage": u["cost"], "is_byok": False,
            "tokens_prompt": u["prompt_tokens"], "tokens_completion": u["completion_tokens"],
            "native_tokens_prompt": u["prompt_tokens"], "native_tokens_completion": u["completion_tokens"],
            "native_tokens_reasoning": u["completion_tokens_details"]["reasoning_tokens"],
            "finish_reason": g.message.finish_reason, "native_finish_reason": g.message.native_finish_reason,
            "latency": int(g.latency_ms), "generation_time": int(g.latency_ms),
        }}

    # -- request handling -----------------------------------------------------------------------
    def _register(self, body: Mapping[str, Any], auth: str | None) -> tuple[int, Fault | None]:
        with self._lock:
            self.requests_total += 1
            n = self.requests_total
            self.request_counts[prompt_hash(body)] += 1
            if auth:
                self.authorizations[auth] += 1
        plan = self.faults
        spec = plan(n, body) if callable(plan) else (plan or {}).get(n)
        return n, (Fault.parse(spec) if spec else None)

    def make_generation(self, body: Mapping[str, Any]) -> Generation:
        completion = self.engine.complete(body)
        profile = self.profile
        msg = decode_completion(completion.ids, self.tokenizer, self.family, completion.thinking, completion.finish_reason)
        if profile.reasoning_tokens_include_close and completion.thinking:
            close = self.tokenizer.special_id(self.family.think_close)
            msg.reasoning_tokens += int(close in completion.ids)
        if completion.stopped and not profile.counts_end_of_turn:
            msg.completion_tokens -= 1
        gen_id = f"gen-{int(time.time())}-{''.join(secrets.choice(string.ascii_letters + string.digits) for _ in range(20))}"
        ctx = QuirkContext(random.Random(gen_id), self.family, body)
        for hook in profile.hooks:
            hook(msg, ctx)
        if isinstance(body.get("reasoning"), Mapping) and body["reasoning"].get("exclude"):
            msg.reasoning = None
        pt, ct = len(completion.prompt_ids), msg.completion_tokens
        p_cost, c_cost = pt * self.price["prompt"] / 1e6, ct * self.price["completion"] / 1e6
        usage = {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct,
                 "cost": round(p_cost + c_cost, 12), "is_byok": False,
                 "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                 "cost_details": {"upstream_inference_cost": None, "upstream_inference_prompt_cost": round(p_cost, 12),
                                  "upstream_inference_completions_cost": round(c_cost, 12)},
                 "completion_tokens_details": {"reasoning_tokens": msg.reasoning_tokens, "image_tokens": 0}}
        g = Generation(gen_id, int(time.time()), str(body.get("model")), completion, msg, usage,
                       profile.provider_name, bool(body.get("stream")), self.latency_ms)
        with self._lock:
            self.generations[gen_id] = g
            while len(self.generations) > self.max_generations:
                self.generations.popitem(last=False)
        return g

    def json_body(self, g: Generation) -> str:
        m = g.message
        message: dict[str, Any] = {"role": "assistant", "content": m.content, "refusal": None, "reasoning": m.reasoning}
        if m.reasoning is not None:
            message["reasoning_details"] = [{"type": "reasoning.text", "text": m.reasoning, "format": "unknown", "index": 0}]
        if m.tool_calls:
            message["tool_calls"] = [{"index": i, "id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for i, c in enumerate(m.tool_calls)]
        body = {"id": g.id, "provider": g.provider, "model": g.model, "object": "chat.completion", "created": g.created,
                "choices": [{"logprobs": None, "finish_reason": m.finish_reason,
                             "native_finish_reason": m.native_finish_reason, "index": 0, "message": message}],
                "system_fingerprint": None, "usage": g.usage}
        return self.profile.json_padding + _dumps(body)

    def sse_events(self, g: Generation, fail_midway: bool = False) -> Iterator[str]:
        """The stream's ``data:`` payloads (without the ``data: `` prefix), ``[DONE]`` last."""
        m = g.message
        rng = random.Random(g.id)
        head = {"id": g.id, "provider": g.provider, "model": g.model, "object": "chat.completion.chunk", "created": g.created}

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
            return _dumps({**head, "choices": [{"index": 0, "delta": {"role": "assistant", **delta},
                                                "finish_reason": finish, "native_finish_reason": finish,
                                                "logprobs": None}], "system_fingerprint": None, **extra})

        deltas: list[str] = []
        for piece in _pieces(m.reasoning, rng) if m.reasoning is not None else ():
            deltas.append(chunk({"content": "", "reasoning": piece, "reasoning_details": [
                {"type": "reasoning.text", "text": piece, "format": "unknown", "index": 0}]}))
        for piece in _pieces(m.content, rng) if m.content else ():
            deltas.append(chunk({"content": piece}))
        for i, c in enumerate(m.tool_calls):
            call = {"index": i, "id": c["id"], "type": "function"}
            deltas.append(chunk({"content": None, "tool_calls": [{**call, "function": {"name": c["name"], "arguments": ""}}]}))
            for piece in _pieces(c["arguments"], rng):
                deltas.append(chunk({"content": None, "tool_calls": [{**call, "function": {"name": "", "arguments": piece}}]}))
        if fail_midway:
            yield from deltas[: len(deltas) // 2]
            yield _dumps({**head, "error": {"code": 502, "message": "Upstream provider disconnected mid-stream"},
                          "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error",
                                       "native_finish_reason": "error"}]})
            return
        yield from deltas
        yield chunk({"content": ""}, m.finish_reason)
        yield chunk({"content": ""}, None, usage=g.usage)
        yield "[DONE]"


class _Handler(BaseHTTPRequestHandler):
    sim: SimulatorServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # small writes (headers, SSE chunks) must not wait for delayed ACKs
    server_version = "eagledata-simulator/1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    # -- plumbing -------------------------------------------------------------------------------
    def _send(self, status: int, text: str, content_type: str = "application/json",
              headers: Mapping[str, str] | None = None) -> None:
        data = text.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        self._send(status, _dumps(error_body(status, message, self.sim.profile.provider_name)), headers=headers)

    def _chunk(self, text: str) -> None:
        data = text.encode("utf-8")
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    # -- routes ---------------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        url = urlparse(self.path)
        gid = (parse_qs(url.query).get("id") or [""])[0]
        if url.path == f"{API_PREFIX}/generation":
            stats = self.sim.generation_stats(gid)
            return self._send(200, _dumps(stats)) if stats else self._error(404, f"Generation {gid} not found")
        if url.path == "/_sim/truth":
            truth = self.sim.truth(gid)
            return self._send(200, _dumps(truth)) if truth else self._error(404, f"Generation {gid} not found")
        self._error(404, f"no route {url.path}")

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        sim = self.sim
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if urlparse(self.path).path != f"{API_PREFIX}/chat/completions":
            return self._error(404, f"no route {self.path}")
        try:
            body = json.loads(raw.decode("utf-8"))
            if not isinstance(body, dict):
                raise ValueError("body is not a JSON object")
        except (ValueError, UnicodeDecodeError) as exc:
            return self._error(400, f"invalid JSON body: {exc}")
        _, fault = sim._register(body, self.headers.get("Authorization"))
        if fault is not None:
            if fault.kind == "hang":
                time.sleep(fault.seconds or 3600)
            elif fault.kind == "disconnect":
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            elif fault.kind == "http":
                headers = {"Retry-After": f"{fault.retry_after:g}"} if fault.retry_after is not None else None
                return self._error(fault.status, fault.message or _ERROR_MESSAGES.get(fault.status, "Error"), headers)
        if not body.get("model"):
            return self._error(400, "model is required")
        try:
            g = sim.make_generation(body)
        except (RequestError, ChatTemplateError) as exc:
            return self._error(400, str(exc))
        stream = bool(body.get("stream"))
        failing = fault is not None and fault.kind in ("error_in_200", "mid_stream")
        if not stream:
            if sim.latency_ms:
                time.sleep(sim.latency_ms / 1000)
            if failing:
                err = error_body(502, fault.message or "Provider returned error", g.provider)
                return self._send(200, sim.profile.json_padding + _dumps(err))
            return self._send(200, sim.json_body(g))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._chunk(PROCESSING_COMMENT + "\n\n")
        if sim.latency_ms:
            time.sleep(sim.latency_ms / 1000)
        for event in sim.sse_events(g, fail_midway=failing):
            self._chunk(f"data: {event}\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


# ----------------------------------------------------------------------------------------------
# CLI


def main(argv: Sequence[str] | None = None) -> int:
    from .families import get_family
    from .tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m eagledata.simulator", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="tokenizer directory (tiktoken or HF)")
    ap.add_argument("--family", required=True, help="model family, e.g. kimi-k2.5")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: an ephemeral port")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="exact", choices=sorted(PROFILES))
    ap.add_argument("--latency-ms", type=float, default=0)
    ap.add_argument("--price", type=float, nargs=2, metavar=("PROMPT", "COMPLETION"), default=(0.6, 2.5),
                    help="USD per million tokens")
    ap.add_argument("--fault", action="append", default=[], metavar="N=KIND",
                    help="inject a fault into request N, e.g. 3=429, 4=502, 5=error-in-200, 6=mid-stream")
    args = ap.parse_args(argv)
    faults = {}
    for spec in args.fault:
        n, _, kind = spec.partition("=")
        faults[int(n)] = Fault.parse(kind)
    family = get_family(args.family)
    tok = load_tokenizer(args.tokenizer, family)
    server = SimulatorServer(tok, family, seed=args.seed, profile=args.profile, latency_ms=args.latency_ms,
                             price_per_mtok=tuple(args.price), faults=faults, host=args.host, port=args.port).start()
    print(f"simulator ({args.profile}, {family.name}) listening: {server.base_url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

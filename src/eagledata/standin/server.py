"""A local stand-in for OpenRouter's chat-completions API (and for a local SGLang server), with ground truth.

:class:`SimulatorServer` is a real HTTP server on loopback (asyncio, on a background thread) speaking

* ``POST /api/v1/chat/completions``: JSON bodies (headers with ``X-Generation-Id`` and OpenRouter's
  leading whitespace padding first, the body after the latency) and SSE streams (``: OPENROUTER
  PROCESSING`` comments, ``data: {chunk}`` lines shaped like the recorded traffic, ``data: [DONE]``);
* ``GET /api/v1/generation?id=``: OpenRouter's generation stats (native token counts, cost);
* ``GET /api/v1/key``: the key's usage (everything the stand-in billed);
* ``GET /_sim/truth?id=``: the ground truth, i.e. the exact completion token ids and their segments;
* ``GET /_sim/counters``: what the stand-in was asked and billed (``requests_total``,
  ``requests_per_prompt`` keyed by :func:`prompt_hash`, ``billed_usd``, ...; see
  :meth:`SimulatorServer.counters`), so a test or a user outside its process can prove "each prompt
  paid once";
* with ``api="sglang"``: SGLang's ``POST /v1/chat/completions`` (``return_token_ids``) and native
  ``POST /generate`` (``input_ids`` -> ``output_ids``, ``meta_info``) instead of the OpenRouter routes.

Every completion is made as TOKEN IDS FIRST (:class:`CompletionModel`): reasoning text (random
sentence spans of the bundled corpus), the family's think tokens, content text, an optional tool-call
section with native ids ``functions.NAME:IDX`` (IDX counts calls across the whole conversation) and
schema-conforming JSON arguments, then the end-of-turn id; ``max_tokens`` truncates the ids (finish
``length``, no end of turn). Text segments are ``encode_plain`` of chosen text; special ids are looked
up by name. A :class:`ProviderProfile` may change the ids themselves (quirks of the served model: a
non-canonical BPE split, a provider-side length cap), then the response fields are DECODED from the
ids, as a serving stack does, and the profile's response quirks (small hook functions) apply on top.
Without completion hooks the completion is a pure function of (server seed, request content):
:func:`CompletionModel.complete` recomputes the truth of any recorded simulator request offline
(with them, ask ``/_sim/truth``).

Faults (HTTP errors with ``Retry-After``, errors inside 200 bodies, mid-stream error chunks, hangs,
dropped and reset connections, malformed bodies) are injected per request number or by a callable;
see :class:`Fault`. Cost accounting: every generation is billed at ``price_per_mtok``
(``billed_usd``); errors inside 200 bodies are not billed, streams cut mid-way half.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import socket
import string
import struct
import sys
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence
from urllib.parse import parse_qs, urlparse

from eagledata.text.chat import ChatTemplateError, prompt_ids, request_thinking
from eagledata.eventloop import new_event_loop
from eagledata.text.families import ModelFamily
from eagledata.generate.prompts import canonical_json, sha256_hex
from eagledata.tokens.reconstruct import Segment, count_tool_calls
from eagledata.text.tokenizer import Tokenizer

API_PREFIX = "/api/v1"
_ID_RNG = random.Random()  # generation ids: unique, not secret
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
    kinds as :mod:`eagledata.tokens.reconstruct`)."""

    ids: list[int]
    segments: list[Segment]
    thinking: bool
    stopped: bool  # ends with the end-of-turn id
    finish_reason: str  # stop | tool_calls | length
    prompt_ids: list[int]
    quirks: list[str] = field(default_factory=list)  # what a profile changed in the ids themselves

    def to_dict(self) -> dict[str, Any]:
        return {"ids": self.ids, "segments": [s.to_dict() for s in self.segments], "thinking": self.thinking,
                "stopped": self.stopped, "finish_reason": self.finish_reason,
                "prompt_ids": self.prompt_ids, "prompt_tokens": len(self.prompt_ids),
                "completion_tokens": len(self.ids), "quirks": self.quirks}


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
        rmax = (request.get("reasoning") or {}).get("max_tokens")
        calls = lambda: self._choose_calls(request, tools, rng)  # noqa: E731 - drawn in order, after the reasoning
        return self._complete(p_ids, thinking, rng, max_tokens, calls, count_tool_calls(messages),
                              rmax if isinstance(rmax, int) and rmax > 0 else None)

    def complete_ids(self, input_ids: Sequence[int], max_tokens: int | None, sampling: Mapping[str, Any] | None = None) -> Completion:
        """The completion for a native prompt given as token ids (SGLang ``/generate``): thinking
        when the prompt ends with the family's think-open token (K2.5) or the family always thinks;
        no tool calls (the tool declarations are not known from ids)."""
        if not input_ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in input_ids):
            raise RequestError("input_ids must be a non-empty list of integers")
        f = self.family
        if f.think_in_prompt:
            thinking = f.thinking and input_ids[-1] == self.tok.special_id(f.think_open)
        else:
            thinking = f.thinking
        key = sha256_hex(canonical_json({"server_seed": self.seed, "input_ids": list(input_ids),
                                         "sampling": {k: (sampling or {}).get(k) for k in ("temperature", "top_p", "sampling_seed", "seed")}}))
        rng = random.Random(int(key[:16], 16))
        return self._complete(list(input_ids), thinking, rng, max_tokens or DEFAULT_MAX_TOKENS, lambda: [], 0, None)

    def _complete(self, p_ids: list[int], thinking: bool, rng: random.Random, max_tokens: int,
                  choose_calls: Callable[[], list[tuple[str, str]]], call_offset: int, reasoning_max: int | None) -> Completion:
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
            if reasoning_max is not None:
                target = min(target, reasoning_max)
            if not f.think_in_prompt:
                special("think_open", f.think_open)
            text("reasoning", self._text(rng, target))
            special("think_close", f.think_close)

        calls = choose_calls()
        content = self._text(rng, rng.randint(*self.content_tokens))
        if rng.random() < 0.15:  # models write special-token text inside code; it stays plain text
            content += f" For example `{f.end_of_turn}` marks the end of a turn."
        if thinking and rng.random() < 0.3:
            content = "\n\n" + content
        if calls and rng.random() < 0.3:
            content = ""
        text("content", content)
        if calls:
            special("tool_section_begin", f.tool_section_begin)
            for n, (name, args) in enumerate(calls):
                special("tool_call_begin", f.tool_call_begin, n)
                text("tool_id", f.native_tool_call_id(name, call_offset + n), n)
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
    tokenizer: Tokenizer | None = None


Hook = Callable[[ProviderMessage, QuirkContext], None]
#: A quirk of the provider's MODEL (its ids themselves), applied to the truth before decoding.
CompletionHook = Callable[[Completion, QuirkContext], Completion]


def strip_leading_whitespace(msg: ProviderMessage, ctx: QuirkContext) -> None:
    msg.content = msg.content.lstrip()
    if msg.reasoning is not None:
        msg.reasoning = msg.reasoning.lstrip()


def rewrite_tool_ids(msg: ProviderMessage, ctx: QuirkContext) -> None:
    """Replace native ids with provider ids (``call_...``), as several providers do."""
    alphabet = string.ascii_letters + string.digits
    for call in msg.tool_calls:
        call["id"] = "call_" + "".join(ctx.rng.choice(alphabet) for _ in range(24))


def index_tool_ids(msg: ProviderMessage, ctx: QuirkContext) -> None:
    """Tool-call ids replaced by the call's position in the response (``0``, ``1``)."""
    for i, call in enumerate(msg.tool_calls):
        call["id"] = str(i)


def name_index_tool_ids(msg: ProviderMessage, ctx: QuirkContext) -> None:
    """Tool-call ids as ``NAME:i`` (``weather:0``), without the ``functions.`` prefix."""
    for i, call in enumerate(msg.tool_calls):
        call["id"] = f"{call['name']}:{i}"


def _tool_markup(msg: ProviderMessage, f: ModelFamily) -> str:
    calls = "".join(f"{f.tool_call_begin}{c['id']}{f.tool_argument_begin}{c['arguments']}{f.tool_call_end}"
                    for c in msg.tool_calls)
    return f"{f.tool_section_begin}{calls}{f.tool_section_end}"


def tool_markup_in_content(msg: ProviderMessage, ctx: QuirkContext) -> None:
    """Return the raw tool-call section inside content instead of structured tool_calls."""
    if not msg.tool_calls:
        return
    msg.content += _tool_markup(msg, ctx.family)
    msg.tool_calls = []
    msg.finish_reason = "stop"


def tool_markup_in_reasoning(msg: ProviderMessage, ctx: QuirkContext) -> None:
    """The tool-call section ends up at the end of the reasoning (a parser that never saw the
    think block close), no structured tool_calls."""
    if not msg.tool_calls or msg.reasoning is None:
        return
    msg.reasoning += _tool_markup(msg, ctx.family)
    msg.tool_calls = []
    msg.finish_reason = "stop"


def drop_reasoning(msg: ProviderMessage, ctx: QuirkContext) -> None:
    msg.reasoning = None


def json_tool_declaration(c: Completion, ctx: QuirkContext) -> Completion:
    """The provider renders the prompt with the tools declared as JSON (the chat template's fallback)
    instead of the model's own declaration: the model saw, and the provider bills, that prompt."""
    tools = ctx.request.get("tools")
    if not tools or ctx.tokenizer is None:
        return c
    ids = prompt_ids(ctx.tokenizer, ctx.request["messages"], tools, thinking=request_thinking(ctx.request),
                     tool_declaration="json")
    return replace(c, prompt_ids=ids, quirks=c.quirks + ["prompt:json_tools"])


def template_variant_minus_one(c: Completion, ctx: QuirkContext) -> Completion:
    """The provider's chat template renders one token fewer on every prompt (here: without the
    first token), with and without tools."""
    return replace(c, prompt_ids=c.prompt_ids[1:], quirks=c.quirks + ["prompt:-1"])


def noncanonical_split(c: Completion, ctx: QuirkContext) -> Completion:
    """The provider's model emitted a NON-CANONICAL BPE split of one word: one token of a content
    (else reasoning) segment is replaced by two tokens whose text is the same. The text is
    identical, the ids differ, and the billed count is one more than a canonical re-encoding
    gives. Recorded in ``Completion.quirks`` as ``noncanonical@POS``."""
    tok = ctx.tokenizer
    if tok is None:
        return c
    candidates: list[tuple[int, list[int]]] = []
    for kind in ("content", "reasoning", "tool_arguments"):
        for seg in (s for s in c.segments if s.kind == kind and s.text):
            for pos in range(seg.start, seg.end):
                piece = tok.decode([c.ids[pos]])
                if len(piece) < 3 or "\ufffd" in piece:
                    continue
                for cut in range(1, len(piece)):
                    a, b = tok.encode_plain(piece[:cut]), tok.encode_plain(piece[cut:])
                    if len(a) == 1 and len(b) == 1 and tok.decode(a + b) == piece:
                        candidates.append((pos, a + b))
                        break
                if len(candidates) >= 8:
                    break
            if len(candidates) >= 8:
                break
        if candidates:
            break
    if not candidates:
        return c
    pos, pair = ctx.rng.choice(candidates)
    ids = c.ids[:pos] + pair + c.ids[pos + 1:]
    segments = [Segment(s.kind, s.start + (s.start > pos), s.end + (s.end > pos), s.text, s.call) for s in c.segments]
    return replace(c, ids=ids, segments=segments, quirks=c.quirks + [f"noncanonical@{pos}"])


def provider_length_cap(c: Completion, ctx: QuirkContext) -> Completion:
    """The provider stops the model at its own output cap (half the completion here): finish
    ``length``, no end of turn, possibly inside the reasoning (then the content is empty)."""
    if len(c.ids) < 4:
        return c
    n = max(1, len(c.ids) // 2)
    kept = [s if s.end <= n else Segment(s.kind, s.start, n, ctx.tokenizer.decode(c.ids[s.start:n]) if s.text is not None and ctx.tokenizer else s.text, s.call)
            for s in c.segments if s.start < n]
    return replace(c, ids=c.ids[:n], segments=kept, stopped=False, finish_reason="length", quirks=c.quirks + [f"cap@{n}"])


@dataclass(frozen=True)
class ProviderProfile:
    """How one upstream provider reports a completion.

    ``counts_end_of_turn``: whether ``usage.completion_tokens`` counts the final end-of-turn id.
    ``reasoning_tokens_include_close``: ``reasoning_tokens`` also counts ``</think>``.
    ``reasoning_count_noise``: ``(low, high)``: the reported ``reasoning_tokens`` is off by a
    nonzero amount in that range (never 0 or +1), drawn per request: a count that is not a checksum
    (the completion total stays exact).
    ``completion_hooks``: quirks of the served MODEL, applied to the token ids (the truth) before
    they are decoded; ``hooks``: quirks of the provider's response building, applied in order to
    the decoded message. Add a quirk by writing a hook and registering a profile with it.
    """

    name: str
    counts_end_of_turn: bool = True
    reasoning_tokens_include_close: bool = False
    reasoning_count_noise: tuple[int, int] | None = None
    provider_name: str = "Simulator"
    json_padding: str = JSON_PADDING
    hooks: tuple[Hook, ...] = ()
    completion_hooks: tuple[CompletionHook, ...] = ()

    def with_hooks(self, name: str, *hooks: Hook, **changes: Any) -> "ProviderProfile":
        return replace(self, name=name, hooks=self.hooks + hooks, **changes)


_EXACT = ProviderProfile("exact")
PROFILES: dict[str, ProviderProfile] = {
    p.name: p
    for p in [
        _EXACT,
        replace(_EXACT, name="no-eot", counts_end_of_turn=False),
        replace(_EXACT, name="reasoning-counts-close", reasoning_tokens_include_close=True),
        _EXACT.with_hooks("strip-whitespace", strip_leading_whitespace),
        _EXACT.with_hooks("call-ids", rewrite_tool_ids),
        _EXACT.with_hooks("call-ids-index", index_tool_ids),
        _EXACT.with_hooks("call-ids-name", name_index_tool_ids),
        _EXACT.with_hooks("markup-in-content", tool_markup_in_content),
        _EXACT.with_hooks("markup-in-reasoning", tool_markup_in_reasoning),
        _EXACT.with_hooks("drop-reasoning", drop_reasoning),
        replace(_EXACT, name="truncating", completion_hooks=(provider_length_cap,)),
        replace(_EXACT, name="noncanonical", completion_hooks=(noncanonical_split,)),
        _EXACT.with_hooks("no-eot-call-ids", rewrite_tool_ids, counts_end_of_turn=False),
        replace(_EXACT, name="json-tools", completion_hooks=(json_tool_declaration,)),
        replace(_EXACT, name="template-minus-one", completion_hooks=(template_variant_minus_one,)),
        replace(_EXACT, name="unreliable-reasoning", reasoning_count_noise=(-6, 9)),
        _EXACT.with_hooks("unreliable-reasoning-strip", strip_leading_whitespace, reasoning_count_noise=(-6, 9)),
    ]
}


def _count_noise(bounds: tuple[int, int], key: str) -> int:
    """A nonzero offset in ``bounds`` other than +1 (an agreeing count), fixed per ``key``."""
    choices = [d for d in range(bounds[0], bounds[1] + 1) if d not in (0, 1)]
    return random.Random(key).choice(choices)


def get_profile(profile: str | ProviderProfile) -> ProviderProfile:
    if isinstance(profile, ProviderProfile):
        return profile
    try:
        return PROFILES[profile]
    except KeyError:
        raise KeyError(f"unknown simulator provider profile {profile!r}; known: {sorted(PROFILES)}") from None


# ----------------------------------------------------------------------------------------------
# Faults


FAULT_KINDS = ("error_in_200", "mid_stream", "hang", "disconnect", "reset", "malformed")


@dataclass(frozen=True)
class Fault:
    """One injected failure.

    ``kind``: ``http`` (``status`` with an OpenRouter error body, ``Retry-After: retry_after`` when
    set), ``error_in_200`` (an error object in a 200 JSON body, or an error chunk for a stream),
    ``mid_stream`` (a stream that stops with an error chunk, ``finish_reason: "error"``; a JSON
    request gets ``error_in_200``), ``hang`` (answer after ``seconds``: a client timeout),
    ``disconnect`` (close the connection without an answer), ``reset`` (abort it with a TCP RST),
    ``malformed`` (a 200 whose JSON body, or one stream chunk, is cut short).
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
        """``"429"``, ``"429:2"`` (Retry-After 2 s), ``"502"``, ``"503"``, ``"error-in-200"``,
        ``"mid-stream"``, ``"hang:5"``, ``"disconnect"``, ``"reset"``, ``"malformed"``."""
        if isinstance(spec, Fault):
            return spec
        name, _, arg = str(spec).partition(":")
        if name.isdigit():
            status = int(name)
            retry = float(arg) if arg else (0.0 if status in (429, 503) else None)
            return cls.http(status, retry)
        kind = name.replace("-", "_")
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {spec!r}; known: HTTP status codes, {', '.join(FAULT_KINDS)}")
        return cls(kind, seconds=float(arg) if arg else 0.0)


FaultPlan = Mapping[int, "Fault | str"] | Callable[[int, Mapping[str, Any]], "Fault | str | None"] | None

_ERROR_MESSAGES = {400: "Bad request", 401: "No auth credentials found", 402: "Insufficient credits",
                   403: "Input was flagged by moderation", 408: "Request timed out", 429: "Rate limit exceeded",
                   500: "Internal server error", 502: "Provider returned error", 503: "No available provider",
                   524: "Provider timed out", 529: "Provider overloaded"}
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 402: "Payment Required", 403: "Forbidden",
            404: "Not Found", 408: "Request Timeout", 429: "Too Many Requests", 500: "Internal Server Error",
            502: "Bad Gateway", 503: "Service Unavailable", 524: "A Timeout Occurred", 529: "Site Overloaded"}


def error_body(code: int | str, message: str, provider: str = "Simulator") -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "metadata": {"provider_name": provider}}}


def sglang_error_body(code: int, message: str) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": "BadRequestError" if code < 500 else "InternalServerError",
            "param": None, "code": code}


# ----------------------------------------------------------------------------------------------
# Responses


def prompt_hash(request: Mapping[str, Any]) -> str:
    """Key of :attr:`SimulatorServer.request_counts`: the prompt content (messages + tools; the
    prompt ids for a native SGLang request)."""
    if "messages" not in request and "input_ids" in request:
        return sha256_hex(canonical_json({"input_ids": request.get("input_ids")}))[:16]
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
    billed: float = 0.0  # what the stand-in charged for it (0 for errors in 200 bodies)
    base: "_Base | None" = None


@dataclass
class _Base:
    completion: Completion
    message: ProviderMessage  # decoded, counts adjusted, before response quirks
    usage: dict[str, Any]
    shared: bool  # no response quirk applies: every answer carries ``message`` unchanged
    prompt_hash: str
    choices_json: str | None = None
    usage_json: str | None = None


class _Memo(OrderedDict):
    """A small LRU of completions (they are pure functions of the request)."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_or(self, key: Any, make: Callable[[], Any]) -> Any:
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = make()
        self[key] = value
        if len(self) > self.size:
            self.popitem(last=False)
        return value


class SimulatorServer:
    """The stand-in server; see the module docstring. Use as a context manager::

        with SimulatorServer(tok, family, seed=7) as sim:
            httpx.post(sim.base_url + "/chat/completions", json=body)

    ``api``: ``openrouter`` (``/api/v1/chat/completions``, ``/api/v1/generation``, ``/api/v1/key``)
    or ``sglang`` (SGLang's ``/v1/chat/completions`` with ``return_token_ids`` and its native
    ``/generate``; see :meth:`sglang_chat_body` and :meth:`sglang_generate_body`);
    ``sglang_trim_stop``: the SGLang stand-in leaves the matched stop id out of the returned ids (as
    some SGLang versions do). ``price_per_mtok``: ``{"prompt": usd, "completion": usd}`` per million
    tokens (or a pair). ``faults``: ``{request_number: Fault | "429" | ...}`` (1-based, over
    completion requests) or a callable ``(request_number, body) -> Fault | str | None``.
    ``latency_ms`` (+ up to ``latency_jitter_ms``) is spent before the answer's body, after its
    headers (with ``X-Generation-Id``) and OpenRouter's keep-alive padding. Truth and stats are kept
    for the last ``max_generations`` responses. Extra keyword arguments go to
    :class:`CompletionModel` (``reasoning_tokens``, ``content_tokens``: (min, max) target lengths;
    ``tool_call_probability``).

    Counters: ``requests_total``, ``request_counts`` (per :func:`prompt_hash`), ``authorizations``
    (per Authorization header), ``billed_usd`` (total charged: the key's usage), ``in_flight`` and
    ``max_in_flight`` (requests being answered).
    The server runs an asyncio loop on a background thread.
    """

    def __init__(self, tokenizer: Tokenizer, family: ModelFamily, seed: int = 0,
                 profile: str | ProviderProfile = "exact", latency_ms: float = 0,
                 price_per_mtok: Mapping[str, float] | Sequence[float] | None = None,
                 faults: FaultPlan = None, host: str = "127.0.0.1", port: int = 0,
                 max_generations: int = 50_000, api: str = "openrouter", sglang_trim_stop: bool = False,
                 latency_jitter_ms: float = 0, **model_options: Any):
        if api not in ("openrouter", "sglang"):
            raise ValueError(f"api must be 'openrouter' or 'sglang', got {api!r}")
        self.engine = CompletionModel(tokenizer, family, seed, **model_options)
        self.tokenizer, self.family, self.seed = tokenizer, family, seed
        self.profile = get_profile(profile)
        self.latency_ms, self.latency_jitter_ms = latency_ms, latency_jitter_ms
        self.api, self.sglang_trim_stop = api, sglang_trim_stop
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
        self.billed_usd = 0.0
        self.in_flight = 0
        self.max_in_flight = 0
        self.generations: OrderedDict[str, Generation] = OrderedDict()  # newest last, bounded
        self.max_generations = max_generations
        self._memo = _Memo(4096)
        self._raw_memo = _Memo(4096)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[_Connection] = set()

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """OpenRouter mode: ``.../api/v1``; SGLang mode: ``.../v1`` (OpenAI-compatible base)."""
        return self.root_url + (API_PREFIX if self.api == "openrouter" else "/v1")

    def start(self) -> "SimulatorServer":
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = new_event_loop()  # uvloop when installed: less CPU, latency closer to the configured one
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    loop.create_server(lambda: _Connection(self), self.host, self.port, backlog=1024))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # noqa: BLE001 - reported to start()
                errors.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name=f"simulator:{self.port}", daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            raise errors[0]
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for c in list(self._connections):
                if c.transport is not None:
                    c.transport.abort()
            for t in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                t.cancel()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=5)
        except Exception:  # noqa: BLE001 - already stopping
            pass
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=5)
        self._thread = None
        self._loop = None
        self._server = None

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
            "total_cost": g.billed, "usage": g.billed, "is_byok": False,
            "tokens_prompt": u["prompt_tokens"], "tokens_completion": u["completion_tokens"],
            "native_tokens_prompt": u["prompt_tokens"], "native_tokens_completion": u["completion_tokens"],
            "native_tokens_reasoning": u["completion_tokens_details"]["reasoning_tokens"],
            "finish_reason": g.message.finish_reason, "native_finish_reason": g.message.native_finish_reason,
            "latency": int(g.latency_ms), "generation_time": int(g.latency_ms),
        }}

    def counters(self) -> dict[str, Any]:
        """One consistent snapshot of the counters (``GET /_sim/counters``): ``requests_total``
        (completion requests received, faults included), ``requests_per_prompt`` (:func:`prompt_hash`
        -> requests), ``billed_usd`` (total charged, = the key's usage), ``generations`` (answers
        made), ``in_flight``/``max_in_flight``, ``keys`` (distinct Authorization headers; the keys
        themselves are never shown)."""
        with self._lock:
            return {"requests_total": self.requests_total, "requests_per_prompt": dict(self.request_counts),
                    "billed_usd": round(self.billed_usd, 12), "generations": len(self.generations),
                    "in_flight": self.in_flight, "max_in_flight": self.max_in_flight, "keys": len(self.authorizations)}

    def key_info(self) -> dict[str, Any]:
        return {"data": {"label": "sk-or-v1-sim...", "usage": round(self.billed_usd, 12), "limit": None,
                         "limit_remaining": None, "is_free_tier": False, "is_provisioning_key": False}}

    # -- request handling -----------------------------------------------------------------------
    def _register(self, body: Mapping[str, Any], auth: str | None, phash: str | None = None) -> tuple[int, Fault | None]:
        with self._lock:
            self.requests_total += 1
            n = self.requests_total
            self.request_counts[phash or prompt_hash(body)] += 1
            if auth:
                self.authorizations[auth] += 1
        plan = self.faults
        spec = plan(n, body) if callable(plan) else (plan or {}).get(n)
        return n, (Fault.parse(spec) if spec else None)

    def truth_of(self, body: Mapping[str, Any]) -> Completion:
        """The ground truth for a request body as this server answers it (the profile's model
        quirks applied): what ``/_sim/truth`` reports for any answer to ``body``."""
        return self._truth_for(body)

    def _truth_for(self, body: Mapping[str, Any]) -> Completion:
        """The completion (with the profile's model quirks), memoised by request content."""
        native = "messages" not in body and "input_ids" in body
        if native:
            sp = body.get("sampling_params") or {}
            key = ("ids", canonical_json(body.get("input_ids")), canonical_json(sp))
            make = lambda: self.engine.complete_ids(body["input_ids"], sp.get("max_new_tokens"), sp)  # noqa: E731
        else:
            key = ("chat", generation_key(body, self.seed), request_max_tokens(body))
            make = lambda: self.engine.complete(body)  # noqa: E731

        def build() -> Completion:
            c = make()
            gk = key[1] if not native else sha256_hex(key[1] + key[2])
            ctx = QuirkContext(random.Random(gk), self.family, body, self.tokenizer)
            for hook in self.profile.completion_hooks:
                c = hook(c, ctx)
            return c

        return self._memo.get_or(key, build)

    def _base(self, body: Mapping[str, Any]) -> "_Base":
        """What every answer to this request shares: the truth, the decoded message before the
        response quirks, the usage, and (when no quirk depends on the generation) the serialised
        choices of a JSON answer."""
        completion = self._truth_for(body)
        profile = self.profile
        msg = decode_completion(completion.ids, self.tokenizer, self.family, completion.thinking, completion.finish_reason)
        if profile.reasoning_tokens_include_close and completion.thinking:
            close = self.tokenizer.special_id(self.family.think_close)
            msg.reasoning_tokens += int(close in completion.ids)
        if completion.stopped and not profile.counts_end_of_turn:
            msg.completion_tokens -= 1
        if profile.reasoning_count_noise and msg.reasoning_tokens:
            msg.reasoning_tokens = max(0, msg.reasoning_tokens + _count_noise(profile.reasoning_count_noise, prompt_hash(body)))
        pt, ct = len(completion.prompt_ids), msg.completion_tokens
        p_cost, c_cost = pt * self.price["prompt"] / 1e6, ct * self.price["completion"] / 1e6
        usage = {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct,
                 "cost": round(p_cost + c_cost, 12), "is_byok": False,
                 "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                 "cost_details": {"upstream_inference_cost": None, "upstream_inference_prompt_cost": round(p_cost, 12),
                                  "upstream_inference_completions_cost": round(c_cost, 12)},
                 "completion_tokens_details": {"reasoning_tokens": msg.reasoning_tokens, "image_tokens": 0}}
        shared = not profile.hooks and not (isinstance(body.get("reasoning"), Mapping) and body["reasoning"].get("exclude"))
        return _Base(completion, msg, usage, shared, prompt_hash(body))

    def make_generation(self, body: Mapping[str, Any], raw: bytes | None = None) -> Generation:
        """A new generation (id, truth, message, usage) for ``body``; ``raw`` (the exact request
        bytes) memoises the shared part."""
        base = self._raw_memo.get_or(raw, lambda: self._base(body)) if raw is not None else self._base(body)
        gen_id = f"gen-{int(time.time())}-{_ID_RNG.getrandbits(80):020x}"
        if base.shared:
            msg = base.message
        else:
            msg = replace(base.message, tool_calls=[dict(c) for c in base.message.tool_calls])
            ctx = QuirkContext(random.Random(gen_id), self.family, body, self.tokenizer)
            for hook in self.profile.hooks:
                hook(msg, ctx)
            if isinstance(body.get("reasoning"), Mapping) and body["reasoning"].get("exclude"):
                msg.reasoning = None
        g = Generation(gen_id, int(time.time()), str(body.get("model")), base.completion, msg, base.usage,
                       self.profile.provider_name, bool(body.get("stream")), self.latency_ms, base=base)
        with self._lock:
            self.generations[gen_id] = g
            while len(self.generations) > self.max_generations:
                self.generations.popitem(last=False)
        return g

    def _bill(self, g: Generation, fraction: float = 1.0) -> None:
        with self._lock:
            g.billed = round(g.usage["cost"] * fraction, 12)
            self.billed_usd += g.billed

    def _choices_json(self, g: Generation) -> str:
        m = g.message
        message: dict[str, Any] = {"role": "assistant", "content": m.content, "refusal": None, "reasoning": m.reasoning}
        if m.reasoning is not None:
            message["reasoning_details"] = [{"type": "reasoning.text", "text": m.reasoning, "format": "unknown", "index": 0}]
        if m.tool_calls:
            message["tool_calls"] = [{"index": i, "id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for i, c in enumerate(m.tool_calls)]
        return _dumps([{"logprobs": None, "finish_reason": m.finish_reason, "native_finish_reason": m.native_finish_reason,
                        "index": 0, "message": message}])

    def json_body(self, g: Generation) -> str:
        b = g.base
        if b is not None and b.shared:
            if b.choices_json is None:
                b.choices_json, b.usage_json = self._choices_json(g), _dumps(g.usage)
            choices, usage = b.choices_json, b.usage_json
        else:
            choices, usage = self._choices_json(g), _dumps(g.usage)
        return (f'{self.profile.json_padding}{{"id":{_dumps(g.id)},"provider":{_dumps(g.provider)},"model":{_dumps(g.model)},'
                f'"object":"chat.completion","created":{g.created},"choices":{choices},"system_fingerprint":null,'
                f'"usage":{usage}}}')

    def sse_events(self, g: Generation, fail_midway: bool = False, malformed: bool = False) -> Iterator[str]:
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
        if malformed and deltas:
            k = len(deltas) // 2
            deltas[k] = deltas[k][: len(deltas[k]) // 2]
        yield from deltas
        yield chunk({"content": ""}, m.finish_reason)
        yield chunk({"content": ""}, None, usage=g.usage)
        yield "[DONE]"

    # -- SGLang shapes --------------------------------------------------------------------------
    def _sglang_ids(self, g: Generation) -> tuple[list[int], int | None]:
        """The returned output ids and the matched stop id (the end of turn when the model stopped)."""
        ids = list(g.completion.ids)
        matched = ids[-1] if g.completion.stopped else None
        if matched is not None and self.sglang_trim_stop:
            ids = ids[:-1]
        return ids, matched

    def sglang_chat_body(self, g: Generation, body: Mapping[str, Any]) -> str:
        """SGLang's ``/v1/chat/completions`` answer: ``reasoning_content`` (reasoning parser),
        ``tool_calls`` (tool-call parser, native ids), ``matched_stop``, and with
        ``return_token_ids`` the choice's ``token_ids`` (the output ids) and
        ``prompt_token_ids``; usage counts every output id (including the end of turn)."""
        m = g.message
        ids, matched = self._sglang_ids(g)
        tool_calls = [{"id": c["id"], "index": i, "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                      for i, c in enumerate(m.tool_calls)] or None
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": m.content or None,
                                                          "reasoning_content": m.reasoning, "tool_calls": tool_calls},
                                  "logprobs": None, "finish_reason": m.finish_reason, "matched_stop": matched}
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
        if body.get("return_token_ids") or body.get("return_prompt_token_ids"):
            choice["prompt_token_ids"] = g.completion.prompt_ids
        if body.get("return_meta_info"):
            choice["meta_info"] = {"id": g.id, "completion_tokens": len(g.completion.ids)}
        n_out = len(g.completion.ids)
        usage = {"prompt_tokens": len(g.completion.prompt_ids), "total_tokens": len(g.completion.prompt_ids) + n_out,
                 "completion_tokens": n_out, "prompt_tokens_details": None, "reasoning_tokens": m.reasoning_tokens}
        return _dumps({"id": g.id.removeprefix("gen-"), "object": "chat.completion", "created": g.created, "model": g.model,
                       "choices": [choice], "usage": usage, "metadata": {"weight_version": "default"}})

    def sglang_generate_body(self, g: Generation, body: Mapping[str, Any]) -> str:
        """SGLang's native ``/generate`` answer: ``text``, ``output_ids``, ``meta_info``
        (``finish_reason`` {type, matched}, prompt/completion token counts)."""
        sp = body.get("sampling_params") or {}
        ids, matched = self._sglang_ids(g)
        full = g.completion.ids
        text_ids = full if (sp.get("no_stop_trim") or matched is None) else full[:-1]
        if sp.get("skip_special_tokens", True):
            text_ids = [i for i in text_ids if not self.tokenizer.is_special_id(i)]
        finish = ({"type": "stop", "matched": matched} if matched is not None
                  else {"type": "length", "length": len(full)})
        meta = {"id": g.id.removeprefix("gen-"), "finish_reason": finish, "prompt_tokens": len(g.completion.prompt_ids),
                "weight_version": "default", "completion_tokens": len(full), "cached_tokens": 0,
                "e2e_latency": round(g.latency_ms / 1000, 4)}
        return _dumps({"text": self.tokenizer.decode(text_ids), "output_ids": ids, "meta_info": meta})

    # -- the HTTP server (asyncio protocol; every answer is a list of actions) -------------------
    @staticmethod
    def _head(status: int, content_type: str, length: int | None, headers: Mapping[str, str] | None = None) -> bytes:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}", f"Content-Type: {content_type}",
                 "Server: eagledata-simulator/2"]
        lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _send(self, status: int, text: str, content_type: str = "application/json",
              headers: Mapping[str, str] | None = None) -> list[tuple]:
        data = text.encode("utf-8")
        return [("write", self._head(status, content_type, len(data), headers) + data)]

    def _error(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> list[tuple]:
        body = sglang_error_body(status, message) if self.api == "sglang" else error_body(status, message, self.profile.provider_name)
        return self._send(status, _dumps(body), headers=headers)

    def _latency(self) -> float:
        extra = random.uniform(0, self.latency_jitter_ms) if self.latency_jitter_ms else 0.0
        return (self.latency_ms + extra) / 1000

    def respond(self, method: str, target: str, headers: Mapping[str, str], raw: bytes) -> list[tuple]:
        """The answer to one request as actions: ``("write", bytes)``, ``("sleep", s)``,
        ``("close",)``, ``("reset",)``, ``("call", fn)``."""
        url = urlparse(target)
        if method == "GET":
            gid = (parse_qs(url.query).get("id") or [""])[0]
            if url.path == f"{API_PREFIX}/generation":
                stats = self.generation_stats(gid)
                return self._send(200, _dumps(stats)) if stats else self._error(404, f"Generation {gid} not found")
            if url.path == f"{API_PREFIX}/key":
                return self._send(200, _dumps(self.key_info()))
            if url.path == "/_sim/counters":
                return self._send(200, _dumps(self.counters()))
            if url.path == "/_sim/truth":
                truth = self.truth(gid) or self.truth(f"gen-{gid}")
                return self._send(200, _dumps(truth)) if truth else self._error(404, f"Generation {gid} not found")
            if url.path in ("/health", "/health_generate"):
                return self._send(200, "")
            if url.path == "/get_model_info":
                return self._send(200, _dumps({"model_path": "simulator", "is_generation": True}))
            return self._error(404, f"no route {url.path}")
        if method != "POST":
            return self._error(405, f"method {method} not allowed")
        routes = ({f"{API_PREFIX}/chat/completions": "chat"} if self.api == "openrouter"
                  else {"/v1/chat/completions": "chat", "/generate": "generate"})
        kind = routes.get(url.path)
        if kind is None:
            return self._error(404, f"no route {url.path}")
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("body is not a JSON object")
        except (ValueError, UnicodeDecodeError) as exc:
            return self._error(400, f"invalid JSON body: {exc}")
        return self._complete(kind, body, raw, headers)

    def _complete(self, kind: str, body: dict[str, Any], raw: bytes, headers: Mapping[str, str]) -> list[tuple]:
        base = self._raw_memo.get(raw)
        _, fault = self._register(body, headers.get("authorization"), base.prompt_hash if base is not None else None)
        pre: list[tuple] = []
        if fault is not None:
            if fault.kind == "hang":
                pre.append(("sleep", fault.seconds or 3600))
            elif fault.kind == "disconnect":
                return [("close",)]
            elif fault.kind == "reset":
                return [("reset",)]
            elif fault.kind == "http":
                extra = {"Retry-After": f"{fault.retry_after:g}"} if fault.retry_after is not None else None
                return self._error(fault.status, fault.message or _ERROR_MESSAGES.get(fault.status, "Error"), extra)
        if kind == "chat" and not body.get("model"):
            return pre + self._error(400, "model is required")
        stream = bool(body.get("stream"))
        if self.api == "sglang" and kind == "chat" and stream and body.get("return_token_ids"):
            return pre + self._error(400, "return_token_ids is not supported with stream=True for chat completions")
        try:
            g = self.make_generation(body, raw)
        except (RequestError, ChatTemplateError) as exc:
            return pre + self._error(400, str(exc))
        failing = fault is not None and fault.kind in ("error_in_200", "mid_stream")
        malformed = fault is not None and fault.kind == "malformed"
        if self.api == "sglang":
            self._bill(g)
            if failing:
                text = _dumps(sglang_error_body(500, fault.message or "Internal server error"))
            else:
                text = self.sglang_chat_body(g, body) if kind == "chat" else self.sglang_generate_body(g, body)
                if malformed:
                    text = text[: len(text) // 2]
            return pre + [("sleep", self._latency())] + self._send(200, text)
        gen_header = {"X-Generation-Id": g.id}
        if not stream:
            self._bill(g, 0.0 if failing else 1.0)
            if failing:
                text = self.profile.json_padding + _dumps(error_body(502, fault.message or "Provider returned error", g.provider))
            else:
                text = self.json_body(g)
                if malformed:
                    text = text[: len(text) // 2]
            data = text.encode("utf-8")
            pad = len(self.profile.json_padding.encode("utf-8")) if text.startswith(self.profile.json_padding) else 0
            latency = self._latency()
            if latency <= 0:
                return pre + [("write", self._head(200, "application/json", len(data), gen_header) + data)]
            return pre + [("write", self._head(200, "application/json", len(data), gen_header) + data[:pad]),
                          ("sleep", latency), ("write", data[pad:])]
        self._bill(g, 0.5 if failing else 1.0)  # a stream cut mid-way was partly generated: partly billed
        first = self._head(200, "text/event-stream", None, {"Cache-Control": "no-cache", **gen_header})
        events = b"".join(self._chunk(f"data: {e}\n\n") for e in self.sse_events(g, fail_midway=failing, malformed=malformed))
        return pre + [("write", first + self._chunk(PROCESSING_COMMENT + "\n\n")), ("sleep", self._latency()),
                      ("write", events + b"0\r\n\r\n")]

    @staticmethod
    def _chunk(text: str) -> bytes:
        data = text.encode("utf-8")
        return b"%x\r\n%s\r\n" % (len(data), data)


class _Connection(asyncio.Protocol):
    """One client connection of the stand-in: parses HTTP/1.1 requests and plays each answer's
    actions in order (timers for the latency, no task per request)."""

    def __init__(self, sim: SimulatorServer):
        self.sim = sim
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.queue: list[tuple[str, str, dict[str, str], bytes]] = []
        self.busy = False
        self.closed = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self.sim._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        if self.busy:
            self.sim.in_flight -= 1
            self.busy = False
        self.sim._connections.discard(self)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buf[:end].decode("latin-1").split("\r\n")
            headers: dict[str, str] = {}
            for line in lines[1:]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            length = int(headers.get("content-length") or 0)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            try:
                method, target, _ = lines[0].split(" ", 2)
            except ValueError:
                self.transport.close()
                return
            self.queue.append((method, target, headers, body))
            self._next()

    def _next(self) -> None:
        if self.busy or not self.queue or self.closed:
            return
        method, target, headers, body = self.queue.pop(0)
        self.busy = True
        self.sim.in_flight += 1
        self.sim.max_in_flight = max(self.sim.max_in_flight, self.sim.in_flight)
        try:
            actions = self.sim.respond(method, target, headers, body)
        except Exception as exc:  # noqa: BLE001 - a bug in the stand-in answers 500, never hangs
            actions = self.sim._send(500, _dumps(error_body(500, f"simulator error: {type(exc).__name__}: {exc}")))
        if headers.get("connection", "").lower() == "close":
            actions = actions + [("close",)]
        self._play(actions, 0)

    def _play(self, actions: list[tuple], i: int) -> None:
        self.timer = None
        while i < len(actions) and not self.closed:
            act = actions[i]
            i += 1
            if act[0] == "write":
                self.transport.write(act[1])
            elif act[0] == "sleep":
                if act[1] > 0:
                    self.timer = asyncio.get_running_loop().call_later(act[1], self._play, actions, i)
                    return
            elif act[0] == "close":
                self.transport.close()
                self.closed = True
            elif act[0] == "reset":
                sock = self.transport.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.transport.abort()
                self.closed = True
        if self.busy:
            self.busy = False
            self.sim.in_flight -= 1
        if not self.closed:
            self._next()


# ----------------------------------------------------------------------------------------------
# CLI


def main(argv: Sequence[str] | None = None) -> int:
    from eagledata.text.families import get_family
    from eagledata.text.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m eagledata.standin.server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="tokenizer directory (tiktoken or HF)")
    ap.add_argument("--family", required=True, help="model family, e.g. kimi-k2.5")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: an ephemeral port")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="exact", choices=sorted(PROFILES))
    ap.add_argument("--api", default="openrouter", choices=("openrouter", "sglang"))
    ap.add_argument("--latency-ms", type=float, default=0)
    ap.add_argument("--latency-jitter-ms", type=float, default=0)
    ap.add_argument("--price", type=float, nargs=2, metavar=("PROMPT", "COMPLETION"), default=(0.6, 2.5),
                    help="USD per million tokens")
    ap.add_argument("--content-tokens", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    ap.add_argument("--reasoning-tokens", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    ap.add_argument("--fault", action="append", default=[], metavar="N=KIND",
                    help="inject a fault into request N, e.g. 3=429, 4=502, 5=error-in-200, 6=mid-stream, 7=reset")
    ap.add_argument("--port-file", help="write the port here once listening")
    args = ap.parse_args(argv)
    faults = {}
    for spec in args.fault:
        n, _, kind = spec.partition("=")
        faults[int(n)] = Fault.parse(kind)
    options = {k: tuple(v) for k, v in (("content_tokens", args.content_tokens), ("reasoning_tokens", args.reasoning_tokens)) if v}
    family = get_family(args.family)
    tok = load_tokenizer(args.tokenizer, family)
    server = SimulatorServer(tok, family, seed=args.seed, profile=args.profile, latency_ms=args.latency_ms,
                             latency_jitter_ms=args.latency_jitter_ms, price_per_mtok=tuple(args.price), faults=faults,
                             host=args.host, port=args.port, api=args.api, **options).start()
    if args.port_file:
        Path(args.port_file).write_text(str(server.port))
    print(f"simulator ({args.api}, {args.profile}, {family.name}) listening: {server.base_url} "
          f"(counters: {server.root_url}/_sim/counters)", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(3600):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

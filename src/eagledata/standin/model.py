"""Completions as token ids first: :class:`CompletionModel` makes the ground truth of a completion
(reasoning from the corpus, the family's think tokens, content, an optional tool-call section with
native ids and schema-conforming JSON arguments, the end-of-turn id) as ids and segments; the
response text is decoded from them later (:mod:`eagledata.standin.profiles`).

Without a profile's completion hooks, a completion is a pure function of (server seed, request
content): :meth:`CompletionModel.complete` recomputes the truth of any recorded request offline.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from eagledata.errors import EagledataError
from eagledata.generate.prompts import canonical_json, sha256_hex
from eagledata.standin.corpus import corpus_sentences, corpus_words
from eagledata.text.chat import prompt_ids, request_thinking
from eagledata.text.families import ModelFamily
from eagledata.text.tokenizer import Tokenizer
from eagledata.tokens.reconstruct import Segment, count_tool_calls

DEFAULT_MAX_TOKENS = 16384

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


class RequestError(EagledataError, ValueError):
    """The request body is unusable (answered 400)."""


def thinking_on(family: ModelFamily, request: Mapping[str, Any]) -> bool:
    """Whether the model thinks for ``request``: the family thinks and the request does not turn it off."""
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
        thinking = thinking_on(self.family, request)
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

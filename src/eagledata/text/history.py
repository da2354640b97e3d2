"""Conversation history for turn-by-turn regeneration, and the merged-sample check.

Contract:

* :func:`assistant_message` turns one regenerated reply (reasoning, content, tool calls) into the
  assistant message a later turn's request carries as history: OpenAI shape, the reasoning as
  ``reasoning_content`` (what Kimi's templates read), tool-call ids the model's native ids
  (``functions.NAME:IDX``, IDX counted over the whole conversation). How the history is rendered is
  the family's template's business (K2.5 drops the reasoning of turns before the last plain
  assistant reply); the request and the prompt ids both come from these same messages.
* :func:`check_merged` decides whether one training sample may hold several assistant turns with
  the loss mask on each: only when the template, rendering the whole conversation, reproduces every
  turn token for token as the ids that turn produced after its own prompt. It returns the loss-mask
  spans when it holds, else the first turn and token where it does not, with the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from eagledata.text.chat import prompt_ids
from eagledata.text.families import ModelFamily
from eagledata.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class ToolCallText:
    """A tool call as the model wrote it: function name and argument text (kept byte for byte)."""

    name: str
    arguments: str


def assistant_message(reasoning: str | None, content: str | None, tool_calls: Sequence[ToolCallText],
                      family: ModelFamily, first_index: int = 0) -> dict[str, Any]:
    """The history message for one reply; ``first_index`` is the number of tool calls earlier in the
    conversation (native ids count over the whole conversation)."""
    message: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = [
            {"id": family.native_tool_call_id(call.name, first_index + i), "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for i, call in enumerate(tool_calls)
        ]
    return message


def arguments_equal(a: str, b: str) -> bool:
    """Tool arguments that are the same JSON value (a regenerated call matches the original's)."""
    try:
        return json.loads(a) == json.loads(b)
    except (TypeError, ValueError):
        return a == b


@dataclass
class MergeCheck:
    """Whether the turns merge into one sample; ``spans`` are the loss-mask ranges (one per turn)."""

    ok: bool
    ids: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    turn: int | None = None
    position: int | None = None
    reason: str | None = None


def check_merged(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], turn_ids: Sequence[Sequence[int]],
                 tools: Sequence[Mapping[str, Any]] | None = None, thinking: bool | None = None,
                 template: str | None = None) -> MergeCheck:
    """Check the whole conversation's rendering against each assistant turn's own ids.

    ``messages`` is the conversation with every regenerated reply as an assistant message (see
    :func:`assistant_message`); ``turn_ids[i]`` is the completion ids of the ``i``-th assistant
    message, as produced after its own prompt (end-of-turn included)."""
    positions = [k for k, m in enumerate(messages) if m.get("role") == "assistant"]
    if len(positions) != len(turn_ids):
        raise ValueError(f"{len(positions)} assistant messages but {len(turn_ids)} turns of ids")
    full = prompt_ids(tokenizer, messages, tools, thinking, template, add_generation_prompt=False)
    spans = []
    for i, (k, ids) in enumerate(zip(positions, turn_ids)):
        prefix = prompt_ids(tokenizer, messages[:k], tools, thinking, template, add_generation_prompt=True)
        expected = list(prefix) + list(ids)
        diverge = _first_difference(full, expected)
        if diverge is not None:
            return MergeCheck(False, turn=i, position=diverge, reason=_why(tokenizer, full, expected, diverge, i, len(prefix)))
        spans.append((len(prefix), len(expected)))
    return MergeCheck(True, ids=list(full), spans=spans)


def _first_difference(full: Sequence[int], expected: Sequence[int]) -> int | None:
    for p, want in enumerate(expected):
        if p >= len(full) or full[p] != want:
            return p
    return None


def _why(tokenizer: Tokenizer, full: Sequence[int], expected: Sequence[int], p: int, turn: int, prompt_len: int) -> str:
    where = "its prompt" if p < prompt_len else f"its completion (token {p - prompt_len})"
    got = tokenizer.decode(list(full[p:p + 8])) if p < len(full) else "(end of the conversation)"
    want = tokenizer.decode(list(expected[p:p + 8]))
    return (f"turn {turn}: the template renders the conversation differently from what this turn saw and "
            f"produced, first in {where}: {got!r} where the turn has {want!r}")

"""Turn-by-turn regeneration of a multi-turn prompt record (``turns: all``).

Contract: :func:`turn_request` gives the messages of a conversation's next request from the original
record and the model's replies so far, or a :class:`ConversationEnd` saying why there is none. It is
a pure function of its inputs, so a job killed between turns recomputes the same request bodies from
the cached replies (cache hits, nothing paid twice) and resumes at the first turn not yet answered.

A record's messages are read as a preamble (system/developer messages before the first user turn)
and turns: the non-assistant messages that open a turn (user messages, or nothing after spliced tool
results), the original assistant reply that closed it, and that reply's tool results. Turn ``i``'s
request is the preamble, then every earlier turn as the model itself answered it (see
:func:`eagledata.text.history.assistant_message`), then turn ``i``'s opening messages. Where the model
called tools, the original tool results are spliced in only when the original reply made the same
calls (same functions in the same order, JSON-equal arguments), with the model's native ids as
``tool_call_id``; otherwise the conversation ends at that turn, with the reason.

Also here: ShareGPT-style records (``conversations: [{from, value}]``) converted to messages, and the
key prompts are deduplicated by (the canonical prompt ids).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from eagledata.errors import InputError
from eagledata.text.chat import prompt_ids
from eagledata.text.families import ModelFamily
from eagledata.text.history import ToolCallText, arguments_equal, assistant_message

PREAMBLE_ROLES = frozenset({"system", "developer"})


@dataclass(frozen=True)
class Reply:
    """What the model answered for one turn (as parsed from its response)."""

    reasoning: str | None
    content: str | None
    tool_calls: tuple[ToolCallText, ...] = ()


@dataclass
class Turn:
    opening: list[dict[str, Any]] = field(default_factory=list)
    original: dict[str, Any] | None = None
    tool_results: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class ConversationEnd:
    """No further request: ``complete`` (every turn answered) or why the conversation stops early."""

    reason: str
    complete: bool = False


def split_turns(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[Turn]]:
    """(preamble, turns) of a record's messages; a record ending in a user message (or in tool
    results) has a last turn with no original reply."""
    msgs = [dict(m) for m in messages]
    i = 0
    while i < len(msgs) and msgs[i].get("role") in PREAMBLE_ROLES:
        i += 1
    preamble, turns, current = msgs[:i], [], Turn()
    for msg in msgs[i:]:
        role = msg.get("role")
        if role == "assistant":
            current.original = msg
            turns.append(current)
            current = Turn()
        elif role == "tool" and turns and not current.opening:
            turns[-1].tool_results.append(msg)
        else:
            current.opening.append(msg)
    if current.opening:
        turns.append(current)
    elif turns and turns[-1].tool_results and msgs and msgs[-1].get("role") == "tool":
        turns.append(current)  # a record ending in tool results: the model's answer to them is a turn
    return preamble, turns


def user_turns(messages: Sequence[Mapping[str, Any]]) -> int:
    """How many requests ``turns: all`` sends for a record at most (for plans and cost previews)."""
    return len(split_turns(messages)[1])


def turn_request(messages: Sequence[Mapping[str, Any]], replies: Sequence[Reply],
                 family: ModelFamily) -> list[dict[str, Any]] | ConversationEnd:
    """The messages of request number ``len(replies)``, or why there is none."""
    preamble, turns = split_turns(messages)
    if not turns:
        return ConversationEnd("the record has no user turn")
    history = list(preamble)
    calls_so_far = sum(len(m.get("tool_calls") or []) for m in preamble)
    for turn, reply in zip(turns, replies):
        history += turn.opening
        message = assistant_message(reply.reasoning, reply.content, reply.tool_calls, family, calls_so_far)
        history.append(message)
        calls_so_far += len(reply.tool_calls)
        spliced = _splice(turn, message)
        if isinstance(spliced, ConversationEnd):
            return spliced
        history += spliced
    if len(replies) >= len(turns):
        return ConversationEnd("every turn answered", complete=True)
    nxt = turns[len(replies)]
    if not nxt.opening and not history[-1].get("role") == "tool":
        return ConversationEnd(f"turn {len(replies)} opens with no message to answer")
    return history + nxt.opening


def _splice(turn: Turn, message: Mapping[str, Any]) -> list[dict[str, Any]] | ConversationEnd:
    """The tool messages to follow the model's reply: the original results when its calls match."""
    ours = message.get("tool_calls") or []
    theirs = (turn.original or {}).get("tool_calls") or []
    if not ours and not theirs:
        return []
    if not ours:
        return ConversationEnd("the original reply called a tool here; the model answered without one")
    if not theirs:
        return ConversationEnd("the model called a tool where the original reply did not")
    names = [c["function"]["name"] for c in ours], [c["function"]["name"] for c in theirs]
    if names[0] != names[1]:
        return ConversationEnd(f"the model called {names[0]}, the original {names[1]}")
    for a, b in zip(ours, theirs):
        if not arguments_equal(a["function"]["arguments"], _arguments_text(b["function"].get("arguments"))):
            return ConversationEnd(f"the model called {a['function']['name']} with other arguments than the original")
    chosen = _results_in_call_order(theirs, turn.tool_results)
    if isinstance(chosen, ConversationEnd):
        return chosen
    return [{**result, "tool_call_id": mine["id"]} for mine, result in zip(ours, chosen)]


def _results_in_call_order(calls: list[Mapping[str, Any]], results: list[Mapping[str, Any]]) -> list | ConversationEnd:
    """The original's tool results in the order of its calls: by id where they answer the calls one
    to one; by position where no result names any call's id (a conversion that renamed or dropped
    them) and there is one per call; else the conversation ends (duplicate ids, a result for a call
    that is not there, a call without a result): one result given to two calls is no guess to make."""
    ids = [c.get("id") for c in calls]
    answered = [r.get("tool_call_id") for r in results]
    if len(set(ids)) == len(ids) and Counter(answered) == Counter(ids):
        by_id = {r.get("tool_call_id"): r for r in results}
        return [by_id[i] for i in ids]
    if not set(answered) & set(ids) and len(answered) == len(ids):
        return list(results)
    return ConversationEnd(f"the original record's tool results do not answer its calls one to one "
                           f"(calls {ids}, results for {answered})")


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


# --------------------------------------------------------------------------------------------------
# ShareGPT-style records and deduplication

SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
            "model": "assistant", "system": "system", "tool": "tool", "observation": "tool", "function_response": "tool"}


class ConversationFormatError(InputError):
    """A ShareGPT-style record is unusable; the message names ``where.field``."""


def sharegpt_messages(conversations: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI messages for ``conversations: [{from, value}]`` (``where`` is ``FILE:LINE``)."""
    if not isinstance(conversations, list) or not conversations:
        raise ConversationFormatError(f"{where}:conversations: must be a non-empty list of {{from, value}} objects")
    out = []
    for i, turn in enumerate(conversations):
        at = f"{where}:conversations[{i}]"
        if not isinstance(turn, dict):
            raise ConversationFormatError(f"{at}: must be an object with 'from' and 'value'")
        speaker = turn.get("from")
        if speaker is None:
            raise ConversationFormatError(f"{at}.from: missing")
        role = SPEAKERS.get(str(speaker).lower())
        if role is None:
            raise ConversationFormatError(f"{at}.from: unknown speaker {speaker!r}; known: {sorted(SPEAKERS)}")
        value = turn.get("value")
        if not isinstance(value, str):
            raise ConversationFormatError(f"{at}.value: must be a string, got {type(value).__name__}")
        out.append({"role": role, "content": value})
    return out


def prompt_key(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> str:
    """Identity of a prompt for deduplication: the sha256 of its canonical prompt ids."""
    ids = prompt_ids(tokenizer, messages, tools)
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()

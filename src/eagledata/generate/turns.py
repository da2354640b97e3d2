"""``turns: all``: which turn of each conversation is requested next, from the replies cached so far.

A conversation (one record, or one sample of it with ``samples_per_prompt`` > 1) is regenerated turn
by turn: turn ``k``'s request is :func:`eagledata.generate.conversation.turn_request` of the record
and the model's replies to turns ``0..k-1``, read back from the response cache (parsed by
:func:`eagledata.tokens.responses.parse_response`). The job requests in rounds: round ``k`` sends
the next turn of every conversation not finished (concurrently), then :meth:`TurnPlanner.advance`
reads the new replies and gives the next round. Since every request body is a pure function of the
record and the cached replies, a job killed between (or during) rounds recomputes the same bodies,
finds the turns already answered in the cache, and resumes at the first turn not answered: nothing is
paid twice.

A conversation ends complete (every user turn answered) or early, with the reason: a turn answered
with a final HTTP error or a body without a usable reply, a reply cut at ``max_tokens``, or a tool
call that does not match the original record's (see :mod:`eagledata.generate.conversation`). Its
answered turns are kept either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from eagledata.generate.cache import ResponseCache
from eagledata.generate.conversation import ConversationEnd, Reply, turn_request
from eagledata.generate.requests import DatasetWork, WorkItem, make_item, sample_id
from eagledata.text.chat import request_thinking
from eagledata.text.families import ModelFamily
from eagledata.text.history import ToolCallText
from eagledata.tokens.reconstruct import recover_text
from eagledata.tokens.responses import parse_response


@dataclass
class TurnState:
    """Where the conversations stand: every turn item known (answered or to request), the turns to
    request next, and the conversations that ended (id -> end)."""

    items: list[WorkItem] = field(default_factory=list)
    todo: dict[str, WorkItem] = field(default_factory=dict)
    ends: dict[str, ConversationEnd] = field(default_factory=dict)
    answered: dict[str, int] = field(default_factory=dict)  # conversation -> turns answered


def reply_of(rec: dict[str, Any], family: ModelFamily) -> Reply | str:
    """The model's reply in a cached record, or why it cannot be the next turn's history. A reply a
    provider left partly in the wrong place (tool-call markup inside content or reasoning, reasoning
    in think tags inside content) is read as the model wrote it, as the tokens stage reads it
    (:func:`eagledata.tokens.reconstruct.recover_text`): its tool calls are calls, answered by the
    next turn's tool results, never text."""
    if rec.get("status") != 200:
        return f"HTTP {rec.get('status')} (final error)"
    parsed = parse_response(rec.get("response_raw") or "", 200)
    if not parsed.ok:
        return f"no usable reply ({parsed.error.message if parsed.error else 'error'})"
    if parsed.finish_reason == "length":
        return "the reply was cut at max_tokens (finish_reason length)"
    reasoning, content, calls = parsed.reasoning, parsed.content, parsed.tool_calls
    flags: list[str] = []
    request = rec.get("chat_request") or rec.get("request") or {}
    thinking_on = family.thinking and request_thinking(request) is not False
    recovered = recover_text(parsed, family, thinking_on, flags)
    if flags:  # else as returned (None and "" kept apart: the next turn's body, and its cache key, as before)
        reasoning, content, calls = recovered[0] or None, recovered[1] or None, recovered[2]
    return Reply(reasoning, content, tuple(ToolCallText(c.name, c.arguments) for c in calls))


class TurnPlanner:
    """The turns of a ``turns: all`` dataset's conversations against its response cache (replies
    parsed once per job)."""

    def __init__(self, work: DatasetWork, cache: ResponseCache, tokenizer: Any = None, respeller: Any = None):
        self.work, self.cache, self.tokenizer = work, cache, tokenizer
        # a turn not cached as it is is looked up in the other spellings of its settings (eagledata.generate.respell)
        self.respeller = respeller
        self.replies: dict[str, Reply | str] = {}  # cache key -> reply, or why not

    def _reply(self, key: str, fh: Any) -> Reply | str:
        if key not in self.replies:
            self.replies[key] = reply_of(self.cache.get(key, fh), self.work.settings.family)
        return self.replies[key]

    def advance(self) -> TurnState:
        """Every conversation followed through the cache: its answered turns, then its next turn to
        request or its end."""
        s = self.work.settings
        n = int(s.generation.get("samples_per_prompt", 1))
        state = TurnState()
        fh = open(self.cache.path, "rb") if self.cache.path.exists() else None
        try:
            for p in self.work.prompts:
                for k in range(n):
                    conv, replies = sample_id(p.id, k, n), []
                    while True:
                        messages = turn_request(p.messages, replies, s.family)
                        if isinstance(messages, ConversationEnd):
                            state.ends[conv] = messages
                            break
                        item = make_item(replace(p, messages=messages), s, k, self.work.salt, self.tokenizer,
                                         turn=len(replies))
                        state.items.append(item)
                        if item.cache_key not in self.cache.index and not (self.respeller and self.respeller.take((item,))):
                            state.todo.setdefault(item.cache_key, item)
                            break
                        reply = self._reply(item.cache_key, fh)
                        if isinstance(reply, str):
                            state.ends[conv] = ConversationEnd(f"turn {len(replies)}: {reply}")
                            break
                        replies.append(reply)
                    state.answered[conv] = len(replies)
        finally:
            if fh is not None:
                fh.close()
        return state


def conversation_summary(state: TurnState, log: Any = None, dataset: str = "") -> dict[str, Any]:
    """The ``conversations`` block of ``generation_summary.json``: counts, and every conversation that
    ended early with its answered turns and the reason (also logged)."""
    early = [{"conversation": c, "turns_answered": state.answered.get(c, 0), "reason": e.reason}
             for c, e in state.ends.items() if not e.complete]
    if log is not None:
        for e in early:
            log(f"generate {dataset}: conversation {e['conversation']} ended after {e['turns_answered']} turn(s): "
                f"{e['reason']} (its answered turns are kept)")
    return {"conversations": len(state.answered), "complete": sum(1 for e in state.ends.values() if e.complete),
            "ended_early": early, "unfinished": len(state.answered) - len(state.ends),
            "turns": len(state.items)}

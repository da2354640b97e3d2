"""Prompt files: JSONL, one ``{"id"?, "messages": [...], "tools"?: [...]}`` object per line, or a
ShareGPT-style ``{"id"?, "conversations": [{"from", "value"}, ...], "tools"?}`` (converted to messages by
:func:`eagledata.generate.conversation.sharegpt_messages`: ``human``/``user`` -> user,
``gpt``/``assistant``/``chatgpt``/``model`` -> assistant, ``system``, ``tool``/``observation``).

``id`` is optional; the default is ``"p-"`` + the first 16 hex digits of the sha256 of the canonical
JSON of ``{"messages", "tools"}``, so it is stable across runs and machines. Blank lines are allowed.
Every problem raises :class:`PromptFileError` naming ``file:line:field``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagledata.errors import InputError
from eagledata.io import iter_json_lines, sha256_text

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
#: Top-level keys of a prompt line; ``metadata`` is carried by users and ignored here.
PROMPT_KEYS = frozenset({"id", "messages", "conversations", "tools", "metadata"})


class PromptFileError(InputError):
    """A prompt file line is unusable; the message starts with ``file:line:field``."""


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    line: int


def canonical_json(obj: Any) -> str:
    """Key-sorted, compact, non-ASCII-preserving JSON: equal objects give equal text."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical(value: Any) -> Any:
    """``value`` with every mapping's keys sorted (a JSON value): for what is compared as written out,
    as Snakemake compares a rule's params, so a config whose keys were reordered (by hand, or by a
    YAML dump) changes nothing."""
    return json.loads(canonical_json(value))


#: Hex sha256 of a text's UTF-8 bytes (:func:`eagledata.io.sha256_text`; this name is kept for the stand-in).
sha256_hex = sha256_text


def default_prompt_id(messages: list[Any], tools: list[Any] | None) -> str:
    """The id of a prompt line without one: ``p-`` and 16 hex digits of its content hash."""
    return "p-" + sha256_hex(canonical_json({"messages": messages, "tools": tools or None}))[:16]


def _check_message(msg: Any, where: str) -> None:
    def fail(field: str, problem: str) -> PromptFileError:
        return PromptFileError(f"{where}.{field}: {problem}")

    if not isinstance(msg, dict):
        raise PromptFileError(f"{where}: a message must be a JSON object, got {type(msg).__name__}")
    role = msg.get("role")
    if role is None:
        raise fail("role", "missing")
    if role not in ROLES:
        raise fail("role", f"unknown role {role!r}; known: {sorted(ROLES)}")
    content = msg.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise fail("content", f"must be a string, a list of parts or null, got {type(content).__name__}")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or "type" not in part:
                raise fail(f"content[{j}]", "a content part must be an object with a 'type'")
    calls = msg.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise fail("tool_calls", f"only assistant messages carry tool_calls (role is {role!r})")
        if not isinstance(calls, list):
            raise fail("tool_calls", "must be a list")
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise fail(f"tool_calls[{j}].function.name", "missing or not a non-empty string")
            if not isinstance(fn.get("arguments"), (str, dict)):
                raise fail(f"tool_calls[{j}].function.arguments", "must be a JSON string (or object)")
    if role == "assistant":
        if content is None and not calls:
            raise fail("content", "an assistant message needs content or tool_calls")
    elif "content" not in msg or content is None:
        raise fail("content", "missing")
    if role == "tool" and not isinstance(msg.get("tool_call_id"), str):
        raise fail("tool_call_id", "a tool message needs the string id of the call it answers")


def _check_tools(tools: Any, where: str) -> None:
    if not isinstance(tools, list):
        raise PromptFileError(f"{where}: must be a list")
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise PromptFileError(f"{where}[{j}]: a tool must be {{\"type\": \"function\", \"function\": {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise PromptFileError(f"{where}[{j}].function.name: missing or not a non-empty string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise PromptFileError(f"{where}[{j}].function.parameters: must be a JSON schema object")


def _unsendable(value: Any, path: str) -> tuple[str, str] | None:
    """The first place in a decoded line that no request body can carry, and why: a string with a
    lone surrogate (an unpaired ``\\ud800``-``\\udfff`` escape: not Unicode, so not UTF-8) or a
    non-finite number (``NaN``, ``Infinity``: Python's JSON reader takes them, JSON has none)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "(line)", "a string holds a lone surrogate (an unpaired \\ud800-\\udfff escape): not valid Unicode"
    elif isinstance(value, float) and not math.isfinite(value):
        return path or "(line)", f"{value} is no JSON number (NaN and Infinity cannot be sent)"
    elif isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            found = _unsendable(key, here) or _unsendable(item, here)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _unsendable(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def parse_prompt_line(obj: Any, where: str, lineno: int) -> Prompt:
    """Validate one decoded line; ``where`` is ``file:line`` for messages."""
    if not isinstance(obj, dict):
        raise PromptFileError(f"{where}: a line must be a JSON object, got {type(obj).__name__}")
    try:
        unsendable = _unsendable(obj, "")
    except RecursionError:
        raise PromptFileError(f"{where}:(line): nested too deeply") from None
    if unsendable is not None:
        raise PromptFileError(f"{where}:{unsendable[0]}: {unsendable[1]}")
    unknown = sorted(set(obj) - PROMPT_KEYS)
    if unknown:
        raise PromptFileError(f"{where}:{unknown[0]}: unknown field; allowed: {sorted(PROMPT_KEYS)}")
    if "conversations" in obj:
        if "messages" in obj:
            raise PromptFileError(f"{where}:conversations: a line has either 'messages' or 'conversations', not both")
        from eagledata.generate.conversation import ConversationFormatError, sharegpt_messages

        try:
            messages = sharegpt_messages(obj["conversations"], where)
        except ConversationFormatError as exc:
            raise PromptFileError(str(exc)) from None
        field = "conversations"
    elif "messages" not in obj:
        raise PromptFileError(f"{where}:messages: missing (or a ShareGPT-style 'conversations' list)")
    else:
        messages, field = obj["messages"], "messages"
    if not isinstance(messages, list) or not messages:
        raise PromptFileError(f"{where}:messages: must be a non-empty list")
    for i, msg in enumerate(messages):
        _check_message(msg, f"{where}:{field}[{i}]")
    tools = obj.get("tools")
    if tools is not None:
        _check_tools(tools, f"{where}:tools")
    tools = tools or None
    pid = obj.get("id")
    if pid is None:
        pid = default_prompt_id(messages, tools)
    elif isinstance(pid, bool) or not isinstance(pid, (str, int)):
        raise PromptFileError(f"{where}:id: must be a string (or an integer), got {type(pid).__name__}")
    pid = str(pid)
    if not pid or "#" in pid or pid != pid.strip():
        raise PromptFileError(f"{where}:id: {pid!r} is not usable (empty, has surrounding spaces, or contains '#', "
                              "which separates sample numbers)")
    return Prompt(pid, messages, tools, lineno)


def read_prompts(path: str | Path) -> list[Prompt]:
    """Read and validate a prompts JSONL file (see the module docstring)."""
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for lineno, where, obj in iter_json_lines(path, PromptFileError, "prompt file", objects_only=False):
        prompt = parse_prompt_line(obj, where, lineno)
        if prompt.id in seen:
            what = "id" if "id" in obj else "id (default, from identical messages+tools)"
            raise PromptFileError(f"{where}:{what}: duplicate id {prompt.id!r}, first at line {seen[prompt.id]}")
        seen[prompt.id] = lineno
        prompts.append(prompt)
    if not prompts:
        raise PromptFileError(f"{path}: no prompts (file is empty or blank)")
    return prompts

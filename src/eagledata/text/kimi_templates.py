"""Kimi's chat templates rendered in Python: the text Jinja renders, several times faster.

Rendering a prompt through Jinja's sandbox was the largest single step of reconstructing a short sample
(about 0.06 ms of its 0.25; a K2 prompt of the recorded traffic takes 43 us through Jinja, 6 us here).
The three Kimi templates (K2 Instruct, K2 Thinking, K2.5: the files in ``shared/tokenizers``, and the
demo's vendored copy of K2.5's) are written out here as Python, each recognised by the SHA-256 of its
exact text (:data:`RENDERERS`): any other template, one character changed, is Jinja's.

A renderer covers *plain conversations* and returns ``None`` for anything else, which Jinja then renders
(:func:`eagledata.text.chat.render_chat`): every message a ``dict`` with a ``str`` role; content
``None``, absent or a ``str`` (a list of parts, as with images, is Jinja's); a ``name`` absent, ``None``
or a ``str``; tool calls absent or a list of ``dict`` calls, each with a ``str`` id and a ``dict``
function that has ``arguments``; a ``str`` ``tool_call_id`` where there is one; a ``reasoning_content``
absent, ``None`` or a ``str``; no template variable but ``tools_ts_str``. Within it each renderer is
the template's own logic (the Jinja source quoted beside the steps that are not plain text), including
what Jinja does with the odd cases: an undefined ``tool_call_id`` renders as nothing, a
``reasoning_content`` of ``None`` as ``None``, a name of ``""`` falls back to the role.

Equal output is checked twice: tests render the recorded traffic and thousands of generated
conversations (plain and not) both ways for every template (tests/test_kimi_templates.py); and each
process checks a renderer against Jinja on probe conversations before it first uses it
(:func:`checked_renderer`); should a Jinja version render one differently, Jinja renders everything,
with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Callable, Mapping, Sequence

from jinja2.sandbox import MAX_RANGE

log = logging.getLogger(__name__)

#: a renderer: (messages, tools, add_generation_prompt, thinking, extra template variables) -> the prompt
#: text, or None where the conversation is not a plain one (see the module's doc)
Renderer = Callable[[Sequence[Any], Any, bool, Any, Mapping[str, Any]], "str | None"]

#: the templates' ``tojson`` and ``tojson(separators=(',', ':'))`` (:func:`eagledata.text.chat._tojson`: ``json.dumps``
#: with ``ensure_ascii=False``), one encoder each: ``json.dumps`` makes one per call with these arguments
_TOJSON = json.JSONEncoder(ensure_ascii=False)
_TOJSON_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
DEFAULT_SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
THINKING_VARIABLES = frozenset({"tools_ts_str"})


def _plain(messages: Sequence[Any]) -> bool:
    """Whether every message is of the shapes the renderers cover (see the module's doc)."""
    for m in messages:
        if type(m) is not dict or type(m.get("role")) is not str:
            return False
        for key in ("content", "name", "reasoning_content"):
            value = m.get(key)
            if value is not None and type(value) is not str:
                return False
        if "tool_call_id" in m and type(m["tool_call_id"]) is not str:
            return False
        calls = m.get("tool_calls")
        if calls:
            if type(calls) is not list:
                return False
            for call in calls:
                if type(call) is not dict or type(call.get("id")) is not str:
                    return False
                function = call.get("function")
                if type(function) is not dict or "arguments" not in function:
                    return False
                arguments = function["arguments"]
                if isinstance(arguments, str) and type(arguments) is not str:
                    return False  # (a str subclass: the template's `is string` and str() are Jinja's to apply)
    return True


def _arguments(call: Mapping[str, Any]) -> str:
    # {% if tool_call['function']['arguments'] is string %}{{ ... }}{% else %}{{ ... | tojson }}{% endif %}
    arguments = call["function"]["arguments"]
    return arguments if type(arguments) is str else _TOJSON.encode(arguments)


def _tool_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    # <|tool_calls_section_begin|>{% for %}<|tool_call_begin|>{{id}}<|tool_call_argument_begin|>{{args}}<|tool_call_end|>
    return ("<|tool_calls_section_begin|>"
            + "".join(f"<|tool_call_begin|>{call['id']}<|tool_call_argument_begin|>{_arguments(call)}<|tool_call_end|>"
                      for call in calls)
            + "<|tool_calls_section_end|>")


def _role(m: Mapping[str, Any]) -> str:
    # {%- set role_name = message.get('name') or message['role'] -%} and the role's header
    role = m["role"]
    name = m.get("name") or role
    if role == "user":
        return f"<|im_user|>{name}<|im_middle|>"
    if role == "assistant":
        return f"<|im_assistant|>{name}<|im_middle|>"
    return f"<|im_system|>{name}<|im_middle|>"


def _tool_return(m: Mapping[str, Any]) -> str:
    # ## Return of {{ message.tool_call_id }}\n{{render_content(message)}}  (undefined: nothing)
    return f"## Return of {m.get('tool_call_id', '')}\n{m.get('content') or ''}"


def render_k2(messages: Sequence[Any], tools: Any, add_generation_prompt: bool, thinking: Any,
              extra: Mapping[str, Any]) -> str | None:
    """Kimi K2 Instruct's template (``thinking`` is not one of its variables)."""
    if extra or not _plain(messages):
        return None
    out = []
    if tools:
        out.append("<|im_system|>tool_declare<|im_middle|>" + _TOJSON_COMPACT.encode(tools) + "<|im_end|>")
    if messages and messages[0]["role"] != "system":  # (loop.first)
        out.append(DEFAULT_SYSTEM + "\n")
    for m in messages:
        out.append(_role(m))
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            out.append((m.get("content") or "") + _tool_calls(m["tool_calls"]))
        elif role == "tool":
            out.append(_tool_return(m))
        else:  # {%- elif message['content'] is not none -%}{{render_content(message)}}: None renders nothing either way
            out.append(m.get("content") or "")
        out.append("<|im_end|>")
    if add_generation_prompt:
        out.append("<|im_assistant|>assistant<|im_middle|>")
    return "".join(out)


def _thinking_family(declares_typescript: bool, default_system: bool, thinking_switch: bool) -> Renderer:
    """K2 Thinking's template (``declares_typescript=False, default_system=True, thinking_switch=False``)
    and K2.5's (the reverse): the history up to the last assistant message without tool calls loses its
    reasoning, the rest keeps it."""

    def render(messages: Sequence[Any], tools: Any, add_generation_prompt: bool, thinking: Any,
               extra: Mapping[str, Any]) -> str | None:
        if not THINKING_VARIABLES.issuperset(extra) or len(messages) > MAX_RANGE or not _plain(messages):
            return None  # (the sandbox's range() refuses more than MAX_RANGE items: Jinja's error then)
        no_thinking = thinking_switch and thinking is False  # thinking is defined and thinking is false
        last = -1
        for idx in range(len(messages) - 1, -1, -1):
            if messages[idx]["role"] == "assistant" and not messages[idx].get("tool_calls"):
                last = idx
                break
        out = []
        if tools:
            declared = extra.get("tools_ts_str") if declares_typescript else None
            if declared:
                out.append(f"<|im_system|>tool_declare<|im_middle|>{declared}<|im_end|>")
            else:
                text = (_TOJSON_COMPACT if declares_typescript else _TOJSON).encode(tools)
                out.append(f"<|im_system|>tool_declare<|im_middle|>{text}<|im_end|>")
        if default_system and (not messages or messages[0]["role"] != "system"):
            out.append(DEFAULT_SYSTEM)
        for idx, m in enumerate(messages):
            out.append(_role(m))
            role = m["role"]
            if role == "assistant":
                if idx <= last or no_thinking:
                    out.append("<think></think>")
                else:  # {%- set rc = message.get('reasoning_content', '') -%}<think>{{rc}}</think>
                    out.append(f"<think>{m.get('reasoning_content', '')}</think>")
                out.append(m.get("content") or "")
                if m.get("tool_calls"):
                    out.append(_tool_calls(m["tool_calls"]))
            elif role == "tool":
                out.append(_tool_return(m))
            else:
                out.append(m.get("content") or "")
            out.append("<|im_end|>")
        if add_generation_prompt:
            out.append("<|im_assistant|>assistant<|im_middle|>")
            if thinking_switch:
                out.append("<think></think>" if no_thinking else "<think>")
        return "".join(out)

    return render


#: SHA-256 of a template's exact text -> its renderer
RENDERERS: dict[str, Renderer] = {
    # shared/tokenizers/kimi-k2-instruct/chat_template.jinja
    "00938c355ca7195fd4f9c923e93af063846d4d5005e06999274f8db57b65bb0b": render_k2,
    # shared/tokenizers/kimi-k2-thinking/chat_template.jinja
    "833d0c375531149a922a0f2addf9a66cce8e4503c500fe4ca6a95e9d1ed3c75a": _thinking_family(declares_typescript=False, default_system=True, thinking_switch=False),
    # shared/tokenizers/kimi-k2.5/chat_template.jinja (and eagledata/data/templates/kimi-k2.5.jinja)
    "82dc16c314f46cefe61b1bf553bc99ee8d48a0f7c057302a3e2762d2416f20d0": _thinking_family(declares_typescript=True, default_system=False, thinking_switch=True),
}


def template_digest(template: str) -> str:
    """The SHA-256 (hex) of a template's text: the key of :data:`RENDERERS`."""
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def renderer_for(template: str) -> Renderer | None:
    """The renderer written for exactly this template's text, or None."""
    return RENDERERS.get(template_digest(template))


def probe_conversations() -> list[tuple[list, list | None, dict[str, Any]]]:
    """(messages, tools, extra template variables) that reach every branch of the renderers, with the
    odd values Jinja has its own way with (an empty name, a ``None`` reasoning, an undefined tool call id,
    arguments that are not a string, special tokens and newlines inside content)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter für 東京",
                                                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    call = {"id": "functions.get_weather:0", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}
    conversations = [
        [],
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo ✓\n\t<|im_end|> x"}],
        [{"role": "system", "content": "S"}, {"role": "user", "name": "bob", "content": "q"},
         {"role": "assistant", "content": "a", "reasoning_content": "r"}, {"role": "user", "content": "q2"}],
        [{"role": "user", "content": "weather?"},
         {"role": "assistant", "content": None, "tool_calls": [
             call, {"id": "c2", "function": {"arguments": {"city": "Ōsaka"}}}, {"id": "", "function": {"arguments": None}}]},
         {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
         {"role": "tool", "content": None},
         {"role": "assistant", "content": "Sunny.", "reasoning_content": None}],
        [{"role": "developer", "content": ""}, {"role": "user", "name": "", "content": None},
         {"role": "assistant", "name": "", "tool_calls": []}, {"role": "user"}],
        [{"role": "user", "content": "go"},
         {"role": "assistant", "content": "x", "reasoning_content": "r1", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "t", "content": "out"},
         {"role": "assistant", "content": "", "reasoning_content": "r2", "tool_calls": [call]}],
        [{"role": "assistant", "content": "first", "name": "kimi"}, {"role": "assistant", "content": "second"}],
    ]
    out: list[tuple[list, list | None, dict[str, Any]]] = []
    for i, messages in enumerate(conversations):
        out.append((messages, None, {}))
        if i % 2:
            out.append((messages, tools, {}))
            out.append((messages, tools, {"tools_ts_str": "# Tools\n\n## functions\nnamespace functions {\n}\n"}))
    return out


def checked_renderer(template: str, jinja: Callable[..., str]) -> Renderer | None:
    """The renderer written for exactly this template's text, once it renders every probe conversation
    (:func:`probe_conversations`, with and without a generation prompt, thinking undefined, off and on)
    as ``jinja(messages, tools, add_generation_prompt, thinking, extra)`` does; else None (with a warning
    where a renderer exists but differs: Jinja renders everything then)."""
    render = renderer_for(template)
    if render is None:
        return None
    for messages, tools, extra in probe_conversations():
        for add_generation_prompt in (True, False):
            for thinking in (None, False, True):
                got = render(messages, tools, add_generation_prompt, thinking, extra)
                if got is not None and got != _or_none(jinja, messages, tools, add_generation_prompt, thinking, extra):
                    log.warning("the Python renderer of chat template %s differs from Jinja on a probe "
                                "conversation: every prompt renders through Jinja", template_digest(template)[:16])
                    return None
    return render


def _or_none(jinja: Callable[..., str], *args: Any) -> str | None:
    """Jinja's rendering, or None where it fails (a probe every template renders: then no renderer is used)."""
    try:
        return jinja(*args)
    except Exception:  # noqa: BLE001 - any failure means the renderer is not proven here
        return None

"""Chat-template rendering compatible with Hugging Face's template environment.

The environment matches what ``apply_chat_template`` gives templates: ``trim_blocks``,
``lstrip_blocks``, the loop-controls extension, a ``tojson`` filter accepting ``ensure_ascii``,
``indent``, ``separators`` and ``sort_keys``, ``raise_exception`` and ``strftime_now``. Prompt ids are
the rendered text encoded with special-token parsing on, as a serving stack does with a template.

Tools are declared the way the model's own tokenizer code declares them (the family's
``tool_declaration``, carried by the loaded tokenizer): ``json`` hands ``tools`` to the template as
given; ``typescript`` (Kimi K2.5, K2 Thinking) deep-sorts them by key and passes the TypeScript-style
declaration as ``tools_ts_str`` too, falling back to the sorted JSON when the declaration cannot
express a schema, exactly as Kimi's ``apply_chat_template`` does.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from eagledata.text.kimi_templates import Renderer, checked_renderer
from eagledata.text.tokenizer import Tokenizer, drop_oldest
from eagledata.text.tool_declaration import ToolDeclarationError, deep_sort, typescript_tool_declaration
from eagledata.errors import EagledataError


class ChatTemplateError(EagledataError):
    pass


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Sequence[str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=tuple(separators) if separators else None, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class _TemplateEnvironment(ImmutableSandboxedEnvironment):
    """Hugging Face's sandbox, with its attribute check remembered per (type, attribute): the check
    (no ``_`` name, no internal attribute of functions/methods/types/frames/generators, no mutating
    method of a list/dict/set/deque) depends on nothing else, and asking it on every ``message.get``
    was a third of the rendering time."""

    _safe: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = self._safe.get(key)
        if safe is None:
            safe = self._safe[key] = super().is_safe_attribute(obj, attr, value)
        return safe


@lru_cache(maxsize=16)
def _compile(template: str):
    env = _TemplateEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    thinking: bool | None = None,
    **extra: Any,
) -> str:
    """Render ``messages`` (and ``tools``) to the prompt text. ``thinking=None`` leaves the
    template's default; ``False`` asks a thinking template for its no-thinking prompt. A Kimi template
    renders in Python where the conversation is a plain one (:mod:`eagledata.text.kimi_templates`: the
    same text), anything else through Jinja."""
    messages, tools = list(messages), list(tools) if tools else None
    native = _native_renderer(template)
    if native is not None:
        text = native(messages, tools, add_generation_prompt, thinking, extra)
        if text is not None:
            return text
    return render_jinja(template, messages, tools, add_generation_prompt, thinking, extra)


def render_jinja(template: str, messages: list, tools: list | None, add_generation_prompt: bool,
                 thinking: bool | None, extra: Mapping[str, Any]) -> str:
    """:func:`render_chat` through Jinja alone (``messages`` and ``tools`` as lists)."""
    kwargs: dict[str, Any] = dict(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **extra)
    if thinking is not None:
        kwargs["thinking"] = thinking
    try:
        return _compile(template).render(**kwargs)
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc


@lru_cache(maxsize=16)
def _native_renderer(template: str) -> Renderer | None:
    """The Python renderer of exactly this template (:mod:`eagledata.text.kimi_templates`), once it has
    rendered the probe conversations as Jinja does here; else None."""
    return checked_renderer(template, lambda *args: render_jinja(template, *args))


def declare_tools(tools: Sequence[Mapping[str, Any]] | None, tool_declaration: str,
                  sort_keys: bool = True) -> tuple[list | None, dict[str, Any]]:
    """(tools, extra template variables) as the model's tokenizer code hands them to the template.
    ``sort_keys=False`` keeps the request's own key order where the model's code deep-sorts it (what a
    provider that skips the model's tokenizer code renders; the ``typescript`` declaration only). A
    TypeScript declaration is made once per distinct tool list (:data:`TYPESCRIPT_DECLARED_KEPT`)."""
    if not tools:
        return None, {}
    if tool_declaration == "json":
        return list(tools), {}
    if tool_declaration != "typescript":
        raise ChatTemplateError(f"unknown tool declaration {tool_declaration!r} (json | typescript)")
    key = (repr(tools), sort_keys)
    declared = _TYPESCRIPT_DECLARED.get(key)
    if declared is None:
        # (a copy: the caller's own objects would be kept, and handed out, with whatever it later did to them)
        declared = _TYPESCRIPT_DECLARED[key] = typescript_declared(copy.deepcopy(tools), sort_keys)
        drop_oldest(_TYPESCRIPT_DECLARED, TYPESCRIPT_DECLARED_KEPT)
    return list(declared[0]), dict(declared[1])


#: Distinct tool lists whose TypeScript declaration is kept (the oldest goes first): a dataset's samples
#: share a few tool lists, and declaring one took a quarter of a K2.5 prompt's rendering. Keyed by the
#: tools' ``repr``, which spells every value of the types a JSON body parses into with its type, in order
#: (a tuple and a list, ``True`` and ``1``, ``1`` and ``1.0``, two key orders all differ): equal keys are
#: equal inputs. The declared tools (made from a copy of the first caller's) are shared between the renderings,
#: which only read them.
TYPESCRIPT_DECLARED_KEPT = 64
_TYPESCRIPT_DECLARED: dict[tuple[str, bool], tuple[list, dict[str, Any]]] = {}


def typescript_declared(tools: Sequence[Mapping[str, Any]], sort_keys: bool = True) -> tuple[list, dict[str, Any]]:
    """What :func:`declare_tools` gives for the ``typescript`` declaration, made anew."""
    tools = deep_sort(list(tools)) if sort_keys else list(tools)
    try:
        declaration = typescript_tool_declaration(tools)
    except ToolDeclarationError:
        declaration = ""  # Kimi's code falls back to the (sorted) JSON in the template
    return tools, ({"tools_ts_str": declaration} if declaration else {})


def tool_declaration_of(tokenizer: Tokenizer) -> str:
    """The tool declaration the tokenizer's model family uses (``json`` when it does not say)."""
    return getattr(tokenizer, "tool_declaration", "json")


def sorts_tool_keys(tool_declaration: str) -> bool:
    """Whether the model's own code deep-sorts the tools by key before declaring them (so a
    rendering in the request's own key order is another prompt): the ``typescript`` declaration."""
    return tool_declaration == "typescript"


def prompt_text(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool | None = None,
    template: str | None = None,
    add_generation_prompt: bool = True,
    tool_declaration: str | None = None,
    sort_tool_keys: bool = True,
) -> str:
    """The rendered prompt text for ``messages``; ``tool_declaration`` overrides the tokenizer's
    (``json`` renders what a provider that ignores the model's tokenizer code renders);
    ``sort_tool_keys=False`` keeps the request's key order (see :func:`declare_tools`)."""
    tmpl = template or tokenizer.chat_template
    if not tmpl:
        raise ChatTemplateError(f"tokenizer {tokenizer.source} has no chat template; set chat_template in the model config")
    declared, extra = declare_tools(tools, tool_declaration or tool_declaration_of(tokenizer), sort_tool_keys)
    return render_chat(tmpl, messages, declared, add_generation_prompt=add_generation_prompt, thinking=thinking, **extra)


def prompt_ids(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool | None = None,
    template: str | None = None,
    add_generation_prompt: bool = True,
    tool_declaration: str | None = None,
    sort_tool_keys: bool = True,
) -> list[int]:
    """Token ids of the prompt the model sees for ``messages`` (see :func:`prompt_text`)."""
    text = prompt_text(tokenizer, messages, tools, thinking, template, add_generation_prompt, tool_declaration,
                       sort_tool_keys)
    return tokenizer.encode_prompt(text)


def request_thinking(request: Mapping[str, Any]) -> bool | None:
    """Whether an OpenRouter request body asked for thinking (``reasoning.enabled``/``effort``).

    ``None`` when the request does not say (the model's default applies)."""
    reasoning = request.get("reasoning")
    if not isinstance(reasoning, Mapping):
        return None
    if reasoning.get("enabled") is False or reasoning.get("effort") == "none":
        return False
    return True

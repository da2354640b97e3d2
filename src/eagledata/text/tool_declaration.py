"""Tool declarations in the TypeScript style of Kimi K2.5 / K2 Thinking (``tools_ts_str``).

Contract: :func:`typescript_tool_declaration` returns, for OpenAI-style ``tools`` already passed
through :func:`deep_sort`, the exact string Kimi's own tokenizer code hands its chat template as
``tools_ts_str``; the template then declares the tools with it instead of compact JSON. A schema the
format cannot express raises :class:`ToolDeclarationError`; Kimi's code then falls back to the JSON
declaration, and so does :func:`eagledata.text.chat.declare_tools`.

The format (reconstructed from the model repository's ``tool_declaration_ts.py``)::

    # Tools

    ## functions
    namespace functions {
    <one block per function, joined by newlines>
    }

A function block is ``[interfaces] [// description] type NAME = (_: PARAMS) => any;``. An object is
``{`` + fields joined by ``,\\n`` + ``}`` (``{}`` when empty), required fields first, each group sorted
by name; a field is its ``//`` comment lines (description, then the allowed constraints as
``// k: v, ...`` sorted by key, then ``// Default: ...``) and ``name?: type``. ``integer`` shows as
``number``; enums as ``"a" | 1 | True``; ``anyOf`` and type lists as ``|`` unions; arrays as
``Array<T>`` (multi-line when the item has comments); ``additionalProperties`` as a
``[k: string]: T`` field; ``$ref: #/$defs/X`` as ``X`` with an ``interface X ...`` block; ``$ref: #``
as ``parameters`` with an ``interface parameters {...}`` block of the root fields in their given order.

Our own code, not a copy: no maintained library renders this model-specific format, and the pipeline
must not import the model repository's remote code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable
from eagledata.errors import EagledataError

__all__ = ["ToolDeclarationError", "deep_sort", "in_deep_sorted_order", "typescript_tool_declaration"]

INDENT = "  "
FIELD_SEPARATOR = ",\n"

# JSON-schema keys shown as constraint comments, per scalar kind.
CONSTRAINT_KEYS = {
    "string": ("maxLength", "minLength", "pattern"),
    "number": ("maximum", "minimum"),
    "integer": ("maximum", "minimum"),
    "array": ("minItems", "maxItems"),
}
# Names of the members of a ``type: [...]`` union.
UNION_MEMBER = {
    "string": "string",
    "number": "number",
    "integer": "number",
    "boolean": "boolean",
    "null": "null",
    "object": "{}",
    "array": "Array<any>",
}


class ToolDeclarationError(EagledataError, ValueError):
    """A tool schema the TypeScript-style declaration cannot express."""


def deep_sort(value: Any) -> Any:
    """``value`` with every mapping's keys sorted, recursively (lists keep their order)."""
    if isinstance(value, dict):
        return {key: deep_sort(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [deep_sort(item) for item in value]
    return value


def in_deep_sorted_order(value: Any) -> bool:
    """Whether every mapping in ``value`` already has its keys in sorted order, recursively: then
    :func:`deep_sort` changes nothing (the same keys in the same order)."""
    if isinstance(value, dict):
        keys = list(value)
        return keys == sorted(keys) and all(in_deep_sorted_order(v) for v in value.values())
    if isinstance(value, list):
        return all(in_deep_sorted_order(item) for item in value)
    return True


def comment(text: str, indent: str = "") -> str:
    """``text`` as ``//`` comment lines; an empty line stays empty (no indent, no slashes)."""
    if not isinstance(text, str):
        raise ToolDeclarationError(f"description must be a string, got {text!r}")
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


@dataclass
class _Type:
    """A parsed schema: how it renders at an indent, and the comments a field of it carries."""

    render: Callable[[str], str]
    description: str = ""
    constraints: dict[str, Any] = field(default_factory=dict)

    def comments(self, indent: str) -> str:
        lines = []
        if self.description:
            lines.append(comment(self.description, indent))
        if self.constraints:
            shown = ", ".join(f"{k}: {v}" for k, v in sorted(self.constraints.items()))
            lines.append(f"{indent}// {shown}")
        return "".join(line + "\n" for line in lines)


@dataclass
class _Field:
    name: str
    type: _Type
    optional: bool
    default: Any = None

    def render(self, indent: str) -> str:
        text = self.type.comments(indent)
        if self.default is not None:
            if isinstance(self.default, (bool, int, float)):
                shown = repr(self.default)
            else:
                shown = json.dumps(self.default, ensure_ascii=False)
            text += f"{indent}// Default: {shown}\n"
        mark = "?" if self.optional else ""
        return f"{text}{indent}{self.name}{mark}: {self.type.render(indent)}"


class _Definitions:
    """``$defs`` seen so far in one function's parameters, and whether ``#`` was referenced."""

    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {}
        self.self_referenced = False

    def add(self, defs: Any) -> None:
        if not defs:
            return
        if not isinstance(defs, dict):
            raise ToolDeclarationError(f"$defs must be an object, got {defs!r}")
        self.schemas.update(defs)

    def name_of(self, ref: Any) -> str:
        if ref == "#":
            self.self_referenced = True
            return "parameters"
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.split("/")[-1]
            if name not in self.schemas:
                raise ToolDeclarationError(f"reference not found: {ref}")
            return name
        raise ToolDeclarationError(f"unsupported reference: {ref!r}")


def _description(schema: dict) -> str:
    return schema.get("description", "")


def _constraints(schema: dict, kind: str) -> dict[str, Any]:
    return {k: v for k, v in schema.items() if k in CONSTRAINT_KEYS.get(kind, ())}


def _scalar(name: str, schema: dict | None = None) -> _Type:
    if not isinstance(name, str):
        raise ToolDeclarationError(f"type must be a string or a list, got {name!r}")
    schema = schema or {}
    shown = "number" if name == "integer" else name
    return _Type(lambda indent: shown, _description(schema), _constraints(schema, name))


def _parse(schema: Any, defs: _Definitions) -> _Type:
    """The :class:`_Type` of one JSON-schema node (the precedence Kimi's code applies)."""
    if isinstance(schema, bool):
        return _scalar("any" if schema else "null")
    if not isinstance(schema, dict):
        raise ToolDeclarationError(f"invalid JSON schema: {schema!r}")
    if "$ref" in schema:
        name = defs.name_of(schema["$ref"])
        return _Type(lambda indent: name, _description(schema))
    if "anyOf" in schema:
        members = [_parse(s, defs) for s in schema["anyOf"]]
        return _Type(lambda indent: " | ".join(m.render(indent) for m in members), _description(schema))
    if "enum" in schema:
        return _enum(schema)
    if "type" in schema:
        kind = schema["type"]
        if isinstance(kind, list):
            return _union(schema)
        if kind == "object":
            return _object(schema, defs)
        if kind == "array":
            return _array(schema, defs)
        return _scalar(kind, schema)
    if schema == {}:
        return _scalar("any")
    raise ToolDeclarationError(f"invalid JSON schema: {schema!r}")


def _enum_type(kind: Any) -> Any:
    if not isinstance(kind, list):
        return kind
    if len(kind) == 1:
        return kind[0]
    if len(kind) == 2 and "null" in kind:
        return kind[0] if kind[0] != "null" else kind[1]
    raise ToolDeclarationError(f"enum type {kind} is not supported")


ENUM_CHECKS = {
    "string": lambda v: isinstance(v, str),
    "number": lambda v: isinstance(v, (int, float)),
    "integer": lambda v: isinstance(v, int),
    "boolean": lambda v: isinstance(v, bool),
}


def _enum(schema: dict) -> _Type:
    values = schema["enum"]
    if not isinstance(values, list):
        raise ToolDeclarationError(f"enum must be a list, got {values!r}")
    if "type" in schema:
        check = ENUM_CHECKS.get(_enum_type(schema["type"]))
        for value in values:
            if value is not None and check is not None and not check(value):
                raise ToolDeclarationError(f"enum value {value!r} is not a {schema['type']}")
    shown = " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in values)
    return _Type(lambda indent: shown, _description(schema))


def _union(schema: dict) -> _Type:
    try:
        members = [UNION_MEMBER[name] for name in schema["type"]]
    except (KeyError, TypeError) as exc:
        raise ToolDeclarationError(f"unsupported type union {schema['type']!r}") from exc
    shown = " | ".join(members)
    return _Type(lambda indent: shown, _description(schema))


def _array(schema: dict, defs: _Definitions) -> _Type:
    item = _parse(schema["items"], defs) if schema.get("items") else _scalar("any")

    def render(indent: str) -> str:
        inner = indent + INDENT
        docs = item.comments(inner)
        if not docs:
            return f"Array<{item.render(indent)}>"
        return f"Array<\n{docs}{inner}{item.render(inner)}\n{indent}>"

    return _Type(render, _description(schema), _constraints(schema, "array"))


def _fields(schema: dict, defs: _Definitions) -> list[_Field]:
    properties = schema.get("properties")
    if properties is None:
        return []
    if not isinstance(properties, dict):
        raise ToolDeclarationError(f"properties must be an object, got {properties!r}")
    required = set(schema.get("required", []))
    return [
        _Field(
            name,
            _parse(prop, defs),
            optional=name not in required,
            default=prop.get("default") if isinstance(prop, dict) else None,
        )
        for name, prop in properties.items()
    ]


def _extra_fields(schema: dict, defs: _Definitions) -> _Type | bool | None:
    extra = schema.get("additionalProperties")
    if extra is None or isinstance(extra, bool):
        return extra
    if isinstance(extra, dict):
        return _parse(extra, defs)
    raise ToolDeclarationError(f"unknown additionalProperties: {extra!r}")


def _object(schema: dict, defs: _Definitions) -> _Type:
    return _object_parts(schema, defs)[0]


def _object_parts(schema: Any, defs: _Definitions) -> tuple[_Type, list[_Field]]:
    """The object type of ``schema`` and its fields in their given order."""
    if not isinstance(schema, dict):
        raise ToolDeclarationError(f"parameters must be an object, got {schema!r}")
    if not schema:
        return _Type(lambda indent: "{}"), []
    if "$defs" in schema:
        defs.add(schema["$defs"])
    extra = _extra_fields(schema, defs)
    fields = _fields(schema, defs)
    ordered = sorted((f for f in fields if not f.optional), key=lambda f: f.name)
    ordered += sorted((f for f in fields if f.optional), key=lambda f: f.name)

    def render(indent: str) -> str:
        inner = indent + INDENT
        lines = [f.render(inner) for f in ordered]
        if extra is not None:
            shown = "any" if extra is True else "never" if extra is False else extra.render(inner)
            lines.append(f"{inner}[k: string]: {shown}")
        if not lines:
            return "{}"
        return "{\n" + FIELD_SEPARATOR.join(lines) + "\n" + indent + "}"

    return _Type(render, _description(schema)), fields


def function_declaration(function: dict) -> str:
    """One function's block: its interfaces, its description comment and its ``type`` line."""
    defs = _Definitions()
    params, fields = _object_parts(function.get("parameters") or {}, defs)
    interfaces = []
    if defs.self_referenced:
        body = FIELD_SEPARATOR.join(f.render(INDENT) for f in fields)
        interfaces.append("interface parameters {" + (f"\n{body}\n" if body else "") + "}")
        signature = "parameters"
    else:
        signature = None
    for name, schema in list(defs.schemas.items()):
        if not isinstance(schema, dict):
            raise ToolDeclarationError(f"$defs.{name} must be an object, got {schema!r}")
        rendered = _parse(schema, defs).render("")
        description = schema.get("description", "")
        head = comment(description) + "\n" if description else ""
        interfaces.append(f"{head}interface {name} {rendered}")
    if signature is None:
        signature = params.render("")
    name = function.get("name", "function")
    description = function.get("description")
    parts = ["\n".join(interfaces), comment(description) if description else "", f"type {name} = (_: {signature}) => any;"]
    return "\n".join(part for part in parts if part)


def typescript_tool_declaration(tools: list[dict[str, Any]] | None) -> str:
    """``tools_ts_str`` for OpenAI-style ``tools`` (call :func:`deep_sort` first, as Kimi's code does).

    Tools of a type other than ``function`` are skipped; with no function left the result is ``""``
    (the template then declares the tools as JSON)."""
    if not tools:
        return ""
    try:
        blocks = [
            function_declaration(tool["function"])
            for tool in tools
            if tool.get("type") == "function" and tool.get("function")
        ]
    except ToolDeclarationError:
        raise
    except (AttributeError, KeyError, TypeError) as exc:  # a malformed tool or schema node
        raise ToolDeclarationError(f"cannot declare tools: {exc!r}") from exc
    if not blocks:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(blocks) + "\n}\n"

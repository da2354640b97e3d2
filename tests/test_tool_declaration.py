"""TypeScript-style tool declarations (K2.5 ``tools_ts_str``): one hand-derived string per feature."""

import pytest

from eagledata.text.chat import declare_tools, prompt_text
from eagledata.text.tool_declaration import ToolDeclarationError, deep_sort, typescript_tool_declaration

HEAD = "# Tools\n\n## functions\nnamespace functions {\n"
TAIL = "\n}\n"


def fn(parameters, name="f", description=None, **extra):
    function = {"name": name, "parameters": parameters, **extra}
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}


def declare(*tools):
    return typescript_tool_declaration(deep_sort(list(tools)))


def body(text):
    return HEAD + text + TAIL


def test_deep_sort_sorts_every_mapping_and_keeps_list_order():
    value = {"b": [{"z": 1, "a": 2}, 3], "a": {"y": 1, "x": 2}}
    out = deep_sort(value)
    assert list(out) == ["a", "b"]
    assert list(out["a"]) == ["x", "y"]
    assert list(out["b"][0]) == ["a", "z"]
    assert out["b"][1] == 3
    assert out == value


def test_required_before_optional_each_sorted_integer_as_number():
    params = {
        "type": "object",
        "properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}, "mid": {"type": "boolean"}, "beta": {"type": "number"}},
        "required": ["zeta", "mid"],
    }
    assert declare(fn(params)) == body(
        "type f = (_: {\n  mid: boolean,\n  zeta: string,\n  alpha?: number,\n  beta?: number\n}) => any;"
    )


def test_function_description_comment_lines_and_empty_line():
    assert declare(fn({}, description="First line.\n\nThird line.")) == body(
        "// First line.\n\n// Third line.\ntype f = (_: {}) => any;"
    )


def test_missing_parameters_is_an_empty_object_and_name_defaults():
    assert declare({"type": "function", "function": {"description": "d"}}) == body("// d\ntype function = (_: {}) => any;")


def test_field_description_constraints_and_defaults():
    params = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "City name", "maxLength": 40, "minLength": 2, "pattern": "^[A-Z]"},
            "days": {"type": "integer", "minimum": 1, "maximum": 7, "default": 3},
            "unit": {"type": "string", "default": "celsius"},
            "flag": {"type": "boolean", "default": False},
            "ratio": {"type": "number", "default": 0.5, "exclusiveMinimum": 0},
            "names": {"type": "array", "items": {"type": "string"}, "default": ["a", "ü"], "minItems": 1, "maxItems": 3},
        },
        "required": ["city"],
    }
    assert declare(fn(params)) == body(
        "type f = (_: {\n"
        "  // City name\n"
        "  // maxLength: 40, minLength: 2, pattern: ^[A-Z]\n"
        "  city: string,\n"
        "  // maximum: 7, minimum: 1\n"
        "  // Default: 3\n"
        "  days?: number,\n"
        "  // Default: False\n"
        "  flag?: boolean,\n"
        "  // maxItems: 3, minItems: 1\n"
        '  // Default: ["a", "ü"]\n'
        "  names?: Array<string>,\n"
        "  // Default: 0.5\n"
        "  ratio?: number,\n"
        '  // Default: "celsius"\n'
        "  unit?: string\n"
        "}) => any;"
    )


def test_nested_objects_indent_and_object_description():
    params = {
        "type": "object",
        "properties": {
            "loc": {
                "type": "object",
                "description": "Where",
                "properties": {"lat": {"type": "number"}, "inner": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
                "required": ["lat"],
            }
        },
        "required": ["loc"],
    }
    assert declare(fn(params)) == body(
        "type f = (_: {\n"
        "  // Where\n"
        "  loc: {\n"
        "    lat: number,\n"
        "    inner?: {\n"
        "      x: number\n"
        "    }\n"
        "  }\n"
        "}) => any;"
    )


def test_arrays_plain_with_item_docs_and_without_items():
    params = {
        "type": "object",
        "properties": {
            "a": {"type": "array", "items": {"type": "integer"}},
            "b": {"type": "array", "items": {"type": "string", "description": "A tag", "maxLength": 5}},
            "c": {"type": "array"},
            "d": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}, "description": "Pair"}},
        },
    }
    assert declare(fn(params)) == body(
        "type f = (_: {\n"
        "  a?: Array<number>,\n"
        "  b?: Array<\n"
        "    // A tag\n"
        "    // maxLength: 5\n"
        "    string\n"
        "  >,\n"
        "  c?: Array<any>,\n"
        "  d?: Array<\n"
        "    // Pair\n"
        "    {\n"
        "      k?: string\n"
        "    }\n"
        "  >\n"
        "}) => any;"
    )


def test_enums_anyof_and_type_unions():
    params = {
        "type": "object",
        "properties": {
            "e": {"type": "string", "enum": ["low", "high"], "description": "Level"},
            "m": {"enum": [1, 2.5, True, None]},
            "n": {"type": ["string", "null"], "enum": ["x", None]},
            "o": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}, {"type": "null"}]},
            "u": {"type": ["integer", "object", "array", "boolean"]},
        },
    }
    assert declare(fn(params)) == body(
        "type f = (_: {\n"
        "  // Level\n"
        '  e?: "low" | "high",\n'
        "  m?: 1 | 2.5 | True | None,\n"
        '  n?: "x" | None,\n'
        "  o?: string | Array<number> | null,\n"
        "  u?: number | {} | Array<any> | boolean\n"
        "}) => any;"
    )


def test_additional_properties_true_false_and_schema():
    params = {
        "type": "object",
        "properties": {
            "any": {"type": "object", "additionalProperties": True},
            "closed": {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False},
            "map": {"type": "object", "additionalProperties": {"type": "integer"}},
        },
    }
    assert declare(fn(params)) == body(
        "type f = (_: {\n"
        "  any?: {\n"
        "    [k: string]: any\n"
        "  },\n"
        "  closed?: {\n"
        "    a?: string,\n"
        "    [k: string]: never\n"
        "  },\n"
        "  map?: {\n"
        "    [k: string]: number\n"
        "  }\n"
        "}) => any;"
    )


def test_boolean_and_empty_schemas():
    params = {"type": "object", "properties": {"t": True, "n": False, "x": {}}}
    assert declare(fn(params)) == body("type f = (_: {\n  n?: null,\n  t?: any,\n  x?: any\n}) => any;")


def test_refs_to_defs_render_interfaces_with_descriptions():
    params = {
        "type": "object",
        "$defs": {
            "Point": {"type": "object", "description": "A point", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]},
            "Color": {"type": "string", "enum": ["red", "blue"]},
        },
        "properties": {"at": {"$ref": "#/$defs/Point", "description": "Where"}, "color": {"$ref": "#/$defs/Color"}},
        "required": ["at"],
    }
    assert declare(fn(params, name="draw")) == body(
        'interface Color "red" | "blue"\n'
        "// A point\n"
        "interface Point {\n"
        "  x: number,\n"
        "  y: number\n"
        "}\n"
        "type draw = (_: {\n"
        "  // Where\n"
        "  at: Point,\n"
        "  color?: Color\n"
        "}) => any;"
    )


def test_self_reference_declares_parameters_interface_in_given_order():
    params = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["name"],
    }
    # deep-sorted properties: children before name; the interface keeps that order (not required-first)
    assert declare(fn(params, name="tree", description="A tree")) == body(
        "interface parameters {\n"
        "  children?: Array<parameters>,\n"
        "  name: string\n"
        "}\n"
        "// A tree\n"
        "type tree = (_: parameters) => any;"
    )


def test_several_functions_and_non_function_tools_skipped():
    tools = [fn({}, name="a"), {"type": "_plugin", "_plugin": {"name": "x"}}, fn({}, name="b")]
    assert declare(*tools) == body("type a = (_: {}) => any;\ntype b = (_: {}) => any;")
    assert declare({"type": "_plugin"}) == ""
    assert typescript_tool_declaration([]) == ""


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#/$defs/Missing"},
        {"$ref": "http://example.com/x"},
        {"type": ["string", "date"]},
        {"type": "string", "enum": ["a", 1]},
        {"enum": ["a"], "type": ["string", "integer", "null"]},
        {"properties": {"a": {"type": "string"}}},
        {"type": "object", "additionalProperties": "yes"},
        "string",
    ],
)
def test_inexpressible_schemas_raise(schema):
    with pytest.raises(ToolDeclarationError):
        declare(fn({"type": "object", "properties": {"p": schema}}))


def test_declare_tools_falls_back_to_sorted_json_when_inexpressible():
    bad = [fn({"type": "object", "properties": {"p": {"$ref": "#/$defs/Missing"}}})]
    tools, extra = declare_tools(bad, "typescript")
    assert extra == {} and tools == deep_sort(bad)
    good = [fn({"type": "object", "properties": {"p": {"type": "string"}}})]
    tools, extra = declare_tools(good, "typescript")
    assert extra["tools_ts_str"] == body("type f = (_: {\n  p?: string\n}) => any;")
    assert declare_tools(good, "json") == (good, {})


def test_each_distinct_tool_list_is_declared_once_and_near_duplicates_keep_their_own(monkeypatch):
    """The same tools again reuse their declaration; tools that differ only in a value's type (1, True,
    1.0) or in key order are declared on their own, each as if declared anew; what a caller changes in
    what it was given is not kept; at most TYPESCRIPT_DECLARED_KEPT lists are kept."""
    from eagledata.text import chat

    made = []
    anew = chat.typescript_declared
    monkeypatch.setattr(chat, "typescript_declared", lambda tools, sort_keys=True: made.append(1) or anew(tools, sort_keys))
    monkeypatch.setattr(chat, "_TYPESCRIPT_DECLARED", {})
    variants = [fn({"type": "object", "properties": {"b": {"type": "integer", "default": default}, "a": {"type": "string"}}})
                for default in (1, True, 1.0)]
    variants.append(fn({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer", "default": 1}}}))
    assert len({repr(anew([v], False)) for v in variants}) == len(variants)  # each is declared differently
    for sort_keys in (True, False):
        for v in variants * 3:
            assert declare_tools([v], "typescript", sort_keys) == anew([v], sort_keys)
    assert len(made) == 2 * len(variants)
    tools, extra = declare_tools(variants[:1], "typescript")
    tools.append("changed")
    extra["tools_ts_str"] = "changed"
    assert declare_tools(variants[:1], "typescript") == anew(variants[:1])
    def mine():
        return [fn({"type": "object", "properties": {"q": {"type": "string"}}}, name="g")]
    given = mine()
    declare_tools(given, "typescript", False)
    given[0]["function"]["name"] = "changed after"  # the kept declaration is not the caller's objects
    assert declare_tools(mine(), "typescript", False) == anew(mine(), False)
    for i in range(chat.TYPESCRIPT_DECLARED_KEPT + 5):
        declare_tools([fn({"type": "object"}, name=f"f{i}")], "typescript")
    assert len(chat._TYPESCRIPT_DECLARED) == chat.TYPESCRIPT_DECLARED_KEPT


def test_k25_template_declares_typescript_instead_of_json(k25):
    tok, _ = k25
    tools = [fn({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, name="weather")]
    messages = [{"role": "user", "content": "hi"}]
    text = prompt_text(tok, messages, tools)
    assert "<|im_system|>tool_declare<|im_middle|>" + body("type weather = (_: {\n  city: string\n}) => any;") + "<|im_end|>" in text
    json_text = prompt_text(tok, messages, tools, tool_declaration="json")
    assert '"name":"weather"' in json_text and "namespace functions" not in json_text

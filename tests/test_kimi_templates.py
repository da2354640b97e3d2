"""The Python renderers of Kimi's chat templates give Jinja's text, or step aside for Jinja."""

import json
import logging
import random
from pathlib import Path

import pytest

from eagledata.text import chat, kimi_templates
from eagledata.text.families import get_family
from eagledata.text.tokenizer import load_tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared"
TOKENIZERS = {"kimi-k2-instruct": "kimi-k2", "kimi-k2-thinking": "kimi-k2-thinking", "kimi-k2.5": "kimi-k2.5"}
RECORDED = SHARED / "recorded" / "openrouter-kimi-k2-0905.jsonl"

pytestmark = pytest.mark.skipif(not RECORDED.exists(), reason="needs ../shared")


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tok(request):
    return load_tokenizer(SHARED / "tokenizers" / request.param, get_family(TOKENIZERS[request.param]))


def both(tok, messages, tools, add_generation_prompt, thinking):
    """(the Python renderer's text or None, Jinja's text or the exception it raised)"""
    declared, extra = chat.declare_tools(tools, chat.tool_declaration_of(tok))
    declared = list(declared) if declared else None
    render = kimi_templates.renderer_for(tok.chat_template)
    got = render(list(messages), declared, add_generation_prompt, thinking, extra)
    try:
        want = chat.render_jinja(tok.chat_template, list(messages), declared, add_generation_prompt, thinking, extra)
    except Exception as exc:  # noqa: BLE001 - compared below
        want = exc
    return got, want


def test_each_shared_kimi_template_has_its_renderer_and_the_demo_copy_too(tok):
    from eagledata.demo.tokenizer import kimi_k25_chat_template

    assert kimi_templates.renderer_for(tok.chat_template) is not None
    assert chat._native_renderer(tok.chat_template) is kimi_templates.renderer_for(tok.chat_template)
    assert kimi_templates.renderer_for(kimi_k25_chat_template()) is not None


def test_the_recorded_requests_render_as_jinja_renders_them(tok):
    requests = [json.loads(line)["request"] for line in RECORDED.open(encoding="utf-8")]
    for req in requests:
        for thinking in (None, False, True):
            for add_generation_prompt in (True, False):
                got, want = both(tok, req["messages"], req.get("tools"), add_generation_prompt, thinking)
                assert got is not None  # every recorded conversation is a plain one
                assert got == want


# a grammar of conversations: the plain shapes and the others, with the values Jinja treats oddly
TEXTS = ["", "hi", "héllo ✓ 東京", "line1\nline2\n", "  spaced  ", "<|im_end|>", "None", "{\"a\": 1}", "## Return of x"]


def _maybe(rng, key, plain, odd, into, absent_is_plain=True):
    """Sets ``into[key]`` to one of the ``plain`` values, or leaves it out; where the conversation may
    have them (``rng.odd``), to one of the ``odd`` ones too."""
    values = plain + (["<absent>"] if absent_is_plain else [])
    if rng.odd:
        values = values + odd + ([] if absent_is_plain else ["<absent>"])
    choice = rng.choice(values)
    if choice != "<absent>":
        into[key] = choice


def _call(rng):
    if rng.odd and rng.random() < 0.02:
        return "not a call"
    call = {}
    _maybe(rng, "id", ["c1", "functions.f:0", ""], [7, None], call, absent_is_plain=False)
    functions = [{"name": "f", "arguments": rng.choice(TEXTS)}, {"arguments": {"x": [1, "ü"]}}, {"arguments": None},
                 {"arguments": 3.5}]
    call["function"] = rng.choice(functions + ([{"name": "f"}, None, "f"] if rng.odd else []))
    return call


def _message(rng):
    if rng.odd and rng.random() < 0.01:
        return ["not", "a", "message"]
    m = {}
    _maybe(rng, "role", ["system", "user", "assistant", "assistant", "tool", "developer"], [1, None], m,
           absent_is_plain=False)
    _maybe(rng, "content", TEXTS + [None], [[{"type": "text", "text": "part"}], 5], m)
    _maybe(rng, "name", ["", "bob", None, "Kimi"], [0, ["n"]], m)
    if m.get("role") == "assistant" or rng.random() < 0.1:
        _maybe(rng, "tool_calls", [None, [], [_call(rng)], [_call(rng), _call(rng)]], ["x", {"id": "c"}], m)
        _maybe(rng, "reasoning_content", ["", "think", None], [3], m)
    if m.get("role") == "tool" or rng.random() < 0.1:
        _maybe(rng, "tool_call_id", ["c1", ""], [None, 9], m)
    return m


def _tools(rng):
    return rng.choice([None, [], [{"type": "function", "function": {"name": "f", "description": "ü \"q\"",
                                                                    "parameters": {"type": "object", "properties": {
                                                                        "b": {"type": "integer"}, "a": {"type": "string"}}}}}],
                       [{"type": "function", "function": {"name": "g"}}, {"type": "function", "function": {"name": "h"}}]])


def test_generated_conversations_render_as_jinja_renders_them_or_go_to_jinja(tok):
    rng = random.Random(20261205)
    native = stepped_aside = 0
    for _ in range(4000):
        rng.odd = rng.random() < 0.5  # half the conversations have only plain values (most of them plain)
        messages = [_message(rng) for _ in range(rng.randrange(0, 7))]
        got, want = both(tok, messages, _tools(rng), rng.random() < 0.7, rng.choice([None, False, True]))
        if got is None:
            stepped_aside += 1
            continue
        native += 1
        assert not isinstance(want, Exception), messages  # a plain conversation Jinja cannot render
        assert got == want, messages
    # both sides of the boundary are exercised
    assert native > 1000 and stepped_aside > 1000, (native, stepped_aside)


def test_what_is_not_a_plain_conversation_goes_to_jinja(tok):
    render = kimi_templates.renderer_for(tok.chat_template)
    image = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}]}]
    assert render(image, None, True, None, {}) is None
    assert chat.render_chat(tok.chat_template, image) == chat.render_jinja(tok.chat_template, image, None, True, None, {})
    for odd in ({"role": "user", "content": "x", "name": 5}, {"role": None, "content": "x"},
                {"role": "tool", "tool_call_id": 3, "content": "x"},
                {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}):
        assert render([odd], None, True, None, {}) is None
    assert render([{"role": "user", "content": "x"}], None, True, None, {"other": 1}) is None

    class Text(str):
        pass

    call = [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": Text('{"a": 1}')}}]}]
    assert render(call, None, True, None, {}) is None
    assert chat.render_chat(tok.chat_template, call) == chat.render_jinja(tok.chat_template, call, None, True, None, {})
    assert '<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|>' in chat.render_chat(tok.chat_template, call)


def test_a_conversation_longer_than_the_sandbox_ranges_goes_to_jinja(tok):
    """The thinking templates walk the messages with range(), which Jinja's sandbox refuses past MAX_RANGE
    items: such a conversation fails there, and the renderer leaves it to Jinja."""
    from jinja2.sandbox import MAX_RANGE

    messages = [{"role": "user", "content": "x"}] * (MAX_RANGE + 1)
    got, want = both(tok, messages, None, True, None)
    if "range(" in tok.chat_template:
        assert got is None and isinstance(want, Exception)
    else:
        assert got == want


def test_a_changed_template_renders_through_jinja():
    tok = load_tokenizer(SHARED / "tokenizers" / "kimi-k2-instruct", get_family("kimi-k2"))
    changed = tok.chat_template.replace("You are Kimi", "You are Kimi!")
    assert kimi_templates.renderer_for(changed) is None and chat._native_renderer(changed) is None
    text = chat.render_chat(changed, [{"role": "user", "content": "hi"}])
    assert "You are Kimi!" in text


def test_a_renderer_that_differs_from_jinja_on_a_probe_is_not_used(tok, monkeypatch, caplog):
    digest = kimi_templates.template_digest(tok.chat_template)
    right = kimi_templates.RENDERERS[digest]

    def wrong(messages, tools, add_generation_prompt, thinking, extra):
        text = right(messages, tools, add_generation_prompt, thinking, extra)
        # one probe only: a tool return without its id
        return text.replace("## Return of \n", "## Return of None\n") if text is not None else None

    monkeypatch.setitem(kimi_templates.RENDERERS, digest, wrong)
    chat._native_renderer.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert chat._native_renderer(tok.chat_template) is None
        assert "differs from Jinja" in caplog.text
        messages = [{"role": "tool", "content": "x"}]
        assert chat.render_chat(tok.chat_template, messages) == chat.render_jinja(tok.chat_template, messages, None, True, None, {})
        assert "## Return of \n" in chat.render_chat(tok.chat_template, messages)
    finally:
        chat._native_renderer.cache_clear()


def test_render_chat_uses_the_renderer(tok, monkeypatch):
    digest = kimi_templates.template_digest(tok.chat_template)
    right = kimi_templates.RENDERERS[digest]
    calls = []

    def counted(*args):
        calls.append(args[0])
        return right(*args)

    monkeypatch.setitem(kimi_templates.RENDERERS, digest, counted)
    chat._native_renderer.cache_clear()
    try:
        messages = [{"role": "user", "content": "hi"}]
        assert chat._native_renderer(tok.chat_template) is counted  # (its probes checked first)
        before = len(calls)
        chat.render_chat(tok.chat_template, messages)
        assert len(calls) == before + 1 and calls[-1] == messages
    finally:
        chat._native_renderer.cache_clear()

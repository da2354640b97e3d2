"""The compiled core of the stream reading (eagledata/tokens/chunkscan.c) returns what the Python
reading returns, or declines; it is built where a C compiler is, and used only from its own source."""
import hashlib
import json
import random
import shutil
import sysconfig
from pathlib import Path

import pytest

from eagledata.tokens import chunk_templates
from eagledata.tokens.chunk_templates import learn_chunk_template

SOURCE = Path(chunk_templates.__file__).with_name("chunkscan.c")


def _compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc)


def test_the_module_expects_the_source_beside_it():
    assert chunk_templates.NATIVE_SOURCE_SHA256 == hashlib.sha256(SOURCE.read_bytes()).hexdigest()


@pytest.mark.skipif(_compiler() is None, reason="no C compiler: the package reads streams in Python")
def test_the_core_is_built_and_used_where_a_compiler_is():
    assert chunk_templates._NATIVE_MATCH is not None


def test_a_module_built_from_another_source_is_not_used(monkeypatch):
    chunkscan = pytest.importorskip("eagledata.tokens.chunkscan")
    monkeypatch.setattr(chunkscan, "SOURCE_SHA256", "0" * 64)
    assert chunk_templates._native_matcher() is None
    monkeypatch.undo()
    assert chunk_templates._native_matcher() is chunkscan.match_template_lines


TEXTS = ["plain", "", " ", ' "quoted" ', "back\\slash\\", '"content":"x"', '","content":"', "line\nbreak", "tab\t\x01",
         "sep\u2028arator", "nel\u0085", "é ü", "漢字", "🙂 astral", "\x7f", "\\u0041", "\\", "\u00ff", "/"]
SHAPES = [{"content": None}, {"reasoning": None, "content": ""}, {"content": "", "reasoning_content": None},
          {"reasoning": None, "reasoning_details": [{"type": "reasoning.text", "text": None}]}]


def _chunk(shape, texts):
    delta = {"role": "assistant"}
    it = iter(texts)
    for key, value in shape.items():
        delta[key] = [{**value[0], "text": next(it)}] if isinstance(value, list) else next(it)
    return {"id": "gen-1", "provider": "P", "model": "m", "object": "chat.completion.chunk", "created": 7,
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def _fields(shape):
    kinds = {"content": "content", "reasoning": "reasoning", "reasoning_content": "reasoning"}
    out = {k: kinds[k] for k in shape if k in kinds}
    if "reasoning_details" in shape:
        out["text"] = "details"
    return out


MUTATIONS = [
    lambda line, r: line,
    lambda line, r: line.replace('\\"', '"', 1),  # an escaped quote unescaped: two tokens
    lambda line, r: line.replace('"content": "', '"content": "\\x', 1),  # an invalid escape
    lambda line, r: line.replace('"content": "', '"content": "\\ud800', 1),  # a lone high surrogate
    lambda line, r: line.replace('"content": "', '"content": "\\udc00x', 1),  # a lone low surrogate
    lambda line, r: line.replace('"content": "', '"content": "\\ud83d\\ude00', 1),  # a pair
    lambda line, r: line.replace('"content": "', '"content": "\ud800', 1),  # a raw surrogate
    lambda line, r: line.replace('"content": "', '"content": "\x1f', 1),  # a raw control character
    lambda line, r: line.replace('"content": "', '"content": "\\u12', 1),  # a short \\u escape
    lambda line, r: line.replace('"content": "', '"content": "x\\\\"', 1),  # an escaped backslash ends a token early
    lambda line, r: line.replace('"content": "', '"content": "\\', 1),  # a backslash escaping what follows
    lambda line, r: line[:r.randint(0, len(line))],  # cut anywhere
    lambda line, r: line.replace(", ", ",", 1),  # other literals
    lambda line, r: line.replace('"content": ', '"content": 1, "x": ', 1),  # a number before the hole
    lambda line, r: line + " ",
]


def _lines(rng, shape, dumps):
    lines = []
    for _ in range(rng.randint(0, 30)):
        line = "data: " + dumps(_chunk(shape, [rng.choice(TEXTS) for _ in shape]))
        if rng.random() < 0.15:
            line = rng.choice(MUTATIONS)(line, rng)
        lines.append(line if rng.random() < 0.8 else rng.choice(["", ": keep-alive", "data: [DONE]"]))
    return lines


def test_the_core_returns_what_the_python_reading_returns_or_declines():
    """Random template lines, some mutated (escapes, surrogates, control characters, two tokens in a
    hole, cut lines, other literals), in every string width: where the core returns, the Python
    reading returns the same; where the Python reading refuses (an invalid escape), the core declines."""
    match = chunk_templates._native_matcher()
    if match is None:
        pytest.skip("the compiled core is not built here")
    rng = random.Random(5)
    returned = declined = 0
    for trial in range(3000):
        shape = SHAPES[trial % len(SHAPES)]
        dumps = json.dumps if trial % 3 else (lambda o: json.dumps(o, ensure_ascii=False))
        payload = dumps(_chunk(shape, ["a"] * len(shape)))
        template = learn_chunk_template(payload, json.loads(payload), _fields(shape))
        assert template is not None, payload
        lines = _lines(rng, shape, dumps)
        start, end = rng.randint(0, 2), len(lines) - rng.randint(0, 2)
        head, tail = "data: " + template.literals[0], template.literals[-1]
        fast = match(lines, start, end, head + '"', '"' + tail, template.literals[1:-1])
        try:
            slow = template._match_in_python(lines, start, end, head, tail)
        except ValueError:
            assert fast is None, (trial, lines)
            declined += 1
            continue
        if fast is None:
            declined += 1
        else:
            returned += 1
            assert fast == slow, (trial, lines)
            assert template.match_lines(lines, start, end) == slow
    assert returned > 1000 and declined > 100, (returned, declined)

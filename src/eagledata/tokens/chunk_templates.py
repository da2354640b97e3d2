"""Text-only stream chunks read without parsing them: a stream's chunk template.

A streamed answer of 3,000 tokens is about 1,000 ``data:`` lines that differ only in one text
value (``delta.content``, ``delta.reasoning``...). Turning each into Python objects was most of
the tokens stage's time on drafter-sized samples. A :class:`ChunkTemplate` is one such line cut at
its text values: the literal JSON around them (``literals``) and what each value is (``kinds``).
:meth:`ChunkTemplate.match_lines` finds the lines of a stream that are ``data: `` and the same
literals around one JSON string token per hole, and returns those raw tokens; only they are decoded
(all of a stream's in one parse).

Why a matched line means the template's chunk with other text values: JSON is lexed left to right.
The line's payload starts with the template line's first literal, so it is lexed the same up to
the first hole, where the lexer stands outside any string (the template line's hole starts a string
there). The hole is exactly one string token (the lexer ends a string at the first unescaped quote,
as the pattern does), so the lexer stands outside a string again where the next literal starts,
and so on to the end. The line's tokens are the template line's with other string tokens at the
holes, so its parse is the template line's parse with other values there. Escapes inside a hole
are checked when the holes are decoded (an invalid one fails the decode).

:func:`learn_chunk_template` learns a template from a line parsed in full. It refuses a line where
any key occurs twice in one object (the parse keeps one of them, however each is spelled:
the line then has more keys than its parse) or a text value's key occurs more than once anywhere (so
the key's raw token is the parsed key), and checks
its work once: the line with every hole emptied must parse to the chunk with those values emptied.

Written here rather than taken from a library: JSON libraries (orjson, msgspec) parse whole
documents, and building those documents' objects is the cost this avoids. The matching has a
compiled core (``chunkscan.c``, built by ``pip install`` where a C compiler is found): it returns
what :meth:`ChunkTemplate.match_lines` returns or declines (then the Python reading below runs),
and it is used only when built from the source this module expects (:data:`NATIVE_SOURCE_SHA256`).
"""

from __future__ import annotations

import functools
import itertools
import operator
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from eagledata.io import loads_json

#: The sha256 of ``chunkscan.c`` this module was written for (tests/test_chunkscan.py checks it): a
#: compiled module built from another source (left by an older install) is not used.
NATIVE_SOURCE_SHA256 = "fef69c25c948af8da53b89ebaea86e403cf38422e94a207b1040ac1c8405dff9"


def _native_matcher() -> Any:
    """``chunkscan.match_template_lines`` when that module is built from the expected source, else None."""
    try:
        from eagledata.tokens import chunkscan
    except ImportError:
        return None
    return chunkscan.match_template_lines if chunkscan.SOURCE_SHA256 == NATIVE_SOURCE_SHA256 else None


_NATIVE_MATCH = _native_matcher()


def native_stream_reading() -> bool:
    """Whether streams are read through the compiled core (else in Python only, with the same results)."""
    return _NATIVE_MATCH is not None

# One JSON string token as it appears raw: it ends at the first quote not escaped by a backslash.
# Control characters (line breaks among them) are not JSON inside a string; the decode would refuse
# them, and the holes of many lines are checked joined by line breaks.
_STRING = r'"[^"\\\x00-\x1f]*(?:\\[^\x00-\x1f][^"\\\x00-\x1f]*)*"'
_STRING_TOKEN = re.compile(_STRING)
_JSON_SPACE = " \t\r\n"


@functools.lru_cache(maxsize=64)
def _middle_patterns(inner: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern]:
    """What lies between a template line's first and last literal: one string token per hole with
    the ``inner`` literals between them, as one line (holes captured) and as one of many lines
    joined by line breaks. The inner literals are the same in every stream (keys, not ids), so
    these are compiled once."""
    middle = "".join(f"({_STRING}){re.escape(lit)}" for lit in inner) + f"({_STRING})"
    return re.compile(middle), re.compile(middle + "\n")


@dataclass(frozen=True)
class ChunkTemplate:
    """A chunk line cut at its text values: ``literals[0] hole literals[1] ... hole literals[-1]``;
    ``kinds[i]`` names what hole ``i`` holds."""

    literals: tuple[str, ...]
    kinds: tuple[str, ...]

    def match_lines(self, lines: Sequence[str], start: int, end: int) -> tuple[list[int], list[list[str]]]:
        """The indices of the lines in ``lines[start:end]`` that are ``data: `` lines of this
        template, each being ``data: `` and the literals around one JSON string token per hole, and
        those strings decoded, hole by hole (``texts[h][j]`` is hole ``h`` of the ``j``-th matched
        line). Raises ``ValueError`` when a matched token does not decode (an invalid escape)."""
        head, tail = "data: " + self.literals[0], self.literals[-1]
        if _NATIVE_MATCH is not None and type(lines) is list:
            matched_natively = _NATIVE_MATCH(lines, start, end, head + '"', '"' + tail, self.literals[1:-1])
            if matched_natively is not None:
                return matched_natively
        return self._match_in_python(lines, start, end, head, tail)

    def _match_in_python(self, lines: Sequence[str], start: int, end: int, head: str,
                         tail: str) -> tuple[list[int], list[list[str]]]:
        """:meth:`match_lines` without the compiled core (which returns the same or declines)."""
        head_q, q_tail = head + '"', '"' + tail
        segment = lines[start:end]
        at_head = list(map(str.startswith, segment, itertools.repeat(head_q)))
        found = list(itertools.compress(range(start, end), at_head))
        matched = list(itertools.compress(segment, at_head))
        at_tail = list(map(str.endswith, matched, itertools.repeat(q_tail)))
        if not all(at_tail):
            found, matched = list(itertools.compress(found, at_tail)), list(itertools.compress(matched, at_tail))
        cut = slice(len(head), -len(tail) if tail else None)
        middles = list(map(operator.getitem, matched, itertools.repeat(cut)))
        texts = _strings_at_holes(middles, self.literals[1:-1])
        if texts is not None:
            return found, texts
        return self._match_each(found, middles)

    def _match_each(self, found: list[int], middles: list[str]) -> tuple[list[int], list[list[str]]]:
        """:meth:`match_lines` for ``middles`` (the matched lines between the first and last
        literal) one pattern match each: the lines that hold something else at a hole are left out."""
        one, joined = _middle_patterns(self.literals[1:-1])
        width = len(self.kinds) + 1
        parts = joined.split("\n".join(middles) + "\n") if middles else [""]
        if len(parts) == len(middles) * width + 1 and not any(parts[0::width]):
            found, holes = found, [parts[h::width] for h in range(1, width)]
        else:  # some line is not (rare): check each
            matches = [one.fullmatch(m) for m in middles]
            kept = [(i, m.groups()) for i, m in zip(found, matches) if m is not None]
            found, holes = [i for i, _ in kept], [[g[h] for _, g in kept] for h in range(width - 1)]
        raw = [token for hole in holes for token in hole]
        decoded = loads_json("[" + ",".join(raw) + "]") if raw else []
        n = len(found)
        return found, [decoded[h * n:(h + 1) * n] for h in range(width - 1)]


def _strings_at_holes(middles: list[str], inner: tuple[str, ...]) -> list[list[str]] | None:
    """The decoded strings of ``middles`` hole by hole when every middle is one JSON string token
    per hole with the ``inner`` literals between them; ``None`` when that is not proven (the caller
    then matches each line). One parse of them all, no pattern match: each middle is cut at the
    inner literals into pieces, and the pieces, each starting with a quote and ending with a quote
    that no backslash precedes, are parsed as one array ``[p1,p2,...]``. In that text every such
    first quote follows ``[`` or ``,`` and every such last quote follows no backslash, so all of them
    are unescaped, and they are 2 per piece; an array of exactly as many strings as pieces has
    exactly 2 unescaped quotes per string and no other, so each piece is exactly one string token
    (wherever a cut fell, the middle is then those tokens with the inner literals between them)."""
    if not middles:
        return [[] for _ in range(len(inner) + 1)]
    pieces = middles if not inner else _cut_at(middles, inner)
    if pieces is None or min(map(len, pieces)) < 2 or any(map(str.endswith, pieces, itertools.repeat('\\"'))) \
            or not all(map(str.startswith, pieces, itertools.repeat('"'))) \
            or not all(map(str.endswith, pieces, itertools.repeat('"'))):
        return None
    try:
        decoded = loads_json("[" + ",".join(pieces) + "]")
    except ValueError:
        return None
    if len(decoded) != len(pieces) or set(map(type, decoded)) != {str}:
        return None
    width = len(inner) + 1
    return [decoded[h::width] for h in range(width)]


def _cut_at(middles: list[str], inner: tuple[str, ...]) -> list[str] | None:
    """Every middle cut at the first occurrences of the ``inner`` literals in turn, the pieces in
    order; ``None`` when a middle lacks one."""
    pieces: list[str] = []
    for middle in middles:
        for literal in inner:
            piece, sep, middle = middle.partition(literal)
            if not sep:
                return None
            pieces.append(piece)
        pieces.append(middle)
    return pieces


def learn_chunk_template(payload: str, chunk: Any, fields: Mapping[str, str]) -> ChunkTemplate | None:
    """The template of ``payload`` (whose parse is ``chunk``) with a hole at the string value of
    each key in ``fields`` (key -> kind); ``None`` when one of them occurs more than once anywhere in
    the chunk, its raw token is spelled with escapes, or its value is not a string token, when the line
    repeats a key in one object, or when the chunk is nested too deeply to walk."""
    try:
        return _learn(payload, chunk, fields)
    except RecursionError:  # a chunk nested deeper than these walks go (the plain reading reads it)
        return None


def _learn(payload: str, chunk: Any, fields: Mapping[str, str]) -> ChunkTemplate | None:
    counts: dict[str, int] = {}
    _count_keys(chunk, counts)
    if not fields or any(counts.get(key) != 1 for key in fields):
        return None
    spans: dict[str, tuple[int, int]] = {}
    tokens = list(_STRING_TOKEN.finditer(payload))
    raw_keys = 0  # the string tokens followed by a colon: the line's keys, as written
    for i, token in enumerate(tokens):
        following = payload[token.end():tokens[i + 1].start() if i + 1 < len(tokens) else len(payload)]
        if following.lstrip(_JSON_SPACE).startswith(":"):
            raw_keys += 1
            if token.group()[1:-1] in fields and i + 1 < len(tokens) and following.strip(_JSON_SPACE) == ":":
                spans[token.group()[1:-1]] = tokens[i + 1].span()
    # a key the parse dropped (a later duplicate in the same object, however spelled) leaves more keys
    # in the line than in its parse: where the holes' values land is then not what the line says
    if len(spans) != len(fields) or raw_keys != sum(counts.values()):
        return None
    order = sorted(spans, key=lambda k: spans[k][0])
    cuts = [0] + [i for k in order for i in spans[k]] + [len(payload)]
    template = ChunkTemplate(tuple(payload[a:b] for a, b in zip(cuts[0::2], cuts[1::2])),
                             tuple(fields[k] for k in order))
    expected = loads_json(payload)  # the chunk again, to change (a parse is cheaper than a deep copy)
    _empty_values(expected, fields)
    try:
        if loads_json('""'.join(template.literals)) != expected:
            return None
    except ValueError:
        return None
    return template


def _count_keys(obj: Any, counts: dict[str, int]) -> None:
    if isinstance(obj, dict):
        for key, value in obj.items():
            counts[key] = counts.get(key, 0) + 1
            _count_keys(value, counts)
    elif isinstance(obj, list):
        for value in obj:
            _count_keys(value, counts)


def _empty_values(obj: Any, keys: Mapping[str, str]) -> None:
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in keys:
                obj[key] = ""
            else:
                _empty_values(value, keys)
    elif isinstance(obj, list):
        for value in obj:
            _empty_values(value, keys)

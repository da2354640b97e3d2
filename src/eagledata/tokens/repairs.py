"""Repairs with evidence: undo a provider's known text transformation only when the billed counts
single it out.

Known transformations and their inverses:

* ``whitespace_restored``: the provider stripped a leading space of reasoning or content (one
  candidate per segment: a space put back);
* ``tool_arguments_respaced``: the provider re-serialized tool-call arguments as compact JSON
  (candidate: the arguments re-serialized with the model's usual ``", "`` / ``": "`` spacing).

(Rewritten tool-call ids and tool markup leaked into text are undone during reconstruction; their
ids are structurally determined, so they need no search.)

Counts cannot see key order: a provider that re-serializes arguments with sorted keys (Go's maps,
Rust's ``BTreeMap``, ``json.dumps(sort_keys=True)``) bills the model's order and returns another with
the same token count. A respacing repair proves its provider re-serialized the arguments, so it is
chosen only where :func:`key_order_in_question` says the order cannot be a sorter's;
:func:`shows_key_order_kept` tells the samples proving a provider does not sort (learned as
:data:`KEY_ORDER_KEPT`, like a transformation).

:func:`search_repairs` builds every candidate the applicable transformations allow (each non-empty
combination) and accepts one only when it is the *unique* candidate that matches every billed count
(completion under the provider's convention, reasoning where reported). Two or more matching
candidates are ``ambiguous``: the sample stays a mismatch. The evidence (every candidate and its
count differences) is returned for the record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from itertools import combinations, product
from typing import Any, Mapping, Sequence

from eagledata.tokens.checks import EXCLUDES_EOT
from eagledata.text.families import ModelFamily
from eagledata.tokens.reconstruct import Reconstruction, reconstruct_completion
from eagledata.tokens.responses import ParsedResponse, ToolCall
from eagledata.text.tokenizer import Tokenizer

WHITESPACE_REASONING = "whitespace_restored:reasoning"
WHITESPACE_CONTENT = "whitespace_restored:content"
ARGUMENTS_RESPACED = "tool_arguments_respaced"


@dataclass
class RepairResult:
    status: str  # unique | ambiguous | none | not_applicable
    chosen: Reconstruction | None = None
    transforms: tuple[str, ...] = ()
    evidence: list[dict[str, Any]] = field(default_factory=list)

    @property
    def reason_codes(self) -> list[str]:
        codes = []
        if any(t.startswith("whitespace_restored") for t in self.transforms):  # labels carry the prefix
            codes.append("whitespace_restored")
        if any(t.startswith(ARGUMENTS_RESPACED) for t in self.transforms):
            codes.append("tool_arguments_respaced")
        return codes


def parsed_from_segments(segments: list[Mapping[str, Any]], finish_reason: str | None) -> ParsedResponse:
    """The provider message as reconstruction saw it, rebuilt from a token-shard row's segments."""
    reasoning = "".join(s.get("text", "") for s in segments if s["kind"] == "reasoning")
    content = "".join(s.get("text", "") for s in segments if s["kind"] == "content")
    calls: dict[int, ToolCall] = {}
    for s in segments:
        if s["kind"] in ("tool_id", "tool_arguments"):
            call = calls.setdefault(s["call"], ToolCall(None, "", "", s["call"]))
            if s["kind"] == "tool_id":
                call.id = s.get("text", "")
            else:
                call.arguments = s.get("text", "")
        elif s["kind"] == "tool_call_begin":
            calls.setdefault(s["call"], ToolCall("", "", "", s["call"]))
    return ParsedResponse(streamed=False, reasoning=reasoning or None, content=content or None,
                          tool_calls=[calls[i] for i in sorted(calls)], finish_reason=finish_reason)


#: Integers beyond this lose digits in a re-serializer that reads numbers as doubles (JavaScript):
#: ``12345678901234567890`` comes back ``12345678901234567000``, most likely with the same count.
EXACT_DOUBLE_INTEGERS = 2 ** 53


def _respaced(arguments: str) -> str | None:
    """The arguments as the model spaces JSON, or ``None`` when there is nothing to respace or the
    respacing could not be proven to change only whitespace: a number with a fraction or an
    exponent (``19.90``, ``1e3``) is spelled by whoever serialized it last, so the model's digits
    cannot be recovered from a re-serialized text (and ``19.90`` and ``19.9`` may count alike); an
    integer beyond :data:`EXACT_DOUBLE_INTEGERS` may have lost its last digits."""
    spelled: list[str] = []

    def integer(text: str) -> int:
        if abs(int(text)) > EXACT_DOUBLE_INTEGERS:
            spelled.append(text)
        return int(text)
    try:  # a provider's arguments: nested too deeply for the standard library is no JSON to respace
        value = json.loads(arguments, parse_float=lambda text: spelled.append(text) or float(text), parse_int=integer)
        spaced = json.dumps(value, ensure_ascii=False)
    except (ValueError, RecursionError):
        return None
    return spaced if spaced != arguments and not spelled else None


#: A provider's behaviour learned like a transformation: at least ``MIN_REPAIR_EVIDENCE`` samples
#: whose returned arguments show keys in an order no known re-serializer produces
#: (:func:`shows_key_order_kept`). Only then is a sorted key order in a respaced repair taken as the model's.
KEY_ORDER_KEPT = "key_order_kept"


def _objects_key_orders(arguments: str) -> list[list[str]] | None:
    """The key order of every JSON object in ``arguments`` (nested ones included), or ``None`` when
    the arguments are no JSON."""
    orders: list[list[str]] = []

    def pairs(items: list[tuple[str, Any]]) -> dict:
        orders.append([k for k, _ in items])
        return dict(items)
    try:
        json.loads(arguments, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return None
    return orders


def _telling(keys: list[str]) -> bool:
    """Whether an object's key order is one no known re-serializer produces from another order: not
    sorted (Go, Rust, ``sort_keys``) and without integer-like keys (JavaScript moves those first)."""
    return len(keys) >= 2 and keys != sorted(keys) and not any(k.isdigit() for k in keys)


def _calls_key_orders(parsed: ParsedResponse) -> list[list[str]]:
    return [keys for c in parsed.tool_calls for keys in (_objects_key_orders(c.arguments) or [])]


def shows_key_order_kept(parsed: ParsedResponse) -> bool:
    """Whether the returned arguments prove their provider kept the model's key order this time:
    some object has keys in a :func:`_telling` order (a sorting re-serializer sorts every object)."""
    return any(_telling(keys) for keys in _calls_key_orders(parsed))


def key_order_in_question(parsed: ParsedResponse, order_kept: bool) -> bool:
    """Whether re-serialized tool-call arguments could be a reordering of the model's keys that the
    counts cannot see: some object has two or more keys, none is in a :func:`_telling` order, and
    the provider is not proven to keep key order (``order_kept``: :data:`KEY_ORDER_KEPT` learned)."""
    orders = [keys for keys in _calls_key_orders(parsed) if len(keys) >= 2]
    return bool(orders) and not order_kept and not any(_telling(keys) for keys in orders)


#: What a leading-whitespace strip may have removed. Every one is a candidate, so a count that
#: several prefixes explain is ambiguous instead of a guess.
WHITESPACE_PREFIXES = (" ", "\n", "\n\n", "  ")


class SampleCandidates:
    """What every repair search of one sample (``parsed``) shares, worked out once however many
    searches ask (a sample is searched for each transformation alone, then for its provider's known
    ones): the respaced tool-call arguments, the transformations that apply, and the encoding of each
    distinct text segment (candidates share every segment their transformations leave unchanged)."""

    def __init__(self, parsed: ParsedResponse):
        self.parsed = parsed
        #: per tool call, its arguments as the model spaces JSON (:func:`_respaced`; None: nothing to respace)
        self.respaced = [_respaced(c.arguments) for c in parsed.tool_calls]
        applicable = []
        if parsed.reasoning and not parsed.reasoning[0].isspace():
            applicable.append(WHITESPACE_REASONING)
        if parsed.content and not parsed.content[0].isspace():
            applicable.append(WHITESPACE_CONTENT)
        if any(r is not None for r in self.respaced):
            applicable.append(ARGUMENTS_RESPACED)
        self.applicable = applicable
        self._encodings: dict[str, list[int]] = {}

    def transformed(self, transforms: tuple[str, ...], prefixes: Mapping[str, str] | None = None) -> ParsedResponse:
        """:func:`apply_transforms` of the sample."""
        return apply_transforms(self.parsed, transforms, prefixes, self.respaced)

    def tokenizer(self, tokenizer: Tokenizer) -> "_SharedEncodings":
        """``tokenizer`` encoding each distinct plain text once for this sample's candidates."""
        return _SharedEncodings(tokenizer, self._encodings)


class _SharedEncodings:
    """A tokenizer whose :meth:`encode_plain` keeps what it encoded in ``encodings`` (text -> ids, shared
    and never changed: a reconstruction copies ids into its own list); everything else is the tokenizer's."""

    def __init__(self, tokenizer: Tokenizer, encodings: dict[str, list[int]]):
        self._tokenizer = tokenizer
        self._encodings = encodings
        self.special_id = tokenizer.special_id

    def encode_plain(self, text: str) -> list[int]:
        ids = self._encodings.get(text)
        if ids is None:
            ids = self._encodings[text] = self._tokenizer.encode_plain(text)
        return ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def _variants(transform: str) -> tuple[str, ...]:
    return WHITESPACE_PREFIXES if transform.startswith("whitespace_restored") else ("",)


def apply_transforms(parsed: ParsedResponse, transforms: tuple[str, ...], prefixes: Mapping[str, str] | None,
                     respaced: Sequence[str | None]) -> ParsedResponse:
    """``parsed`` with the inverse transformations applied; ``prefixes`` gives the whitespace put
    back per whitespace transform (default one space); ``respaced``: each tool call's
    :func:`_respaced` arguments (:attr:`SampleCandidates.respaced`)."""
    prefixes = prefixes or {}
    p = replace(parsed, tool_calls=list(parsed.tool_calls))
    if WHITESPACE_REASONING in transforms:
        p.reasoning = prefixes.get(WHITESPACE_REASONING, " ") + (p.reasoning or "")
    if WHITESPACE_CONTENT in transforms:
        p.content = prefixes.get(WHITESPACE_CONTENT, " ") + (p.content or "")
    if ARGUMENTS_RESPACED in transforms:
        p.tool_calls = [replace(c, arguments=r or c.arguments) for c, r in zip(p.tool_calls, respaced)]
    return p


def counts_match(rc: Reconstruction, billed_completion: int | None, billed_reasoning: int | None,
                 convention: str) -> tuple[bool, int | None]:
    """(all billed counts match, completion diff) for a candidate reconstruction."""
    if billed_completion is None:
        return False, None
    ours = len(rc.ids) - (1 if convention == EXCLUDES_EOT and rc.stopped else 0)
    diff = ours - billed_completion
    reasoning_ok = not billed_reasoning or billed_reasoning in (rc.reasoning_tokens, rc.reasoning_tokens + 1)
    return diff == 0 and reasoning_ok, diff


def search_repairs(
    parsed: ParsedResponse | SampleCandidates,
    tokenizer: Tokenizer,
    family: ModelFamily,
    billed_completion: int | None,
    billed_reasoning: int | None,
    convention: str,
    thinking: bool | None = None,
    only: tuple[str, ...] | None = None,
) -> RepairResult:
    """Try every combination of the applicable inverse transformations (restricted to ``only``
    when given); accept the unique candidate matching every billed count. ``parsed``: the sample's
    answer, or its :class:`SampleCandidates` where it is searched more than once."""
    sample = parsed if isinstance(parsed, SampleCandidates) else SampleCandidates(parsed)
    options = [t for t in sample.applicable if only is None or t in only]
    if not options or billed_completion is None or convention not in ("counts_eot", EXCLUDES_EOT):
        return RepairResult("not_applicable")
    evidence, matching = [], []
    encoder = sample.tokenizer(tokenizer)
    for r in range(1, len(options) + 1):
        for combo in combinations(options, r):
            for variant in product(*(_variants(t) for t in combo)):
                prefixes = {t: v for t, v in zip(combo, variant) if v}
                rc = reconstruct_completion(sample.transformed(combo, prefixes), encoder, family, 0, thinking)
                ok, diff = counts_match(rc, billed_completion, billed_reasoning, convention)
                label = [f"{t}={prefixes[t]!r}" if t in prefixes else t for t in combo]
                evidence.append({"transforms": label, "completion_diff": diff, "reasoning_tokens": rc.reasoning_tokens,
                                 "matches": ok})
                if ok:
                    matching.append((tuple(label), rc))
    if len(matching) == 1:
        combo, rc = matching[0]
        return RepairResult("unique", rc, combo, evidence)
    return RepairResult("ambiguous" if matching else "none", None, (), evidence)

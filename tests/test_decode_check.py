"""The decode check of the validation checks, held to its definition: every text segment's ids must
decode, on their own, to that segment's text. A tiktoken tokenizer answers the check without decoding
when the ids are its own recent plain encoding of the text (Tokenizer.decodes_to); every sample here is
built to fool a shortcut (a segment boundary inside a character, a lone surrogate whose ids are our own
encoding, U+FFFD, ids changed after they were encoded), and none may be called exact."""
from __future__ import annotations

import json
import random

from eagledata.tokens.checks import COUNTS_EOT, sample_stats, structural_codes, verdict
from eagledata.tokens.reconstruct import Reconstruction, Segment, reconstruct_completion
from eagledata.tokens.responses import ParsedResponse, parse_response
from eagledata.tokens.samples import Sample


def _per_segment(rc: Reconstruction, tok) -> dict[str, bool]:
    """The reference: each text segment decoded on its own with the tokenizer's decode."""
    texts = [(rc.ids[s.start:s.end], s.text) for s in rc.segments if s.text is not None]
    return {"decode_mismatch": any(tok.decode(ids) != text for ids, text in texts),
            "special_in_text": any(tok.is_special_id(t) for ids, _ in texts for t in ids)}


def _judge(tok, fam, rc: Reconstruction, reasoning: str = "r", content: str = "c") -> tuple[str, list[str]]:
    """Verdict of a completion billed exactly our count (only the structure can tell it apart)."""
    parsed = ParsedResponse(streamed=False, reasoning=reasoning, content=content, finish_reason="stop",
                            usage={"completion_tokens": len(rc.ids)})
    return verdict(sample_stats(Sample("s", {}, parsed, [], rc, True), tok, fam), COUNTS_EOT)


def _reconstruct(tok, fam, reasoning: str, content: str) -> Reconstruction:
    return reconstruct_completion(ParsedResponse(streamed=False, reasoning=reasoning, content=content,
                                                 finish_reason="stop"), tok, fam)


def _split_content(rc: Reconstruction, first: tuple[list[int], str], second: tuple[list[int], str]) -> Reconstruction:
    """``rc`` with its content segment replaced by two adjacent text segments (ids, text)."""
    i = next(k for k, s in enumerate(rc.segments) if s.kind == "content")
    before, after = rc.segments[:i], rc.segments[i + 1:]
    start = rc.segments[i].start
    ids = rc.ids[:start] + first[0] + second[0]
    segments = before + [Segment("content", start, start + len(first[0]), first[1]),
                         Segment("content", start + len(first[0]), len(ids), second[1])]
    for s in after:
        segments.append(Segment(s.kind, len(ids), len(ids) + s.end - s.start, s.text, s.call))
        ids += rc.ids[s.start:s.end]
    return Reconstruction(ids, segments, list(rc.flags), [], rc.stopped, rc.thinking)


def test_segment_boundary_inside_a_character_is_never_exact(k25):
    """Two segments whose ids split the bytes of 中 between them: joined, ids and texts agree, so a
    check over the joined segments would pass; each segment on its own decodes to U+FFFD."""
    tok, fam = k25
    rc = _reconstruct(tok, fam, " Think: 中文 first.", " Answer 中文 here.")
    assert _judge(tok, fam, rc) == ("exact", [])
    byte = tok.encoding.encode_single_token
    e4, b8, ad = (byte(bytes([b])) for b in b"\xe4\xb8\xad")  # 中 is e4 b8 ad
    head, tail = tok.encode_plain(" Answer "), tok.encode_plain("文 here.")
    for first_text, second_text in ((" Answer 中", "文 here."), (" Answer ", "中文 here.")):
        tok.encode_plain(first_text), tok.encode_plain(second_text)  # our own encodings are at hand
        split = _split_content(rc, (head + [e4], first_text), ([b8, ad] + tail, second_text))
        assert tok.decode(head + [e4, b8, ad] + tail) == first_text + second_text  # joined, they agree
        assert _per_segment(split, tok) == {"decode_mismatch": True, "special_in_text": False}
        v, codes = _judge(tok, fam, split)
        assert v == "mismatch" and "decode_mismatch" in codes, (first_text, codes)


def test_lone_surrogate_is_never_exact_although_its_ids_are_our_own_encoding(k25):
    """tiktoken encodes a lone surrogate as U+FFFD: the ids are exactly our plain encoding of the
    text, and still do not decode back to it. Nothing but the decode check sees this (no U+FFFD in
    the text, so no lossy_text)."""
    tok, fam = k25
    for content in (" a\ud800b", " emoji \ud83d\ude00 as two code units", "\udfff"):
        rc = _reconstruct(tok, fam, " Thinking.", content)
        seg = next(s for s in rc.segments if s.kind == "content")
        assert rc.ids[seg.start:seg.end] == tok.encode_plain(content)
        assert not tok.decodes_to(rc.ids[seg.start:seg.end], content)
        v, codes = _judge(tok, fam, rc)
        assert v == "mismatch" and "decode_mismatch" in codes and "lossy_text" not in codes, (content, codes)


def test_ids_changed_after_encoding_are_decoded(k25):
    """The proof compares ids id for id with a copy kept at encoding: changing the caller's list, or
    the completion's ids, after encoding is caught."""
    tok, fam = k25
    text = " hello world, hello again"
    ids = tok.encode_plain(text)
    assert tok.decodes_to(ids, text)
    ids[0], ids[1] = ids[1], ids[0]
    assert not tok.decodes_to(ids, text) and tok.decode(ids) != text
    rc = _reconstruct(tok, fam, " Thinking it over.", text)
    seg = next(s for s in rc.segments if s.kind == "content")
    rc.ids[seg.start] = tok.encode_plain(" goodbye")[0]
    v, codes = _judge(tok, fam, rc)
    assert v == "mismatch" and "decode_mismatch" in codes


def _random_text(rng: random.Random) -> str:
    pieces = [" the", " 数据", " café", "🙂", "\ufffd", " x=1;", "\n", " naïve", " Ελλάδα", "  ", "\ud800"]
    weights = [20, 6, 4, 3, 1, 6, 4, 3, 3, 2, 1]
    return "".join(rng.choices(pieces, weights, k=rng.randrange(1, 14)))


def _mutate(rc: Reconstruction, tok, rng: random.Random) -> Reconstruction:
    """One random change a shortcut could miss (or none)."""
    text_segs = [k for k, s in enumerate(rc.segments) if s.text is not None and s.end > s.start]
    kind = rng.choice(["none", "split", "replace", "special", "shrink", "text"])
    if kind == "none" or not text_segs:
        return rc
    k = rng.choice(text_segs)
    s = rc.segments[k]
    ids, segments = list(rc.ids), list(rc.segments)
    if kind == "split" and s.end - s.start > 1:  # two segments, the text cut at a character boundary
        cut = rng.randrange(s.start + 1, s.end)
        n_bytes = len(tok.decode_bytes(ids[s.start:cut]))
        raw = s.text.encode("utf-8", "surrogatepass")
        first = raw[:n_bytes].decode("utf-8", "ignore")
        segments[k:k + 1] = [Segment(s.kind, s.start, cut, first), Segment(s.kind, cut, s.end, s.text[len(first):])]
    elif kind == "replace":
        ids[rng.randrange(s.start, s.end)] = rng.randrange(0, tok.first_special_id)
    elif kind == "special":
        ids[rng.randrange(s.start, s.end)] = tok.special_id(rng.choice(["<|im_end|>", "</think>", "[EOS]"]))
    elif kind == "shrink":
        segments[k] = Segment(s.kind, s.start, s.end - 1, s.text, s.call)
    else:
        segments[k] = Segment(s.kind, s.start, s.end, s.text + rng.choice([" ", "\ud800", "中"]), s.call)
    return Reconstruction(ids, segments, list(rc.flags), [], rc.stopped, rc.thinking)


def test_checks_agree_with_the_per_segment_decode_on_random_samples(k25):
    """Random texts (CJK, emoji, U+FFFD, lone surrogates), random tool calls, random changes: the
    checks report decode_mismatch and special_in_text exactly when decoding each segment on its own
    does, and no sample the per-segment decode rejects is exact or repaired."""
    tok, fam = k25
    rng = random.Random(7)
    seen = {"decode_mismatch": 0, "special_in_text": 0, "clean": 0}
    for _ in range(400):
        msg = {"reasoning": _random_text(rng), "content": _random_text(rng)}
        if rng.random() < 0.3:
            msg["tool_calls"] = [{"id": "functions.f:0", "type": "function", "function": {
                "name": "f", "arguments": json.dumps({"q": _random_text(rng)}, ensure_ascii=False)}}]
        finish = "tool_calls" if "tool_calls" in msg else "stop"
        parsed = parse_response(json.dumps({"choices": [{"finish_reason": finish, "message": msg}]}))
        rc = _mutate(reconstruct_completion(parsed, tok, fam), tok, rng)
        want = _per_segment(rc, tok)
        sample = Sample("s", {}, parsed, [], rc, True)
        codes = structural_codes(sample, tok, fam)
        got = {c: c in codes for c in want}
        assert got == want, (rc.segments, codes)
        if any(want.values()):
            parsed.usage = {"completion_tokens": len(rc.ids)}
            assert verdict(sample_stats(sample, tok, fam), COUNTS_EOT)[0] in ("mismatch", "error")
        for c, bad in want.items():
            seen[c] += bad
        seen["clean"] += not any(want.values())
    assert min(seen.values()) >= 30, seen  # every kind of outcome was exercised


def test_decodes_to_is_decode_equality(k25):
    """With and without our own encoding at hand, decodes_to(ids, text) == (decode(ids) == text)."""
    tok, _ = k25
    rng = random.Random(3)
    texts = [_random_text(rng) for _ in range(200)]
    for a, b in zip(texts, texts[1:]):
        ids_a = tok.encode_plain(a)
        for ids, text in ((ids_a, a), (ids_a, b), (ids_a[:-1], a), (ids_a + ids_a[-1:], a)):
            assert tok.decodes_to(ids, text) == (tok.decode(ids) == text), (ids, text)

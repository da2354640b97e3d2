"""The adversarial traps named for held-out real traffic (issue 9): U+FFFD in text, counts off by a
few tokens, wrong special ids. Each goes through the real tokens stage with the real K2.5 tokenizer,
next to untampered samples of the same provider that are exact, and none is ever called exact."""
from __future__ import annotations

import json

import pytest

from eagledata.text.chat import prompt_ids
from eagledata.tokens.reconstruct import reconstruct_completion
from eagledata.tokens.responses import ParsedResponse
from eagledata.tokens.shards import build_token_shards, read_shards

MSGS = [{"role": "user", "content": "What is 2+3?"}]
REASONING, CONTENT = " Two plus three.", " It is 5."


def _true_ids(tok, fam, reasoning: str, content: str) -> list[int]:
    parsed = ParsedResponse(streamed=False, reasoning=reasoning, content=content, finish_reason="stop")
    return reconstruct_completion(parsed, tok, fam).ids


def _record(rid, reasoning, content, completion, prompt, reasoning_billed=None, token_ids=None, provider="P"):
    usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    if reasoning_billed is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_billed}
    body = {"id": f"gen-{rid}", "provider": provider, "usage": usage,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"reasoning": reasoning, "content": content}}]}
    rec = {"id": rid, "request": {"messages": MSGS}, "status": 200, "response_raw": json.dumps(body)}
    if token_ids is not None:
        rec["token_ids"] = token_ids
    return rec


def _judge(tok, fam, tmp_path, records) -> dict[str, dict]:
    path = tmp_path / "responses.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    build_token_shards(path, tmp_path / "tokens", tok, fam, "traps")
    return {r["id"]: r for r in read_shards(tmp_path / "tokens").iter_rows(named=True)}


def _anchors(tok, fam, n_prompt, **kw) -> list[dict]:
    n = len(_true_ids(tok, fam, REASONING, CONTENT))
    return [_record(f"anchor{i}", REASONING, CONTENT, n, n_prompt, **kw) for i in range(3)]


def _assert_trapped(rows, rid, reason):
    row = rows[rid]
    assert row["verdict"] == "mismatch" and row["completion_verdict"] == "mismatch", (rid, row["reasons"])
    assert reason in row["reasons"] and not row["train"], (rid, row["reasons"])


def test_replacement_character_in_text_is_never_exact(k25, tmp_path):
    """U+FFFD in returned text: bytes were lost before we saw them. Our ids decode back to the text
    (the decode check passes) and the billed count equals ours: only lossy_text stops it."""
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    lossy = [(" It is \ufffd5.", REASONING), (CONTENT, " Two plus \ufffd\ufffd three."), ("\ufffd", REASONING)]
    records = _anchors(tok, fam, n_prompt)
    for i, (content, reasoning) in enumerate(lossy):
        records.append(_record(f"lossy{i}", reasoning, content, len(_true_ids(tok, fam, reasoning, content)), n_prompt))
    rows = _judge(tok, fam, tmp_path, records)
    assert {rows[f"anchor{i}"]["verdict"] for i in range(3)} == {"exact"}
    for i in range(len(lossy)):
        _assert_trapped(rows, f"lossy{i}", "lossy_text")
        assert "decode_mismatch" not in rows[f"lossy{i}"]["reasons"]


@pytest.mark.parametrize("off", [-3, -2, -1, 1, 2, 3])
def test_completion_count_off_by_a_few_is_never_exact(k25, tmp_path, off):
    """Billed completion tokens a few away from ours, both directions (the provider counts the
    end-of-turn token, learned from the exact samples beside it): never exact, never repaired (the
    texts already start with a space, so no whitespace repair can explain the difference)."""
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    n = len(_true_ids(tok, fam, REASONING, CONTENT))
    rows = _judge(tok, fam, tmp_path, _anchors(tok, fam, n_prompt) + [_record("off", REASONING, CONTENT, n + off, n_prompt)])
    assert {rows[f"anchor{i}"]["verdict"] for i in range(3)} == {"exact"}
    _assert_trapped(rows, "off", "completion_count_mismatch")
    assert rows["off"]["completion_diff"] == -off


@pytest.mark.parametrize("off", [-3, -2, -1, 2, 3, 4])
def test_reasoning_count_off_by_a_few_is_never_exact(k25, tmp_path, off):
    """Billed reasoning tokens a few away from ours (ours, or ours + 1 for </think>, are the two
    accepted), with the completion total right: never exact for a provider whose reasoning count is
    a checksum (its other samples agree exactly)."""
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    n = len(_true_ids(tok, fam, REASONING, CONTENT))
    n_r = len(tok.encode_plain(REASONING))
    records = _anchors(tok, fam, n_prompt, reasoning_billed=n_r + 1)
    records.append(_record("off", REASONING, CONTENT, n, n_prompt, reasoning_billed=n_r + off))
    rows = _judge(tok, fam, tmp_path, records)
    assert {rows[f"anchor{i}"]["verdict"] for i in range(3)} == {"exact"}
    _assert_trapped(rows, "off", "reasoning_count_mismatch")


def test_a_sample_never_excuses_its_own_reasoning_count(k25, tmp_path):
    """One sample a few tokens above and one a few below, the others exact: each alone would make
    the provider's reasoning count 'not a checksum' for the other, so each is judged on the others'
    evidence, which shows a checksum: both are caught. A provider off in both directions on
    several samples is still learned not to be a checksum."""
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    n = len(_true_ids(tok, fam, REASONING, CONTENT))
    n_r = len(tok.encode_plain(REASONING))
    records = _anchors(tok, fam, n_prompt, reasoning_billed=n_r + 1)
    records += [_record("above", REASONING, CONTENT, n, n_prompt, reasoning_billed=n_r + 4),
                _record("below", REASONING, CONTENT, n, n_prompt, reasoning_billed=n_r - 3)]
    (tmp_path / "pair").mkdir()
    rows = _judge(tok, fam, tmp_path / "pair", records)
    assert {rows[f"anchor{i}"]["verdict"] for i in range(3)} == {"exact"}
    _assert_trapped(rows, "above", "reasoning_count_mismatch")
    _assert_trapped(rows, "below", "reasoning_count_mismatch")
    records += [_record(f"noisy{i}", REASONING, CONTENT, n, n_prompt, reasoning_billed=n_r + d)
                for i, d in enumerate((5, -2))]
    (tmp_path / "noisy").mkdir()
    rows = _judge(tok, fam, tmp_path / "noisy", records)
    assert all("reasoning_count_unchecked" in rows[r]["reasons"] and rows[r]["train"]
               for r in ("above", "below", "noisy0", "noisy1"))


def _wrong_specials(tok, ids: list[int]) -> dict[str, tuple[list[int], str]]:
    """Engine ids with a wrong special id, each with the reason that must catch it."""
    sid = tok.special_id
    eot, close, think_open = sid("<|im_end|>"), sid("</think>"), sid("<think>")
    mid = ids.index(close) + 2  # inside the content
    return {
        "eos_for_eot": (ids[:-1] + [sid("[EOS]")], "special_in_text"),
        "open_for_close": ([think_open if t == close else t for t in ids], "think_close_count"),
        "reserved_in_text": (ids[:mid] + [sid("<|reserved_token_163589|>")] + ids[mid:], "special_in_text"),
        "eot_in_text": (ids[:mid] + [eot] + ids[mid:], "end_of_turn_misplaced"),
        "second_close": (ids[:mid] + [close] + ids[mid:], "think_close_count"),
    }


def test_wrong_special_ids_from_an_engine_are_never_exact(k25, tmp_path):
    """Token ids returned by a serving engine are used as they are: a wrong special id among them
    (another special in place of end-of-turn, <think> for </think>, a reserved or end-of-turn id
    inside the text, a second </think>) is never exact, although the billed count is the length of
    those very ids. (Engine ids that end without end-of-turn are not a trap: a stop string ends
    them so; an ordinary id in place of end-of-turn on the text path: test_repairs.)"""
    tok, fam = k25
    n_prompt = len(prompt_ids(tok, MSGS))
    ids = _true_ids(tok, fam, REASONING, CONTENT)
    records = [_record(f"anchor{i}", REASONING, CONTENT, len(ids), n_prompt, token_ids=ids) for i in range(3)]
    cases = _wrong_specials(tok, ids)
    for rid, (wrong, _) in cases.items():
        records.append(_record(rid, REASONING, CONTENT, len(wrong), n_prompt, token_ids=wrong))
    rows = _judge(tok, fam, tmp_path, records)
    for i in range(3):
        assert rows[f"anchor{i}"]["verdict"] == "exact" and "ground_truth_ids" in rows[f"anchor{i}"]["reasons"]
    for rid, (wrong, reason) in cases.items():
        _assert_trapped(rows, rid, reason)
        assert rows[rid]["input_ids"][rows[rid]["prompt_len"]:] == wrong  # judged on the engine's own ids

"""The tools' key order on the prompt side: Kimi K2 Thinking's and K2.5's own code deep-sorts the tools
by key before declaring them; a provider that skips it renders the request's own key order, usually
with the same token count. A count match then proves nothing: such a prompt is ``unproven`` (never
``exact``) unless the provider's other samples, whose two orders have different counts, prove it sorts.
Against the stand-in's truth (its ``unsorted-tools`` profile) and unit by unit."""
from __future__ import annotations

import json
from collections import Counter

import pytest
from conftest import ask_stand_in, demo_prompts

from eagledata.text.chat import declare_tools, prompt_ids, prompt_text
from eagledata.text.tool_declaration import deep_sort, in_deep_sorted_order
from eagledata.tokens import summaries
from eagledata.tokens.checks import (PROMPT_VERDICTS, SampleStats, UNSORTED_TOOLS, completion_verdict, prompt_verdict,
                                     repairable)
from eagledata.tokens.learning import MIN_VARIANT_SAMPLES, learn_prompt_variants, provider_sorts_tool_keys
from eagledata.tokens.policy import PRESETS
from eagledata.tokens.shards import build_token_shards, read_shards
from eagledata.validate.summary import render_summary, summarize

SEED = 5
#: Tools whose order also matters to K2.5's TypeScript declaration: ``$defs`` are declared as interfaces
#: in their given order; a schema the declaration cannot express falls back to (compact) JSON.
EXTRA = [
    {"id": "defs-1", "messages": [{"role": "user", "content": "Book a flight from Lisbon to Oslo."}],
     "tools": [{"type": "function", "function": {"name": "book", "description": "Book a trip.", "parameters": {
         "type": "object", "$defs": {"Seat": {"type": "object", "properties": {"row": {"type": "integer"}}},
                                      "Airport": {"type": "object", "properties": {"code": {"type": "string"}}}},
         "properties": {"origin": {"$ref": "#/$defs/Airport"}, "seat": {"$ref": "#/$defs/Seat"}},
         "required": ["origin"]}}}]},
    {"id": "fallback-1", "messages": [{"role": "user", "content": "Set the mode to fast."}],
     "tools": [{"type": "function", "function": {"name": "set_mode", "description": "Set a mode.", "parameters": {
         "type": "object", "properties": {"mode": {"type": "string", "enum": ["fast", 2]}}, "required": ["mode"]}}}]},
]


def _prompts() -> list[dict]:
    return [p for p in demo_prompts() if p.get("tools")] + EXTRA + demo_prompts(("chat",))[:4]


def _collect(tok, fam, profile, tmp_path, policy="default"):
    records, truths = ask_stand_in(tok, fam, profile, SEED, _prompts())
    path = tmp_path / "responses.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    res = build_token_shards(path, tmp_path / "tokens", tok, fam, "ds", shard_size=8, policy=policy)
    rows = {r["id"]: r for r in read_shards(tmp_path / "tokens").iter_rows(named=True)}
    return rows, truths, res


def _prompt_is_truth(row, truth) -> bool:
    return row["input_ids"][: row["prompt_len"]] == truth.prompt_ids


@pytest.mark.parametrize("family", ["k2_thinking", "k25"])
def test_no_prompt_called_exact_with_other_ids_than_the_model_saw(family, request, tmp_path):
    """The provider declares the tools in the request's key order (the model saw that prompt): no
    prompt is exact with other ids; those whose count cannot tell are ``unproven`` (reason, joint
    verdict not exact), admitted by the default policy as a differing prompt is, reported."""
    tok, fam = request.getfixturevalue(family)
    rows, truths, res = _collect(tok, fam, "unsorted-tools", tmp_path)
    for sid, row in rows.items():
        if row["prompt_verdict"] == "exact":
            assert _prompt_is_truth(row, truths[sid]), sid
        assert row["completion_verdict"] == "exact", (sid, row["reasons"])
    unproven = {sid for sid, r in rows.items() if r["prompt_verdict"] == "unproven"}
    # K2 Thinking declares the tools as JSON: every demo tool set's keys are out of order; K2.5's
    # TypeScript declaration sorts fields itself: only $defs (and the JSON fallback) depend on the order
    assert unproven and (family == "k25") == (unproven == {"defs-1"})
    for sid in unproven:
        r = rows[sid]
        assert not _prompt_is_truth(r, truths[sid]) and r["prompt_diff"] == 0
        assert "prompt_order_unproven" in r["reasons"] and r["verdict"] == "mismatch" and r["train"]
    learned = res.manifest["conventions"]["Simulator"]["prompt_rendering"]
    assert learned["tool_key_order"]["sorts_keys"] is False
    if family == "k2_thinking":  # the samples whose two orders differ in count show the request's order
        assert learned["tool_key_order"]["request_order"] >= MIN_VARIANT_SAMPLES
        assert learned["variant"] == "unsorted_tools"
    rep = summarize(tmp_path / "tokens", 1.0)
    assert rep["counts"]["prompt"]["unproven"] == len(unproven) == rep["counts"]["admitted_with_prompt_unproven"]
    assert rep["reasons"]["prompt_order_unproven"]["count"] == len(unproven)
    assert "unproven (tool key order)" in render_summary(rep)


def test_a_provider_proven_to_sort_keeps_its_tied_prompts_exact(k2_thinking, tmp_path):
    """The canonical provider (it deep-sorts, as the model's code does): its samples whose two key
    orders have different counts are billed as the sorted one, so its tied samples are exact (and
    they are the truth)."""
    tok, fam = k2_thinking
    rows, truths, res = _collect(tok, fam, "exact", tmp_path)
    order = res.manifest["conventions"]["Simulator"]["prompt_rendering"]["tool_key_order"]
    assert order["sorts_keys"] and order["sorted"] >= MIN_VARIANT_SAMPLES and order["request_order"] == 0
    assert order["tied"] > 0
    assert {r["prompt_verdict"] for r in rows.values()} == {"exact"}
    assert all(_prompt_is_truth(r, truths[sid]) for sid, r in rows.items())


def test_one_sample_does_not_prove_a_provider_sorts(k25, tmp_path):
    """K2.5 at the canonical provider: fallback-1 alone is billed as the sorted rendering (too few to
    prove the provider sorts), so defs-1, whose two orders tie, stays unproven; strict and exact
    policies keep it out of training, as they keep a differing prompt out."""
    tok, fam = k25
    rows, _, res = _collect(tok, fam, "exact", tmp_path, policy="exact")
    order = res.manifest["conventions"]["Simulator"]["prompt_rendering"]["tool_key_order"]
    assert order == {"sorted": 1, "request_order": 0, "tied": 1, "sorts_keys": False}
    assert rows["defs-1"]["prompt_verdict"] == "unproven" and not rows["defs-1"]["train"]
    assert rows["fallback-1"]["prompt_verdict"] == "exact" and rows["fallback-1"]["train"]


# --- units ------------------------------------------------------------------------------------------


def _stats(provider="P", prompt_diff=0, alt=None) -> SampleStats:
    return SampleStats(id="x", provider=provider, finish_reason="stop", prompt_len=100 + prompt_diff,
                       completion_len=50, reasoning_len=10, has_eot=True, billed_prompt=100, billed_completion=50,
                       billed_reasoning=None, has_tools=True,
                       prompt_alt=None if alt is None else {UNSORTED_TOOLS: 100 + alt})


def test_key_order_votes_and_the_prompt_verdict():
    assert _stats(alt=0).key_order_vote() == "tied"
    assert _stats(alt=3).key_order_vote() == "sorted"
    assert _stats(prompt_diff=2, alt=0).key_order_vote() == "request_order"
    assert _stats(prompt_diff=2, alt=1).key_order_vote() is None
    assert _stats().key_order_vote() is None  # the request's order renders our ids: nothing to tell
    assert prompt_verdict(_stats(alt=0)) == "unproven" and prompt_verdict(_stats(alt=0), sorts_tool_keys=True) == "exact"
    assert prompt_verdict(_stats(alt=3)) == prompt_verdict(_stats()) == "exact"
    assert prompt_verdict(_stats(prompt_diff=2, alt=0)) == "differs"
    assert "unproven" in PROMPT_VERDICTS


def test_a_provider_sorts_only_with_enough_votes_and_none_against():
    def learned(*rows):
        v = learn_prompt_variants(list(rows))
        return v["P"].get("tool_key_order"), provider_sorts_tool_keys(v, "P")

    sorted_ = [_stats(alt=2) for _ in range(MIN_VARIANT_SAMPLES)]
    assert learned(*sorted_, _stats(alt=0)) == ({"sorted": 3, "request_order": 0, "tied": 1, "sorts_keys": True}, True)
    assert learned(*sorted_[1:], _stats(alt=0))[1] is False  # too few
    assert learned(*sorted_, _stats(prompt_diff=1, alt=0))[1] is False  # one sample billed in the request's order
    assert learned(_stats(), _stats()) == (None, False)
    # the per-shard summaries learn the same
    rows = sorted_ + [_stats(alt=0), _stats(prompt_diff=1, alt=0), _stats(provider="Q", alt=0)]
    per_shard = summaries.merge([summaries.summarize(rows[:2]), summaries.summarize(rows[2:])])
    assert summaries.learn(per_shard)[2] == learn_prompt_variants(rows)


def test_the_unproven_prompt_reason_is_prompt_side_only():
    codes = ["prompt_order_unproven"]
    assert completion_verdict(codes) == "exact" and not repairable(codes)
    assert repairable(codes + ["completion_count_mismatch"])  # the completion can still be repaired
    assert PRESETS["default"].admits("exact", "unproven") and PRESETS["all"].admits("exact", "unproven")
    for name in ("strict", "exact", "exact+repaired"):
        assert not PRESETS[name].admits("exact", "unproven")


def test_tools_rendered_in_the_request_key_order(k2_thinking):
    tok, _ = k2_thinking
    tools = EXTRA[1]["tools"]
    assert not in_deep_sorted_order(tools) and in_deep_sorted_order(deep_sort(tools))
    assert in_deep_sorted_order([{"a": 1, "b": [{"c": 1, "d": 2}]}]) and not in_deep_sorted_order([{"a": {"z": 1, "y": 2}}])
    declared, _ = declare_tools(tools, "typescript", sort_keys=False)
    assert [list(t) for t in declared] == [["type", "function"]]
    msgs = EXTRA[1]["messages"]
    ours, theirs = prompt_text(tok, msgs, tools), prompt_text(tok, msgs, tools, sort_tool_keys=False)
    assert ours != theirs and Counter(ours) == Counter(theirs)  # the same characters in another order
    assert '"function": {"description": "Set a mode."' in ours and '[{"type": "function", "function": {"name"' in theirs
    assert prompt_ids(tok, msgs, tools) != prompt_ids(tok, msgs, tools, sort_tool_keys=False)


def test_per_shard_stage_learns_and_judges_the_key_order_as_the_one_job_stage(k2_thinking, tmp_path):
    """The per-shard jobs (the key-order votes summed from the shards' summaries) give every column
    of every sample, and the learned key order, as the one-job stage."""
    from test_pershard_tokens import run_pershard

    tok, fam = k2_thinking
    rows, _, res = _collect(tok, fam, "unsorted-tools", tmp_path)
    manifest = run_pershard(tmp_path / "responses.jsonl", tmp_path / "ps" / "work", tok, fam, 3)
    a = read_shards(tmp_path / "tokens").sort("id")
    b = read_shards(tmp_path / "ps" / "tokens").sort("id")
    assert a.equals(b) and "unproven" in set(b["prompt_verdict"])
    assert manifest["conventions"] == res.manifest["conventions"]


def test_a_provider_rendering_the_request_order_with_an_offset_proves_no_prompt_by_coincidence(k2_thinking, tmp_path):
    """A provider that declares the tools in the request's key order with a template one token
    shorter (billed: the request's order minus one): where deep-sorting the keys saves that token, our
    canonical count equals the billed one by coincidence. Those prompts were ``exact`` with ids the
    model never saw (8 of 22 here), their votes 'proved' the provider sorts while it was learned to
    render the request's order (``unsorted_tools+offset+1``). The learned rendering explains their
    count too: they are ``unproven``, and the provider is not proven to sort."""
    from dataclasses import replace

    from eagledata.standin.profiles import PROFILES, template_variant_minus_one, unsorted_tool_declaration

    tok, fam = k2_thinking
    profile = replace(PROFILES["exact"], name="unsorted-minus-one",
                      completion_hooks=(unsorted_tool_declaration, template_variant_minus_one))
    rows, truths, res = _collect(tok, fam, profile, tmp_path, policy="exact")
    learned = res.manifest["conventions"]["Simulator"]["prompt_rendering"]
    assert learned["variant"] == "unsorted_tools+offset+1"
    assert learned["tool_key_order"]["sorted"] > 0 and learned["tool_key_order"]["sorts_keys"] is False
    coincident = {sid for sid, r in rows.items() if r["prompt_diff"] == 0}
    assert len(coincident) >= MIN_VARIANT_SAMPLES
    for sid, row in rows.items():
        if row["prompt_verdict"] == "exact":
            assert _prompt_is_truth(row, truths[sid]), sid
    for sid in coincident:
        r = rows[sid]
        assert not _prompt_is_truth(r, truths[sid])
        assert r["prompt_verdict"] == "unproven" and "prompt_order_unproven" in r["reasons"], (sid, r["reasons"])
        assert r["verdict"] == "mismatch" and not r["train"]
    from test_pershard_tokens import run_pershard  # the per-shard jobs judge it alike

    run_pershard(tmp_path / "responses.jsonl", tmp_path / "ps" / "work", tok, fam, 3)  # default policy: no train
    one, per_shard = (read_shards(tmp_path / d).sort("id").drop("train") for d in ("tokens", "ps/tokens"))
    assert one.equals(per_shard)


def test_an_offset_in_the_request_order_proves_no_sorting():
    """Units: sorted votes of a provider learned to render the request's order with an offset are
    coincidences (the summaries learn the same); its canonical matches are unproven."""
    from eagledata.tokens.learning import request_order_explains

    rows = [_stats(alt=1) for _ in range(MIN_VARIANT_SAMPLES)] + [_stats(prompt_diff=1, alt=1), _stats(prompt_diff=2, alt=1)]
    variants = learn_prompt_variants(rows)
    assert variants["P"]["variant"] == "unsorted_tools+offset+1"
    assert variants["P"]["tool_key_order"]["sorted"] == MIN_VARIANT_SAMPLES and not provider_sorts_tool_keys(variants, "P")
    assert summaries.learn(summaries.merge([summaries.summarize(rows[:2]), summaries.summarize(rows[2:])]))[2] == variants
    assert request_order_explains(variants, rows[0]) and prompt_verdict(rows[0], False, True) == "unproven"
    assert not request_order_explains(variants, _stats())  # the request's order renders our ids: nothing else
    assert not request_order_explains(learn_prompt_variants([_stats(alt=3)] * 3), _stats(alt=3))  # canonical

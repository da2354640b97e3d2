"""Both verdicts per sample, the admission policies, what is learned per provider (reasoning count
reliability, prompt rendering variants) and the routing rule, against the stand-in's ground truth."""
from __future__ import annotations

import json

import httpx
import pytest
from conftest import ask_stand_in, demo_prompts

from eagledata.report import build as rp
from eagledata.text.chat import prompt_ids, prompt_text
from eagledata.tokens.checks import SampleStats
from eagledata.tokens.learning import learn_prompt_variants, learn_reasoning_reliability, sample_variant, variant_name
from eagledata.tokens.policy import PRESETS, PolicyError, resolve_policy
from eagledata.standin.server import SimulatorServer
from eagledata.tokens.shards import build_token_shards, read_shards
from eagledata.validate.summary import ValidationFailed, summarize, write_validation

SEED = 5
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "unit": {"type": "string", "enum": ["c", "f"], "description": "Unit."},
        "city": {"type": "string", "description": "City name."},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}]


def _collect(tok, fam, profile, tmp_path, tamper=None):
    """Ask the stand-in (``profile``) every demo prompt; return (shard rows by id, truths by id)."""
    records, truths = ask_stand_in(tok, fam, profile, SEED)
    if tamper:
        records = [tamper(r) for r in records]
    path = tmp_path / f"{profile}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    res = build_token_shards(path, tmp_path / f"tokens-{profile}", tok, fam, profile, shard_size=8)
    rows = {r["id"]: r for r in read_shards(tmp_path / f"tokens-{profile}").iter_rows(named=True)}
    return rows, truths, res.manifest


def _stats(provider="P", prompt_diff=0, has_tools=False, alt=None, billed_reasoning=None, reasoning_len=10,
           completion_diff=0) -> SampleStats:
    return SampleStats(id="x", provider=provider, finish_reason="stop", prompt_len=100 + prompt_diff,
                       completion_len=50 + completion_diff, reasoning_len=reasoning_len, has_eot=True,
                       billed_prompt=100, billed_completion=50, billed_reasoning=billed_reasoning,
                       has_tools=has_tools, prompt_alt=alt or {})


# --- policies --------------------------------------------------------------------------------------


def test_policy_presets_name_both_sides():
    d, strict = PRESETS["default"], PRESETS["strict"]
    assert d.admits("exact", "differs") and d.admits("repaired", "unbilled") and d.admits("exact", "exact")
    assert not d.admits("mismatch", "exact") and not d.admits("exact", "error") and not d.admits("error", "exact")
    assert strict.admits("exact", "exact") and not strict.admits("repaired", "exact")
    assert not strict.admits("exact", "differs") and not strict.admits("exact", "unbilled")
    assert not PRESETS["exact+repaired"].admits("exact", "differs")
    custom = resolve_policy({"completion": ["exact"], "prompt": ["exact", "differs"]})
    assert custom.admits("exact", "differs") and not custom.admits("repaired", "exact")
    for bad, msg in (("lenient", "unknown policy"), ({"completion": ["great"]}, "unknown verdict"),
                     ({"completion": ["error"]}, "no ids"), ({"prompts": []}, "unknown key")):
        with pytest.raises(PolicyError, match=msg):
            resolve_policy(bad)


# --- learning ---------------------------------------------------------------------------------------

CONV = {"P": {"convention": "counts_eot"}}


def test_reasoning_count_learned_unreliable_only_in_both_directions():
    both = [_stats(billed_reasoning=10 + d) for d in (0, 1, 5, -4, 7)]
    r = learn_reasoning_reliability(both, CONV)["P"]
    assert r["checksum"] is False and r["above"] == 2 and r["below"] == 1 and r["spread"] == [-4, 7]
    one_way = [_stats(billed_reasoning=10 + d) for d in (0, 5, 7)]
    assert learn_reasoning_reliability(one_way, CONV)["P"]["checksum"] is True
    # evidence only from samples whose completion total agrees: a wrong total teaches nothing
    wrong_total = [_stats(billed_reasoning=10 + d, completion_diff=3) for d in (5, -4)]
    assert "P" not in learn_reasoning_reliability(wrong_total, CONV)


def test_prompt_rendering_variants():
    const = [_stats(prompt_diff=1, has_tools=t) for t in (False, True, False, True)]
    v = learn_prompt_variants(const)["P"]
    assert v["variant"] == "offset+1" and v["rendering"] == "canonical" and v["with_tools"] == 2
    json_tools = [_stats(prompt_diff=-30, has_tools=True, alt={"json_tools": 100}),
                  _stats(prompt_diff=-12, has_tools=True, alt={"json_tools": 100}), _stats(), _stats()]
    assert learn_prompt_variants(json_tools)["P"]["variant"] == "json_tools"
    both = [_stats(prompt_diff=-30, has_tools=True, alt={"json_tools": 99}), _stats(prompt_diff=-1), _stats(prompt_diff=-1)]
    assert learn_prompt_variants(both)["P"]["variant"] == "json_tools+offset-1" == variant_name("json_tools", -1)
    assert learn_prompt_variants([_stats(), _stats()])["P"] == {"variant": None, "rendering": "canonical", "offset": 0,
                                                                "samples": 2, "with_tools": 0, "without_tools": 2}
    mixed = [_stats(prompt_diff=d) for d in (1, 2, 0)]
    assert learn_prompt_variants(mixed)["P"]["variant"] is None and learn_prompt_variants(mixed)["P"]["rendering"] is None
    assert learn_prompt_variants([_stats(prompt_diff=1)] * 2)["P"]["variant"] is None  # too few to be a pattern
    # plain prompts one short, tools declared the provider's own way (seen on recorded K2 traffic):
    # no variant for all, one for the plain group, reported per sample only where it explains the count
    split = [_stats(prompt_diff=-1) for _ in range(3)] + [_stats(prompt_diff=d, has_tools=True, alt={"json_tools": 103})
                                                          for d in (-30, -12, -54)]
    learned = learn_prompt_variants(split)
    v = learned["P"]
    assert v["variant"] is None and v["groups"]["without_tools"]["variant"] == "offset-1"
    assert v["groups"]["with_tools"]["variant"] == "json_tools+offset+3"  # our JSON declaration is 3 longer
    assert [sample_variant(learned, s) for s in split] == ["offset-1"] * 3 + ["json_tools+offset+3"] * 3
    assert learn_prompt_variants(split[:4])["P"]["groups"]["with_tools"]["variant"] is None  # one sample: no pattern


# --- against the stand-in's truth ---------------------------------------------------------------------


def test_k25_tools_prompt_is_the_canonical_typescript_declaration(k25, tmp_path):
    """The real K2.5 tokenizer and template: a request with tools is rendered with the model's own
    TypeScript-style declaration, token for token what the stand-in (rendering canonically) bills."""
    tok, fam = k25
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    text = prompt_text(tok, messages, TOOLS)
    assert "<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n" in text
    assert "// Weather for a city.\ntype get_weather = (_: {\n  // City name.\n  city: string,\n" in text
    assert '"type":"function"' not in text  # not the JSON fallback
    json_ids = prompt_ids(tok, messages, TOOLS, tool_declaration="json")
    body = {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 64}
    with SimulatorServer(tok, fam, seed=SEED) as sim, httpx.Client(timeout=30) as client:
        r = client.post(sim.base_url + "/chat/completions", json=body)
        truth = sim.truth_of(body)
    ours = prompt_ids(tok, messages, TOOLS)
    assert ours == truth.prompt_ids and len(ours) != len(json_ids)
    assert r.json()["usage"]["prompt_tokens"] == len(ours)


@pytest.mark.parametrize("profile", ["json-tools", "template-minus-one", "unreliable-reasoning",
                                     "unreliable-reasoning-strip"])
def test_each_side_exact_only_when_it_equals_the_truth(profile, demo_tok, tmp_path):
    tok, fam = demo_tok
    rows, truths, manifest = _collect(tok, fam, profile, tmp_path)
    for sid, row in rows.items():
        t = truths[sid]
        if row["completion_verdict"] in ("exact", "repaired"):
            assert row["input_ids"][row["prompt_len"]:] == t.ids, (profile, sid, row["reasons"])
        if row["prompt_verdict"] == "exact":
            assert row["input_ids"][: row["prompt_len"]] == t.prompt_ids, (profile, sid)
        assert row["train"] == (row["completion_verdict"] in ("exact", "repaired"))  # the default policy
    learned = manifest["conventions"]["Simulator"]
    if profile == "json-tools":  # prompts with tools differ (explained), those without are exact
        with_tools = {p["id"] for p in demo_prompts() if p.get("tools")}
        assert with_tools and {sid for sid, r in rows.items() if r["prompt_verdict"] == "differs"} == with_tools
        assert {rows[sid]["prompt_variant"] for sid in with_tools} == {"json_tools"}
        assert learned["prompt_rendering"]["variant"] == "json_tools"
        assert all(r["completion_verdict"] == "exact" for r in rows.values())
    if profile == "template-minus-one":
        assert {r["prompt_verdict"] for r in rows.values()} == {"differs"}
        assert {r["prompt_diff"] for r in rows.values()} == {1}
        assert {r["prompt_variant"] for r in rows.values()} == {"offset+1"}
        assert all(r["completion_verdict"] == "exact" and r["train"] for r in rows.values())
    if profile.startswith("unreliable-reasoning"):
        assert learned["reasoning_count"]["checksum"] is False
        assert any("reasoning_count_unchecked" in r["reasons"] for r in rows.values())
        assert not any("reasoning_count_mismatch" in r["reasons"] for r in rows.values())
    if profile == "unreliable-reasoning-strip":  # repairs are still searched for such a provider; the
        # demo strips one segment of two, so the total alone cannot say which: ambiguous, never trained
        counted = [r for r in rows.values() if "completion_count_mismatch" in r["reasons"]]
        assert counted and all(r["completion_verdict"] == "mismatch" and not r["train"] for r in counted)


def test_unreliable_reasoning_never_excuses_a_wrong_total(demo_tok, tmp_path):
    tok, fam = demo_tok
    bumped = set()

    def tamper(rec):
        if rec["request"].get("stream") or len(bumped) >= 3:
            return rec
        body = json.loads(rec["response_raw"])
        body["usage"]["completion_tokens"] += 2
        bumped.add(rec["id"])
        return {**rec, "response_raw": json.dumps(body)}

    rows, _, manifest = _collect(tok, fam, "unreliable-reasoning", tmp_path, tamper)
    assert manifest["conventions"]["Simulator"]["reasoning_count"]["checksum"] is False
    assert len(bumped) == 3
    for sid in bumped:
        assert rows[sid]["completion_verdict"] == "mismatch" and not rows[sid]["train"]
        assert "completion_count_mismatch" in rows[sid]["reasons"]


def test_validation_counts_both_sides_and_gate_counts_completions(demo_tok, tmp_path):
    tok, fam = demo_tok
    _collect(tok, fam, "template-minus-one", tmp_path)
    tokens = tmp_path / "tokens-template-minus-one"
    rep = summarize(tokens, 0.05)
    c, n = rep["counts"], rep["counts"]["total"]
    assert c["completion"] == {"exact": n, "repaired": 0, "mismatch": 0, "error": 0}
    assert c["prompt"]["differs"] == n and c["exact"] == 0 and c["mismatch"] == n  # joint: exact on both sides
    assert c["included"] == n and c["admitted_with_prompt_differs"] == n
    assert rep["passed"] and rep["bad_fraction"] == 0.0 and rep["bad_counts"] == "completion"
    p = rep["providers"]["Simulator"]
    assert p["completion_verified_share"] == 1.0 and p["prompt_exact_share"] == 0.0
    assert p["prompt_variant"] == "offset+1" and p["admitted_share"] == 1.0
    with pytest.raises(ValidationFailed, match="100.00% of samples"):
        write_validation(tokens, tmp_path / "v.json", tmp_path / "v.txt", 0.05, bad_counts="both")
    strict = tmp_path / "strict"
    build_token_shards(tmp_path / "template-minus-one.jsonl", strict, tok, fam, "s", policy="strict")
    assert summarize(strict, 1.0)["counts"]["included"] == 0


# --- routing ------------------------------------------------------------------------------------------


def test_routing_never_advises_unverified_and_ranks_by_both_sides():
    provs = {
        # prompts all exact, but not one completion verified: never advised
        "Zero": {"total": 10, "exact": 0, "completion_verified": 0, "prompt": {"exact": 10}},
        "A": {"total": 10, "completion_verified": 9, "prompt": {"exact": 2}},
        "B": {"total": 10, "completion_verified": 9, "prompt": {"exact": 8}},
        "C": {"total": 10, "completion_verified": 10, "prompt": {"exact": 0}, "prompt_variant": "offset+1"},
        "D": {"total": 10, "completion_verified": 3, "prompt": {"exact": 10}},
    }
    a = rp.routing_advice(provs, 5, 0.5)
    assert a["order"] == ["c", "b", "a"] and a["ignore"] == ["d", "zero"]
    why = {r["name"]: r["why"] for r in a["providers"]}
    assert "0/10 completions verified" in why["Zero"] and "never advised" in why["Zero"]
    assert "variant offset+1" in why["C"] and "below 50%" in why["D"]
    # only unverified providers: nothing advised, nothing ignored
    a = rp.routing_advice({"X": {"total": 10, "completion_verified": 0}, "Y": {"total": 10, "completion_verified": 0}}, 5, 0.5)
    assert a["order"] == [] and a["ignore"] == [] and a["notes"]
    # all below the threshold: those with any verified completion kept, the unverified one ignored
    a = rp.routing_advice({"X": {"total": 10, "completion_verified": 1}, "Y": {"total": 10, "completion_verified": 3},
                           "Z": {"total": 10, "completion_verified": 0}}, 5, 0.5)
    assert a["order"] == ["y", "x"] and a["ignore"] == ["z"] and a["notes"]


def test_unreliable_reasoning_provider_still_gets_whitespace_repairs(k25, tmp_path):
    """Real K2.5 tokenizer: a provider whose reasoning counts are noise in both directions is judged on
    the total; a stripped leading space that the total alone pins down is still repaired."""
    from eagledata.tokens.reconstruct import reconstruct_completion
    from eagledata.tokens.responses import ParsedResponse

    tok, fam = k25
    msgs = [{"role": "user", "content": "How many?"}]
    n_prompt = len(prompt_ids(tok, msgs))
    # a stripped space that only a restored single space explains (see test_repairs); the reasoning starts
    # with a space, so only the content can have lost one
    reasoning, content = " Let me count, step by step, carefully now.", " pneumonoultra is here."
    rc = reconstruct_completion(ParsedResponse(streamed=False, reasoning=reasoning, content=content, finish_reason="stop"), tok, fam)

    def rec(rid, content, total, reasoning_tokens):
        body = {"id": rid, "provider": "Noisy", "choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "reasoning": reasoning, "content": content}}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": total,
                      "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}}
        return {"id": rid, "request": {"messages": msgs}, "status": 200, "response_raw": json.dumps(body)}

    n, r = len(rc.ids), rc.reasoning_tokens
    assert r > 2
    records = [rec(f"ok{i}", content, n, r + d) for i, d in enumerate((-1, 5, -2, 7))]
    records += [rec("stripped", content.lstrip(), n, r + 3), rec("stripped2", content.lstrip(), n, r - 1),  # two proofs
                rec("wrong_total", content, n + 2, r - 2)]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in records))
    res = build_token_shards(path, tmp_path / "t", tok, fam, "noisy")
    rows = {x["id"]: x for x in read_shards(tmp_path / "t").iter_rows(named=True)}
    assert res.manifest["conventions"]["Noisy"]["reasoning_count"]["checksum"] is False
    assert all(rows[f"ok{i}"]["completion_verdict"] == "exact" and rows[f"ok{i}"]["train"] for i in range(4))
    assert all("reasoning_count_unchecked" in rows[f"ok{i}"]["reasons"] for i in range(4)), [rows[f"ok{i}"]["reasons"] for i in range(4)]
    assert rows["stripped"]["completion_verdict"] == "repaired" and rows["stripped"]["train"]
    assert rows["stripped"]["input_ids"][rows["stripped"]["prompt_len"]:] == rc.ids
    assert rows["wrong_total"]["completion_verdict"] == "mismatch" and not rows["wrong_total"]["train"]

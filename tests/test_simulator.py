"""The local OpenRouter stand-in: real HTTP on loopback, ground truth vs. what it returns."""
from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest

from eagledata.text.chat import request_thinking
from eagledata.text.families import get_family
from eagledata.tokens.reconstruct import count_tool_calls
from eagledata.tokens.responses import parse_response
from eagledata.standin.faults import Fault
from eagledata.standin.profiles import PROFILES
from eagledata.standin.responses import prompt_hash
from eagledata.standin.server import SimulatorServer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}, "detailed": {"type": "boolean"}},
        "required": ["city", "days"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    try:
        from eagledata.demo.tokenizer import build_demo_tokenizer
    except ImportError:
        pytest.skip("eagledata.demo.tokenizer is not available")
    from eagledata.text.tokenizer import load_tokenizer

    fam = get_family("kimi-k2.5")
    return load_tokenizer(build_demo_tokenizer(None, tmp_path_factory.mktemp("demo-tok")), fam), fam


@pytest.fixture(params=["kimi-k2.5", "demo"])
def tok_fam(request):
    return request.getfixturevalue("k25" if request.param == "kimi-k2.5" else "demo")


def body(i: int, tools: bool = False, stream: bool = False, max_tokens: int = 4000, **extra) -> dict:
    b = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": f"Question number {i}?"}],
         "max_tokens": max_tokens, "stream": stream, "usage": {"include": True}, **extra}
    if tools:
        b["tools"] = [WEATHER, ADD]
    return b


#: One client for the module: creating an httpx client per call costs ~50 ms (TLS context).
HTTP = httpx.Client(timeout=10)


def post(sim: SimulatorServer, b: dict) -> httpx.Response:
    return HTTP.post(sim.base_url + "/chat/completions", json=b, timeout=10)


def truth(sim: SimulatorServer, gen_id: str) -> dict:
    r = HTTP.get(sim.base_url.removesuffix("/api/v1") + "/_sim/truth", params={"id": gen_id})
    r.raise_for_status()
    return r.json()


def segment_ids(t: dict, kind: str) -> list[list[int]]:
    return [t["ids"][s["start"]:s["end"]] for s in t["segments"] if s["kind"] == kind]


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family_name", ["kimi-k2.5", "kimi-k2", "kimi-k2-thinking"])
def test_ground_truth_is_consistent_and_reconstructs_exactly(tok_fam, family_name):
    """Truth segments decode to the returned text; reconstruction of the returned body (exact
    profile) gives exactly the truth ids, and usage counts them all."""
    from eagledata.tokens.reconstruct import reconstruct_completion

    tok, _ = tok_fam
    fam = get_family(family_name)
    sim_specials = {tok.special_id(n) for n in fam.completion_specials()}
    seen_literal_eot = 0
    with SimulatorServer(tok, fam, seed=11) as sim:
        for i in range(40):
            b = body(i, tools=i % 2 == 1, stream=i % 3 == 0)
            r = post(sim, b)
            assert r.status_code == 200
            parsed = parse_response(r.text, r.status_code)
            assert parsed.ok, parsed.error
            t = truth(sim, parsed.generation_id)
            # segments tile the ids; text segments are plain text, special segments one named id
            assert [s["start"] for s in t["segments"]][0] == 0 and t["segments"][-1]["end"] == len(t["ids"])
            for s in t["segments"]:
                ids = t["ids"][s["start"]:s["end"]]
                if "text" in s:
                    assert tok.decode(ids) == s["text"] and not set(ids) & sim_specials
                else:
                    assert len(ids) == 1 and tok.decode(ids) == getattr(fam, s["kind"])
            assert t["ids"][-1] == tok.special_id(fam.end_of_turn) and t["stopped"]
            assert parsed.completion_tokens == len(t["ids"])
            assert parsed.prompt_tokens == len(t["prompt_ids"])
            reasoning = segment_ids(t, "reasoning")
            assert parsed.reasoning_tokens == sum(map(len, reasoning))
            assert (parsed.reasoning is not None) == fam.thinking
            seen_literal_eot += fam.end_of_turn in (parsed.content or "")
            rc = reconstruct_completion(parsed, tok, fam, count_tool_calls(b["messages"]), request_thinking(b))
            assert rc.ids == t["ids"], (i, rc.flags)
            assert [s.to_dict() for s in rc.segments] == t["segments"]
    assert seen_literal_eot, "expected some content with literal end-of-turn text (plain tokens)"


def test_profiles_no_eot_and_quirks(k25):
    tok, fam = k25
    b = body(3, tools=True, tool_choice="required")
    with SimulatorServer(tok, fam, seed=5, profile="no-eot") as sim:
        p = parse_response(post(sim, b).text)
        assert p.completion_tokens == len(truth(sim, p.generation_id)["ids"]) - 1
    with SimulatorServer(tok, fam, seed=5, profile="call-ids") as sim:
        p = parse_response(post(sim, b).text)
        assert p.tool_calls and all(c.id.startswith("call_") for c in p.tool_calls)
    with SimulatorServer(tok, fam, seed=5, profile="markup-in-content") as sim:
        p = parse_response(post(sim, b).text)
        assert not p.tool_calls and fam.tool_section_begin in p.content and p.finish_reason == "stop"
    with SimulatorServer(tok, fam, seed=5, profile="drop-reasoning") as sim:
        assert parse_response(post(sim, b).text).reasoning is None
    custom = replace(PROFILES["exact"], name="counts-close", reasoning_tokens_include_close=True)
    with SimulatorServer(tok, fam, seed=5, profile=custom) as sim:
        p = parse_response(post(sim, b).text)
        assert p.reasoning_tokens == len(segment_ids(truth(sim, p.generation_id), "reasoning")[0]) + 1


def test_deterministic_under_seed(k25):
    tok, fam = k25
    b = body(7, tools=True)

    def ids(seed: int, b: dict) -> list[int]:
        with SimulatorServer(tok, fam, seed=seed) as sim:
            r = parse_response(post(sim, b).text)
            return truth(sim, r.generation_id)["ids"]

    first = ids(1, b)
    assert ids(1, b) == first
    assert ids(2, b) != first
    assert ids(1, {**b, "seed": 99}) != first  # the request's own seed is request content
    assert ids(1, {**b, "stream": True}) == first  # streaming does not change the completion


def test_json_and_sse_parse_to_the_same_message(k25):
    tok, fam = k25
    with SimulatorServer(tok, fam, seed=3) as sim:
        for i in range(12):
            b = body(i, tools=True)
            j = post(sim, b)
            s = post(sim, {**b, "stream": True})
            assert j.headers["content-type"].startswith("application/json")
            assert s.headers["content-type"].startswith("text/event-stream")
            assert j.text.startswith("\n") and s.text.startswith(": OPENROUTER PROCESSING")
            assert s.text.rstrip().endswith("data: [DONE]")
            pj, ps = parse_response(j.text), parse_response(s.text)
            assert pj.ok and ps.ok and ps.streamed and not pj.streamed
            for field in ("reasoning", "content", "finish_reason", "native_finish_reason", "tool_calls"):
                assert getattr(pj, field) == getattr(ps, field), field
            for key in ("prompt_tokens", "completion_tokens", "total_tokens", "completion_tokens_details"):
                assert pj.usage[key] == ps.usage[key]


def test_truncation_on_max_tokens(k25):
    tok, fam = k25
    with SimulatorServer(tok, fam, seed=4) as sim:
        full = parse_response(post(sim, body(1)).text)
        full_ids = truth(sim, full.generation_id)["ids"]
        for n in (1, 5, len(full_ids) - 1):
            for stream in (False, True):
                p = parse_response(post(sim, body(1, max_tokens=n, stream=stream)).text)
                assert p.ok and p.finish_reason == "length" and p.native_finish_reason == "length"
                t = truth(sim, p.generation_id)
                assert t["ids"] == full_ids[:n] and not t["stopped"]
                assert tok.special_id(fam.end_of_turn) not in t["ids"]
                assert p.completion_tokens == n
        # cut inside the reasoning: everything returned is reasoning, content empty
        p = parse_response(post(sim, body(1, max_tokens=3)).text)
        assert p.content == "" and p.reasoning == tok.decode(full_ids[:3])
        assert full.usage["completion_tokens"] == len(full_ids)


def test_tool_calls_count_across_the_conversation(k25):
    tok, fam = k25
    history = [
        {"role": "user", "content": "Weather in Paris and Rome, then add 2 and 3."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}},
            {"id": "functions.get_weather:1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "rain"},
    ]
    assert count_tool_calls(history) == 2
    n_calls = 0
    with SimulatorServer(tok, fam, seed=8) as sim:
        for i in range(20):
            b = {**body(i, tools=True), "messages": history + [{"role": "user", "content": f"go {i}"}],
                 "tool_choice": "required"}
            p = parse_response(post(sim, b).text)
            assert p.finish_reason == "tool_calls" and p.tool_calls
            t = truth(sim, p.generation_id)
            tool_ids = [tok.decode(x) for x in segment_ids(t, "tool_id")]
            assert [c.id for c in p.tool_calls] == tool_ids
            for k, call in enumerate(p.tool_calls):
                n_calls += 1
                assert call.id == f"functions.{call.name}:{2 + k}"
                args = json.loads(call.arguments)
                if call.name == "get_weather":
                    assert isinstance(args["city"], str) and 1 <= args["days"] <= 7
                    assert set(args) <= {"city", "unit", "days", "detailed"}
                    assert args.get("unit", "celsius") in ("celsius", "fahrenheit")
                else:
                    assert isinstance(args["a"], (int, float)) and isinstance(args["b"], (int, float))
            # tool_choice none: never a call
            p = parse_response(post(sim, {**b, "tool_choice": "none"}).text)
            assert not p.tool_calls and p.finish_reason == "stop"
    assert n_calls > 20  # some responses made parallel calls


def test_faults_request_counts_and_endpoints(k25):
    tok, fam = k25
    faults = {1: Fault.http(429, retry_after=2), 2: "502", 3: "error-in-200", 4: "mid-stream", 5: "400"}
    with SimulatorServer(tok, fam, seed=1, faults=faults) as sim:
        r = post(sim, body(0))
        assert r.status_code == 429 and r.headers["retry-after"] == "2"
        assert parse_response(r.text, 429).error.code == 429
        assert post(sim, body(0)).status_code == 502
        r = post(sim, body(0))
        assert r.status_code == 200 and parse_response(r.text).error.where == "body"
        r = post(sim, body(0, stream=True))
        p = parse_response(r.text)
        assert r.status_code == 200 and p.error is not None and p.error.where == "stream"
        assert post(sim, body(0)).status_code == 400
        r = post(sim, body(0))
        assert r.status_code == 200 and parse_response(r.text).ok
        assert sim.request_counts[prompt_hash(body(0))] == 6 and sim.requests_total == 6
        gen_id = parse_response(r.text).generation_id
        stats = HTTP.get(sim.base_url + "/generation", params={"id": gen_id}).json()["data"]
        assert stats["native_tokens_completion"] == parse_response(r.text).completion_tokens
        assert stats["total_cost"] == pytest.approx(parse_response(r.text).cost)
        assert HTTP.get(sim.base_url + "/generation", params={"id": "gen-nope"}).status_code == 404
        bad = HTTP.post(sim.base_url + "/chat/completions", content=b"{not json", timeout=5)
        assert bad.status_code == 400 and "error" in bad.json()
        assert post(sim, {"model": "m", "messages": []}).status_code == 400


def test_cost_from_price(k25):
    tok, fam = k25
    with SimulatorServer(tok, fam, price_per_mtok={"prompt": 1.0, "completion": 10.0}) as sim:
        p = parse_response(post(sim, body(2)).text)
        assert p.cost == pytest.approx(p.prompt_tokens * 1e-6 + p.completion_tokens * 1e-5)


# --------------------------------------------------------------------------------------------
# profiles reproducing real providers, new faults, cost accounting, SGLang shapes


def test_more_provider_profiles(k25):
    tok, fam = k25
    b = body(3, tools=True, tool_choice="required")
    with SimulatorServer(tok, fam, seed=5, profile="call-ids-index") as sim:
        p = parse_response(post(sim, b).text)
        assert [c.id for c in p.tool_calls] == [str(i) for i in range(len(p.tool_calls))]
    with SimulatorServer(tok, fam, seed=5, profile="call-ids-name") as sim:
        p = parse_response(post(sim, b).text)
        assert [c.id for c in p.tool_calls] == [f"{c.name}:{i}" for i, c in enumerate(p.tool_calls)]
    with SimulatorServer(tok, fam, seed=5, profile="markup-in-reasoning") as sim:
        p = parse_response(post(sim, b).text)
        assert not p.tool_calls and p.reasoning.endswith(fam.tool_section_end) and fam.tool_call_begin in p.reasoning
    with SimulatorServer(tok, fam, seed=5, profile="reasoning-counts-close") as sim:
        p = parse_response(post(sim, b).text)
        assert p.reasoning_tokens == len(segment_ids(truth(sim, p.generation_id), "reasoning")[0]) + 1
    with SimulatorServer(tok, fam, seed=5) as exact, SimulatorServer(tok, fam, seed=5, profile="truncating") as sim:
        full = truth(exact, parse_response(post(exact, body(4)).text).generation_id)["ids"]
        p = parse_response(post(sim, body(4)).text)
        t = truth(sim, p.generation_id)
        assert p.finish_reason == "length" and t["ids"] == full[: len(full) // 2] and not t["stopped"]
        assert p.completion_tokens == len(full) // 2 and t["quirks"] == [f"cap@{len(full) // 2}"]


def test_noncanonical_split_profile(k25):
    """The provider's model emitted a non-canonical split: same text, other ids, billed one more."""
    tok, fam = k25
    seen = 0
    with SimulatorServer(tok, fam, seed=6, profile="noncanonical") as sim:
        for i in range(8):
            r = post(sim, body(i, tools=i % 2 == 1))
            p = parse_response(r.text)
            t = truth(sim, p.generation_id)
            if not t["quirks"]:
                continue
            seen += 1
            canonical = []
            for s in t["segments"]:
                canonical += tok.encode_plain(s["text"]) if "text" in s else t["ids"][s["start"]:s["end"]]
            assert canonical != t["ids"] and len(t["ids"]) == len(canonical) + 1
            assert tok.decode(canonical) == tok.decode(t["ids"])
            assert p.completion_tokens == len(t["ids"])  # billed: the ids the model produced
            for s in t["segments"]:
                if "text" in s:
                    assert tok.decode(t["ids"][s["start"]:s["end"]]) == s["text"]
    assert seen >= 6


def test_new_faults_cost_accounting_and_key(k25):
    tok, fam = k25
    faults = {1: "503:1.5", 2: "malformed", 3: "reset", 4: "error-in-200", 5: "malformed"}
    with SimulatorServer(tok, fam, seed=1, faults=faults, price_per_mtok=(1.0, 2.0)) as sim:
        r = post(sim, body(0))
        assert r.status_code == 503 and r.headers["retry-after"] == "1.5"
        r = post(sim, body(0))
        assert r.status_code == 200 and parse_response(r.text).error.where == "malformed"
        assert r.headers["x-generation-id"].startswith("gen-")
        with pytest.raises(httpx.TransportError):
            httpx.post(sim.base_url + "/chat/completions", json=body(0), timeout=5)
        billed = sim.billed_usd
        assert parse_response(post(sim, body(0)).text).error.where == "body"
        assert sim.billed_usd == billed  # errors in 200 bodies are not billed
        p = parse_response(post(sim, body(0, stream=True)).text)
        assert p.error is not None
        ok = parse_response(post(sim, body(0)).text)
        assert ok.ok and sim.generations[ok.generation_id].billed == pytest.approx(ok.cost)
        key = HTTP.get(sim.base_url + "/key").json()["data"]
        assert key["usage"] == pytest.approx(sim.billed_usd) and sim.billed_usd > ok.cost


def test_sglang_shapes(k25):
    tok, fam = k25
    eot = tok.special_id(fam.end_of_turn)
    with SimulatorServer(tok, fam, seed=3, api="sglang") as sim:
        assert sim.base_url.endswith("/v1")
        b = {**body(1, tools=True, tool_choice="required"), "return_token_ids": True}
        j = HTTP.post(sim.base_url + "/chat/completions", json=b).json()
        ch = j["choices"][0]
        t = sim.truth("gen-" + j["id"])
        # SGLang's tool-call parser turns the stop finish into tool_calls and clears the match
        assert ch["token_ids"] == t["ids"] and t["ids"][-1] == eot and ch["finish_reason"] == "tool_calls"
        assert ch["matched_stop"] is None
        assert ch["prompt_token_ids"] == t["prompt_ids"] and j["usage"]["completion_tokens"] == len(t["ids"])
        assert ch["message"]["reasoning_content"] and ch["message"]["tool_calls"][0]["id"].startswith("functions.")
        bad = HTTP.post(sim.base_url + "/chat/completions", json={**b, "stream": True})
        assert bad.status_code == 400 and bad.json()["object"] == "error"
        g = HTTP.post(sim.root_url + "/generate", json={"input_ids": t["prompt_ids"],
                                                        "sampling_params": {"max_new_tokens": 5}}).json()
        assert len(g["output_ids"]) == 5 and g["meta_info"]["finish_reason"]["type"] == "length"
        assert g["meta_info"]["prompt_tokens"] == len(t["prompt_ids"])
        assert HTTP.get(sim.root_url + "/health").status_code == 200

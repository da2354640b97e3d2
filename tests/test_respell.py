"""One request, two spellings (eagledata.generate.respell): a config that writes ``temperature: 1``
where it wrote ``1.0`` (or the reverse) sends nothing again; the answers cached under the other
spelling are output as received. Generated against the stand-in on loopback."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from eagledata.generate.job import generate_dataset
from eagledata.generate.plan import plan_dataset
from eagledata.generate.respell import as_integers, settings_spelling
from eagledata.standin.server import SimulatorServer
from gen_helpers import API_KEY, generate_cmd, ledger_rows, make_config, quiet, read_jsonl, write_prompts


def test_integral_floats_read_as_integers_and_nothing_else():
    value = {"temperature": 1.0, "top_p": 0.95, "flag": True, "n": [2.0, 2.5, False], "x": float("inf")}
    assert as_integers(value) == {"temperature": 1, "top_p": 0.95, "flag": True, "n": [2, 2.5, False], "x": float("inf")}
    assert type(as_integers(1.0)) is int and as_integers(True) is True
    # the content is never a settings spelling; a request without an integral float has none to keep
    assert settings_spelling({"messages": [{"role": "user", "content": 1.0}], "temperature": 0.5}) is None
    assert settings_spelling({"messages": [], "temperature": 1.0, "max_tokens": 64}) == \
        ('{"max_tokens":64,"temperature":1}', '{"max_tokens":64,"temperature":1.0}')


@pytest.fixture
def sim(k25, monkeypatch):
    monkeypatch.setenv("OPENROUTER_API_KEY", API_KEY)
    server = SimulatorServer(*k25, seed=2).start()
    yield server
    server.stop()


def with_generation(cfg: dict, **settings) -> dict:
    out = json.loads(json.dumps(cfg))
    out["generation"].update(settings)
    return out


@pytest.mark.parametrize("paid, now", [(1.0, 1), (1, 1.0)])
def test_the_other_spelling_of_the_same_temperature_sends_nothing(sim, tmp_path, k25, paid, now):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 6)
    cfg = make_config(tmp_path, prompts, str(k25[0].source), api_base=sim.base_url, temperature=paid, top_p=1.0)
    out = tmp_path / "results/d/responses.jsonl"
    assert generate_dataset(cfg, "d", out, log=quiet)["requested"] == 6 and sim.requests_total == 6
    first = read_jsonl(out)
    reservations = len(ledger_rows(tmp_path))

    cfg2 = with_generation(cfg, temperature=now)
    assert plan_dataset(cfg2, "d")["to_request"] == 0  # the dry run knows it too
    logs: list[str] = []
    summary = generate_dataset(cfg2, "d", out, log=logs.append)
    assert sim.requests_total == 6 and summary["http_requests"] == 0 and summary["requested"] == 0
    assert summary["respelled"] == 6 and summary["cached"] == 6
    assert len(ledger_rows(tmp_path)) == reservations
    assert any("6 answer(s) cached under another spelling" in m for m in logs)
    # the records as received, with the request as it was sent
    assert read_jsonl(out) == first
    assert all(json.dumps(r["request"]["temperature"]) == json.dumps(paid) for r in first)


def test_other_numbers_and_a_boolean_for_a_number_are_other_requests(sim, tmp_path, k25):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3)
    cfg = make_config(tmp_path, prompts, str(k25[0].source), api_base=sim.base_url, temperature=1.0)
    out = tmp_path / "results/d/responses.jsonl"
    generate_dataset(cfg, "d", out, log=quiet)
    assert sim.requests_total == 3
    assert generate_dataset(with_generation(cfg, temperature=0.9), "d", out, log=quiet)["requested"] == 3
    assert sim.requests_total == 6
    # extra_body's keys are settings too: true is not 1
    cfg_true = with_generation(cfg, extra_body={"logprobs": True})
    generate_dataset(cfg_true, "d", out, log=quiet)
    s = generate_dataset(with_generation(cfg, extra_body={"logprobs": 1}), "d", out, log=quiet)
    assert s["respelled"] == 0 and s["requested"] == 3 and sim.requests_total == 12
    assert generate_dataset(cfg_true, "d", out, log=quiet)["requested"] == 0


def test_the_content_is_never_respelled(sim, tmp_path, k25):
    """A tool declaration is part of the prompt the model reads: its ``1.0`` and ``1`` are other prompts."""
    def prompts(minimum):
        tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
            "type": "object", "properties": {"n": {"type": "number", "minimum": minimum}}}}}
        path = tmp_path / "p.jsonl"
        path.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}) + "\n")
        return path

    cfg = make_config(tmp_path, prompts(1.0), str(k25[0].source), api_base=sim.base_url, temperature=1.0)
    out = tmp_path / "results/d/responses.jsonl"
    assert generate_dataset(cfg, "d", out, log=quiet)["requested"] == 1
    prompts(1)
    s = generate_dataset(cfg, "d", out, log=quiet)
    assert s["requested"] == 1 and s["respelled"] == 0 and sim.requests_total == 2


def test_a_config_file_rewritten_with_the_other_spelling_through_the_job_command(sim, tmp_path, k25):
    """The YAML spelling itself, through ``python -m eagledata.generate.job``."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", 4)
    cfg = make_config(tmp_path, prompts, str(k25[0].source), api_base=sim.base_url, temperature=1.0, max_tokens=200)
    env = {**os.environ, "OPENROUTER_API_KEY": API_KEY}
    assert subprocess.run(generate_cmd(cfg, tmp_path), env=env, capture_output=True, text=True).returncode == 0
    assert sim.requests_total == 4
    cfg2 = with_generation(cfg, temperature=1)
    cmd = generate_cmd(cfg2, tmp_path, name="cfg2")
    assert "temperature: 1\n" in (tmp_path / "cfg2.yaml").read_text()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert sim.requests_total == 4
    summary = json.loads((tmp_path / "cache/d/generation_summary.json").read_text())
    assert summary["respelled"] == 4 and summary["requested"] == 0


def turns_dataset(tmp_path, k25, conversations: int, turns: int, **generation) -> tuple[dict, object]:
    """A ``turns: all`` dataset of ``conversations`` conversations of ``turns`` user turns each, on the
    stand-in backend: (config, output path)."""
    convs = [{"id": f"c{c}", "messages": [m for t in range(turns) for m in (
        {"role": "user", "content": f"c{c} turn {t}?"}, {"role": "assistant", "content": "ok"})][:-1]}
        for c in range(conversations)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(c) + "\n" for c in convs))
    cfg = make_config(tmp_path, prompts, str(k25[0].source), backend="simulator", **generation)
    cfg["datasets"]["d"]["turns"] = "all"
    return cfg, tmp_path / "results/d/responses.jsonl"


def test_turns_all_conversations_are_followed_through_the_other_spelling(tmp_path, k25):
    cfg, out = turns_dataset(tmp_path, k25, 2, 3, temperature=1)
    assert generate_dataset(cfg, "d", out, log=quiet)["requested"] == 6
    first = read_jsonl(out)
    cfg2 = with_generation(cfg, temperature=1.0)
    assert plan_dataset(cfg2, "d")["to_request"] == 0
    s = generate_dataset(cfg2, "d", out, log=quiet)
    assert s["requested"] == 0 and s["http_requests"] == 0 and s["respelled"] == 6
    assert read_jsonl(out) == first


def test_a_final_error_under_one_spelling_is_asked_again_under_the_other(sim, tmp_path, k25, monkeypatch):
    """A provider that checks types refuses ``max_tokens: 200.0`` (the stand-in does, with a 400);
    the config fixed to ``200`` sends the requests again instead of reusing the refusals. (The config
    refuses 200.0 now; a cache written by an eagledata that sent it is read here.)"""
    import eagledata.config
    import eagledata.generate.job as job

    prompts = write_prompts(tmp_path / "prompts.jsonl", 3, tools_every=0)
    cfg = make_config(tmp_path, prompts, str(k25[0].source), api_base=sim.base_url, max_tokens=200.0)
    with pytest.raises(eagledata.config.ConfigError, match="generation.max_tokens: 200.0 is not of type 'integer'"):
        generate_dataset(cfg, "d", tmp_path / "refused.jsonl", log=quiet)
    assert sim.requests_total == 0
    out = tmp_path / "results/d/responses.jsonl"
    legacy = eagledata.config.validate_config(with_generation(cfg, max_tokens=200))
    legacy["generation"]["max_tokens"] = 200.0
    with monkeypatch.context() as m:  # an earlier eagledata, which let 200.0 through
        m.setattr(job, "validate_config", lambda config: config)
        generate_dataset(legacy, "d", out, log=quiet)
    assert [r["status"] for r in read_jsonl(out)] == [400] * 3
    fixed = with_generation(cfg, max_tokens=200)
    assert plan_dataset(fixed, "d")["to_request"] == 3
    s = generate_dataset(fixed, "d", out, log=quiet)
    assert s["requested"] == 3 and s["respelled"] == 0 and sim.requests_total == 6
    assert [r["status"] for r in read_jsonl(out)] == [200] * 3


def test_an_integer_beyond_64_bits_is_never_taken_for_another_number(tmp_path):
    """The kept spellings are read back exactly: ``2**70 + 1`` is not the float ``2**70``."""
    from types import SimpleNamespace

    from eagledata.generate.cache import ResponseCache
    from eagledata.generate.requests import cache_key
    from eagledata.generate.respell import Respeller

    msgs = [{"role": "user", "content": "hi"}]
    big = 2 ** 70 + 1
    paid = {"B": {"model": "m", "messages": msgs, "temperature": 1.0, "x": float(2 ** 70)},
            "A": {"model": "m", "messages": msgs, "temperature": 1.0, "x": big}}
    path = tmp_path / "responses.jsonl"
    path.write_text("".join(json.dumps({"cache_key": cache_key(r), "request": r, "status": 200, "response_raw": name})
                            + "\n" for name, r in paid.items()))
    cache = ResponseCache(path)
    cache.load()
    now = {"model": "m", "messages": msgs, "temperature": 1, "x": big}  # A with its temperature respelled
    item = SimpleNamespace(request=now, sample_index=0, cache_key=cache_key(now))
    assert Respeller(cache, None).take([item]) == 1
    assert cache.get(item.cache_key)["response_raw"] == "A"
    assert cache.records == 2 and len(cache.index) == 3


def test_turns_all_finds_every_turn_in_one_pass_over_the_conversations(tmp_path, k25, monkeypatch):
    """The turn planner asks for the other spelling turn by turn: a respelled rerun follows the
    conversations as often as a rerun of the same config does (not once more per turn)."""
    from eagledata.generate.turns import TurnPlanner

    cfg, out = turns_dataset(tmp_path, k25, 3, 6, temperature=1)
    assert generate_dataset(cfg, "d", out, log=quiet)["requested"] == 18
    calls = []
    real = TurnPlanner.advance
    monkeypatch.setattr(TurnPlanner, "advance", lambda self: calls.append(1) or real(self))
    generate_dataset(cfg, "d", out, log=quiet)
    same = len(calls)
    calls.clear()
    s = generate_dataset(with_generation(cfg, temperature=1.0), "d", out, log=quiet)
    assert s["respelled"] == 18 and s["requested"] == 0 and len(calls) == same


def test_a_stopped_job_counts_the_answers_cached_not_the_spellings(sim, tmp_path, k25):
    from eagledata.generate.errors import JobStopped

    prompts = write_prompts(tmp_path / "prompts.jsonl", 3, tools_every=0)
    cfg = make_config(tmp_path, prompts, str(k25[0].source), api_base=sim.base_url, temperature=1.0)
    out = tmp_path / "results/d/responses.jsonl"
    generate_dataset(cfg, "d", out, log=quiet)
    write_prompts(tmp_path / "prompts.jsonl", 4, tools_every=0)  # one prompt more, which the budget refuses
    cfg2 = with_generation(cfg, temperature=1)
    cfg2["budget_usd"] = 1e-9
    with pytest.raises(JobStopped, match="3 of its 4 samples are cached"):
        generate_dataset(cfg2, "d", out, log=quiet)


def test_the_same_endpoint_spelled_otherwise_sends_nothing_again(sim, tmp_path, k25):
    """localhost and 127.0.0.1 (and the default port written or not) name one server: its answers,
    cached under one spelling of the endpoint, are taken under the other (with a respelled number too);
    another port is another server."""
    from eagledata.generate.requests import equivalent_salts

    assert equivalent_salts({"endpoint": "http://127.0.0.1:30000", "sglang": "chat"}) == [
        {"endpoint": f"http://{h}:30000", "sglang": "chat"} for h in ("localhost", "[::1]")]
    assert equivalent_salts({"endpoint": "https://openrouter.ai:443/api/v1"}) == [None]  # the default base
    assert equivalent_salts({"endpoint": "https://Proxy.example.com/v1"}) == [
        {"endpoint": "https://proxy.example.com/v1"}, {"endpoint": "https://proxy.example.com:443/v1"}]
    assert equivalent_salts(None) == [] and equivalent_salts({"endpoint": "http://10.0.0.5:8000/v1"}) == []

    prompts = write_prompts(tmp_path / "prompts.jsonl", 6)
    assert "127.0.0.1" in sim.base_url
    cfg = make_config(tmp_path, prompts, str(k25[0].source), api_base=sim.base_url, temperature=1.0)
    out = tmp_path / "results/d/responses.jsonl"
    generate_dataset(cfg, "d", out, log=quiet)
    first = read_jsonl(out)
    other = with_generation(cfg, api_base=sim.base_url.replace("127.0.0.1", "localhost"), temperature=1)
    assert plan_dataset(other, "d")["to_request"] == 0
    summary = generate_dataset(other, "d", out, log=quiet)
    assert sim.requests_total == 6 and summary["respelled"] == 6 and read_jsonl(out) == first
    with SimulatorServer(*k25, seed=2) as elsewhere:  # another server: asked
        summary = generate_dataset(with_generation(cfg, api_base=elsewhere.base_url), "d", out, log=quiet)
        assert summary["requested"] == 6 and elsewhere.requests_total == 6

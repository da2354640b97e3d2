"""Paced SSE streams of the stand-in: the chunks really spread over the response's latency (measured
on loopback), and the bytes are those of the unpaced stream of the same generation (same truth)."""
from __future__ import annotations

import time

import httpx
import pytest

from eagledata.standin.responses import pace_events, sse_events
from eagledata.standin.server import PROCESSING_COMMENT, SimulatorServer
from eagledata.tokens.responses import parse_response


pytestmark = pytest.mark.timing  # runs alone under xdist (tests/conftest.py)


def body(i: int) -> dict:
    return {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": f"Question number {i}?"}],
            "max_tokens": 2000, "stream": True, "usage": {"include": True},
            "tools": [{"type": "function", "function": {"name": "add", "parameters": {
                "type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]}}}]}


def timed_stream(sim: SimulatorServer, b: dict) -> tuple[bytes, list[float], str]:
    """The stream's bytes, the arrival time of each ``data:`` event (seconds after sending) and
    the generation id."""
    arrivals: list[float] = []
    parts: list[bytes] = []
    with httpx.Client(timeout=30) as client:
        t0 = time.perf_counter()
        with client.stream("POST", sim.base_url + "/chat/completions", json=b) as r:
            assert r.status_code == 200
            gen_id = r.headers["x-generation-id"]
            for piece in r.iter_bytes():
                now = time.perf_counter() - t0
                parts.append(piece)
                arrivals += [now] * piece.count(b"data: ")
    return b"".join(parts), arrivals, gen_id


def unpaced_bytes(sim: SimulatorServer, gen_id: str) -> bytes:
    """What the unpaced stand-in sends for that generation."""
    g = sim.generations[gen_id]
    return (PROCESSING_COMMENT + "\n\n" + "".join(f"data: {e}\n\n" for e in sse_events(g))).encode("utf-8")


def test_pace_events_spreads_text_over_the_latency_at_one_rate():
    generated = [4, 8, 0, 4, 4, 0, 0]  # text chunks, then events with no text (finish, usage, [DONE])
    times = pace_events(generated, latency_s=2.0, first_token_s=0.4, write_s=0)
    assert times[0] == pytest.approx(0.4)  # first chunk at the time to first token
    # the rest at one rate: 16 characters over 1.6 s
    assert times[1] == pytest.approx(0.4 + 1.6 * 8 / 16)
    assert times[2] == times[1]  # an event with no text leaves with the text before it
    assert times[3] == pytest.approx(0.4 + 1.6 * 12 / 16)
    assert times[4:] == pytest.approx([2.0, 2.0, 2.0])  # the stream ends at the latency
    grid = pace_events(generated, latency_s=2.0, first_token_s=0.4, write_s=0.3)
    assert grid[0] == pytest.approx(0.4)
    assert grid[1] == pytest.approx(1.2) and grid[3] == pytest.approx(1.8) and grid[4] == pytest.approx(2.0)
    assert all(a <= b for a, b in zip(grid, grid[1:])) and all(g >= t - 1e-9 for g, t in zip(grid, times))
    assert pace_events([5], 1.0, 3.0, 0) == [1.0]  # the time to first token never exceeds the latency
    assert pace_events([5, 0, 0], 1.0, 0.2, 0) == pytest.approx([0.2, 1.0, 1.0])


def test_paced_stream_spreads_chunks_over_the_latency_with_the_unpaced_bytes(k25):
    tok, fam = k25
    latency = 0.8
    options = dict(seed=5, latency_ms=latency * 1000, content_tokens=(150, 200), reasoning_tokens=(40, 60),
                   tool_call_probability=0.5)
    with SimulatorServer(tok, fam, paced_streams=True, first_token_ms=150, stream_write_ms=10, **options) as paced, \
            SimulatorServer(tok, fam, **options) as unpaced:
        for i in range(3):
            raw, arrivals, gen_id = timed_stream(paced, body(i))
            # the same bytes as the unpaced stream of this generation
            assert raw == unpaced_bytes(paced, gen_id)
            # spread in time: first chunk near the time to first token, the last at the latency,
            # and the text in between arriving steadily (not in one burst)
            assert len(arrivals) > 15
            assert 0.13 <= arrivals[0] <= 0.45, arrivals[0]
            assert latency - 0.02 <= arrivals[-1] <= latency + 0.4, arrivals[-1]
            middle = arrivals[len(arrivals) // 2]
            assert 0.3 <= middle <= latency - 0.1, middle
            buckets = {int(t / 0.05) for t in arrivals}
            assert len(buckets) >= 8, sorted(buckets)
            # the unpaced stand-in sends the whole stream at once, after the latency
            raw_u, arrivals_u, gen_u = timed_stream(unpaced, body(i))
            assert raw_u == unpaced_bytes(unpaced, gen_u)
            assert arrivals_u[-1] - arrivals_u[0] < 0.1 and arrivals_u[0] >= latency - 0.02
            # same truth and the same parsed answer
            p, u = parse_response(raw.decode()), parse_response(raw_u.decode())
            assert p.ok and u.ok
            for field in ("reasoning", "content", "finish_reason", "tool_calls"):
                assert getattr(p, field) == getattr(u, field), field
            assert p.usage == u.usage
            assert paced.truth(gen_id)["ids"] == unpaced.truth(gen_u)["ids"]


def test_simulator_backend_paces_streams_from_the_config(tmp_path, k25, monkeypatch):
    from eagledata.config import validate_config
    from eagledata.generate.job import generate_dataset
    from gen_helpers import make_config, quiet, read_jsonl, write_prompts

    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    tok, _ = k25
    paced_answers: list[float] = []
    real_paced = SimulatorServer._paced

    def spy(self, events):
        actions = real_paced(self, events)
        paced_answers.append(max(a[1] for a in actions if a[0] == "until"))
        return actions

    monkeypatch.setattr(SimulatorServer, "_paced", spy)
    cfg = make_config(tmp_path, write_prompts(tmp_path / "p.jsonl", 4), tok.source, backend="simulator", stream=True)
    cfg["simulator"].update(latency_ms=300, latency_jitter_ms=100, paced_streams=True, first_token_ms=50)
    cfg = validate_config(cfg, "test")  # the knobs are in the schema
    summary = generate_dataset(cfg, "d", tmp_path / "out.jsonl", log=quiet)
    recs = read_jsonl(tmp_path / "out.jsonl")
    assert summary["requested"] == 4 and all(parse_response(r["response_raw"]).ok for r in recs)
    assert len(paced_answers) == 4 and all(0.3 <= t <= 0.4 for t in paced_answers)  # each stream spans its latency
    assert all(r["elapsed_s"] >= 0.3 for r in recs)

"""Generation client throughput against the stand-in, as ratios measured in one run.

The stand-in (``python -m eagledata.standin``) runs in a SEPARATE process; the generation job (the same
code as the ``generate`` rule, with the budget ledger, the response cache and progress) runs here with
``concurrency`` workers. The default is the real load shape compressed in time: 1,024 in flight, latency
3 s +- 1 s, 6,144 requests, non-streamed bodies of 5-20 KB. A real run has 1,024 in flight at about 30 s
mean latency, i.e. about 34 requests/s; the client's CPU per request times 34 is what it costs there.
``--reference`` runs the old 50 ms / 256-in-flight shape, printed with no target.

``--stream``: the same answers as SSE streams that the stand-in paces over each response's latency
(``--paced-streams``: the first chunk after 300 ms, then chunks of one to three words at the rate that
ends the stream at its latency; the chunks due within 20 ms leave in one write), about 1,000 events
and 330 KB per answer. Each stream lasts 3 s +- 1 s (ten times faster than a real one), but only 102
are in flight (a real run's 34 streams/s x 3 s), so the client receives and parses the events per
second of a real run (about 35,000/s); 1,024 in flight would ask ten times that. ``--unpaced`` sends
each stream whole after its latency.
Printed:

  throughput ratio = requests/s / (concurrency / mean latency)  target >= 0.95 (real shape)
                     steady state: answers stored between the 10% and the 90% mark of the run, over
                     that time (each record's started_at + elapsed_s); also printed for the whole
                     request phase, which adds the ramp-up (connections opened) and the last wave
  client CPU       = this process's CPU time / wall time; per request x 34 requests/s  target <= 0.1 core
  ceiling          = the same requests sent by a bare loop over the same HTTP client (no ledger,
                     cache, parsing): what the stand-in, the cores and loopback allow at that moment

Samples are ``--prompts`` distinct prompts x ``--samples`` each (identical bodies without a seed, so
the stand-in answers from its completion memo and its own CPU is not what is measured).

Usage: python benchmarks/generation_throughput.py [--reference] [--requests N] [--concurrency N]
       [--latency-ms MS] [--latency-jitter-ms MS] [--content-tokens MIN MAX] [--rounds 1]
       [--stream [--unpaced] [--first-token-ms MS] [--stream-write-ms MS]]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tokenizer_dir(tmp: Path) -> Path:
    shared = Path(os.environ.get("EAGLEDATA_SHARED", ROOT.parent / "shared")) / "tokenizers" / "kimi-k2.5"
    if shared.exists():
        return shared
    from eagledata.demo.tokenizer import build_demo_tokenizer, default_corpus_path

    out = tmp / "demo-tokenizer"
    build_demo_tokenizer(default_corpus_path(), out)
    return out


def mean_latency_s(args: argparse.Namespace) -> float:
    """The stand-in's mean latency: ``latency_ms`` plus half the jitter (it adds uniform(0, jitter))."""
    return (args.latency_ms + args.latency_jitter_ms / 2) / 1000


def max_tokens(args: argparse.Namespace) -> int:
    """Room for the longest answer asked of the stand-in (content, reasoning, markup)."""
    return max(256, args.content_tokens[1] + 64)


def stored_at(record: dict) -> float:
    """When a cached answer was stored: its request's start plus its elapsed time (epoch seconds)."""
    from datetime import datetime

    return datetime.fromisoformat(record["started_at"]).timestamp() + record["elapsed_s"]


def one_round(args: argparse.Namespace, tok: Path, base: str, tmp: Path, stand_in_pid: int) -> dict:
    """One generation job against the running stand-in, in a fresh cache; its measurements."""
    import psutil

    from eagledata.generate.job import generate_dataset

    tmp.mkdir(parents=True, exist_ok=True)
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"Question {i}?"}]}) + "\n"
                               for i in range(args.prompts)))
    samples = max(1, args.requests // args.prompts)
    config = {"cache_dir": str(tmp / "cache"), "results_dir": str(tmp / "results"), "budget_usd": 1000.0,
              "models": {"m": {"family": "kimi-k2.5", "tokenizer": str(tok), "api_model": "moonshotai/kimi-k2.5",
                               "price_per_mtok": {"prompt": 0.6, "completion": 2.5}}},
              "generation": {"api_base": base, "max_tokens": max_tokens(args), "concurrency": args.concurrency,
                             "samples_per_prompt": samples, "stream": args.stream, "timeout_s": 60,
                             "event_loop": args.event_loop},
              "datasets": {"bench": {"prompts": str(prompts), "model": "m", "backend": "openrouter"}}}
    stand_in = psutil.Process(stand_in_pid)
    s0 = sum(stand_in.cpu_times()[:2])
    c0, w0 = time.process_time(), time.perf_counter()
    summary = generate_dataset(config, "bench", tmp / "results" / "bench" / "responses.jsonl", log=lambda _: None)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    server_cpu = sum(stand_in.cpu_times()[:2]) - s0
    records = [json.loads(line) for line in open(tmp / "cache" / "bench" / "responses.jsonl")]
    stored = sorted(stored_at(r) for r in records)
    events = sum(r["response_raw"].count("\ndata: ") + r["response_raw"].startswith("data: ") for r in records)
    body_bytes = sum(len(r["response_raw"].encode("utf-8")) for r in records)
    n = summary["requested"]
    assert summary["ok"] == n == summary["http_requests"], summary
    ideal = args.concurrency / mean_latency_s(args)
    lo, hi = len(stored) // 10, len(stored) * 9 // 10
    phase, pcpu = summary["request_phase_s"], summary["request_phase_cpu_s"]
    return {"n": n, "steady": (hi - lo) / (stored[hi] - stored[lo]) / ideal, "phase": n / phase / ideal,
            "whole": n / wall / ideal, "phase_s": phase, "wall_s": wall, "cpu_core": cpu / wall, "phase_core": pcpu / phase,
            "us_per_request": 1e6 * pcpu / n, "stand_in_core": server_cpu / wall,
            "events_per_request": events / n, "events_per_s": events / phase, "kb_per_request": body_bytes / n / 1024}


def bare_round(args: argparse.Namespace, base: str) -> dict:
    """The same requests with nothing but the HTTP client (no ledger, cache, parsing or records):
    what this stand-in, these cores and loopback allow at this moment, the ceiling for the job."""
    import asyncio

    from eagledata.eventloop import run as run_event_loop
    from eagledata.generate.transport import new_client, send

    url = base + "/chat/completions"
    headers = {"Authorization": "Bearer x", "Content-Type": "application/json"}
    bodies = [json.dumps({"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": f"Question {i}?"}],
                          "max_tokens": max_tokens(args), "stream": args.stream}).encode() for i in range(args.prompts)]
    n = max(1, args.requests // args.prompts) * args.prompts

    async def run() -> dict:
        pending = iter(range(n))
        done: list[float] = []

        async def worker() -> None:
            async with new_client(headers=headers) as client:  # one client per worker, as the job does
                for i in pending:
                    r = await send(client, "POST", url, bodies[i % len(bodies)], timeout=60)
                    assert r.status == 200, r.body[:200]
                    done.append(time.perf_counter())

        c0, w0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        ideal = args.concurrency / mean_latency_s(args)
        lo, hi = n // 10, n * 9 // 10
        return {"steady": (hi - lo) / (done[hi] - done[lo]) / ideal, "phase": n / wall / ideal, "core": cpu / wall,
                "us_per_request": 1e6 * cpu / n}

    return run_event_loop(run(), args.event_loop)


def stand_in_command(args: argparse.Namespace, tok: Path, port_file: Path) -> list[str]:
    """The stand-in's command line: its own process, the shape's latency and answer lengths; with
    ``--stream`` (unless ``--unpaced``) each SSE stream lasts the response's latency, its first
    chunk after ``--first-token-ms``, then chunks of a few tokens at the rate that fills the rest."""
    cmd = [sys.executable, "-m", "eagledata.standin", "--tokenizer", str(tok), "--family", "kimi-k2.5",
           "--latency-ms", str(args.latency_ms), "--latency-jitter-ms", str(args.latency_jitter_ms),
           "--port-file", str(port_file), "--content-tokens", *map(str, args.content_tokens), "--reasoning-tokens", "8", "24"]
    if args.stream and not args.unpaced:
        cmd += ["--paced-streams", "--first-token-ms", str(args.first_token_ms), "--stream-write-ms", str(args.stream_write_ms)]
    return cmd


def body_kind(args: argparse.Namespace) -> str:
    if not args.stream:
        return "JSON bodies"
    if args.unpaced:
        return "SSE streams sent whole after the latency"
    return (f"SSE streams paced over the latency (first chunk at {args.first_token_ms:g} ms, "
            f"writes every {args.stream_write_ms:g} ms)")


#: The real load shape, compressed in time (the target), and the old 50 ms reference shape.
# The stand-in waits latency_ms + uniform(0, latency_jitter_ms): 2 s + U(0, 2 s) is 3 s +- 1 s.
REAL = {"requests": 6144, "concurrency": 1024, "latency_ms": 2000.0, "latency_jitter_ms": 2000.0,
        "content_tokens": [1250, 5000]}
#: Paced streams: the same latency and answers, but 102 in flight (a real run's 34 streams/s x 3 s), so the
#: client parses the SSE events per second of a real run; 1,024 in flight would ask ten times that.
STREAMED = {"requests": 2048, "concurrency": 102, "first_token_ms": 300.0, "stream_write_ms": 20.0}
REFERENCE = {"requests": 8192, "concurrency": 256, "latency_ms": 50.0, "latency_jitter_ms": 0.0, "content_tokens": [8, 24]}
REAL_REQUESTS_PER_S = 34  # 1,024 in flight at about 30 s mean latency


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", action="store_true", help="the 50 ms / 256-in-flight shape (no target)")
    ap.add_argument("--requests", type=int, default=None, help="default 6144 (--stream: 2048; reference: 8192)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=None, help="default 1024 (--stream: 102; reference: 256)")
    ap.add_argument("--latency-ms", type=float, default=None, help="the stand-in's fixed latency; default 2000 (reference: 50)")
    ap.add_argument("--latency-jitter-ms", type=float, default=None,
                    help="the stand-in adds uniform(0, this) to each latency; default 2000, i.e. 3 s +- 1 s (reference: 0)")
    ap.add_argument("--content-tokens", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                    help="answer length range (about 4 bytes of body per token): default 1250 5000 = 5-20 KB bodies")
    ap.add_argument("--rounds", type=int, default=1, help="jobs run one after another; the median is the result")
    ap.add_argument("--event-loop", default="auto", choices=["auto", "uvloop", "asyncio"])
    ap.add_argument("--stream", action="store_true",
                    help="SSE streams instead of JSON bodies, paced by the stand-in over each response's latency")
    ap.add_argument("--unpaced", action="store_true", help="with --stream: each stream sent whole after its latency")
    ap.add_argument("--first-token-ms", type=float, default=STREAMED["first_token_ms"],
                    help="paced streams: time to the first chunk (default 300: a tenth of the mean latency)")
    ap.add_argument("--stream-write-ms", type=float, default=STREAMED["stream_write_ms"],
                    help="paced streams: the stand-in sends the chunks due within this interval in one write (default 20)")
    args = ap.parse_args()
    shape = REFERENCE if args.reference else REAL
    if args.stream and not args.reference:
        shape = {**shape, "requests": STREAMED["requests"], "concurrency": STREAMED["concurrency"]}
    for key, value in shape.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    os.environ.setdefault("OPENROUTER_API_KEY", "sk-or-v1-benchmark-not-a-real-key")

    rounds = []
    with tempfile.TemporaryDirectory(prefix="eagledata-bench-") as d:
        tmp = Path(d)
        tok = _tokenizer_dir(tmp)
        port_file = tmp / "port"
        server = subprocess.Popen(stand_in_command(args, tok, port_file), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            t0 = time.monotonic()
            while not port_file.exists() or not port_file.read_text():
                if server.poll() is not None or time.monotonic() - t0 > 60:
                    raise SystemExit(f"stand-in did not start: {server.stderr.read().decode()[-2000:]}")
                time.sleep(0.05)
            base = f"http://127.0.0.1:{port_file.read_text()}/api/v1"
            bare = bare_round(args, base)
            print(f"bare HTTP loop: steady {bare['steady']:.3f}, request phase {bare['phase']:.3f}, "
                  f"{bare['core']:.2f} core, {bare['us_per_request']:.0f} us CPU/request")
            for i in range(args.rounds):
                r = one_round(args, tok, base, tmp / f"round{i}", server.pid)
                rounds.append(r)
                answers = f"{r['kb_per_request']:.1f} KB per answer"
                if args.stream:
                    answers += f", {r['events_per_request']:.0f} SSE events each ({r['events_per_s']:,.0f} events/s)"
                print(f"round {i + 1}: steady {r['steady']:.3f}, request phase {r['phase']:.3f}, client "
                      f"{r['phase_core']:.2f} core, {r['us_per_request']:.0f} us CPU/request, stand-in "
                      f"{r['stand_in_core']:.2f} core, {answers}")
        finally:
            server.terminate()
            server.wait(timeout=10)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    def span(key: str, fmt: str = ".3f") -> str:
        return f"[{min(r[key] for r in rounds):{fmt}}..{max(r[key] for r in rounds):{fmt}}]"

    ideal = args.concurrency / mean_latency_s(args)
    print(f"\n{rounds[0]['n']} requests per round, {args.rounds} rounds, concurrency {args.concurrency}, latency "
          f"{args.latency_ms:g} ms + U(0, {args.latency_jitter_ms:g} ms) ({ideal:,.0f} req/s = concurrency/latency), {body_kind(args)}, "
          f"event loop {args.event_loop}; medians [min..max]:")
    target = "no target (reference shape)" if args.reference else "target >= 0.95"
    print(f"throughput (steady state, 10%-90% of answers): {med('steady'):.3f} x concurrency/latency {span('steady')}   "
          f"{target}")
    print(f"throughput (whole request phase, with ramp-up and last wave): {med('phase'):.3f} {span('phase')}   "
          f"[whole job incl. tokenizer load and output file: {med('whole'):.3f}]")
    print(f"client CPU: {med('phase_core'):.2f} core over the request phase {span('phase_core', '.2f')}, "
          f"{med('cpu_core'):.2f} over the whole job   target < 1")
    print(f"client cost: {med('us_per_request'):.0f} us CPU per request {span('us_per_request', '.0f')}, i.e. one core "
          f"would sustain {1e6 / med('us_per_request') / ideal:.2f} x concurrency/latency")
    real_core = med("us_per_request") * REAL_REQUESTS_PER_S / 1e6
    print(f"RESULT client CPU at a real run's {REAL_REQUESTS_PER_S} requests/s: {real_core:.3f} core (target <= 0.1): "
          f"{'OK' if real_core <= 0.1 else 'ABOVE TARGET'}")
    if not args.reference:
        print(f"RESULT throughput {med('steady'):.3f} of concurrency/mean latency (target >= 0.95): "
              f"{'OK' if med('steady') >= 0.95 else 'BELOW TARGET'} (ceiling here: the bare loop's {bare['steady']:.3f})")
    print(f"ceiling here and now (the bare HTTP loop above, same stand-in and cores): steady {bare['steady']:.3f}, "
          f"request phase {bare['phase']:.3f}; the job reaches {med('steady') / bare['steady']:.3f} and "
          f"{med('phase') / bare['phase']:.3f} of it")
    print(f"stand-in CPU: {med('stand_in_core'):.2f} core (a Python server on the same {os.cpu_count()} cores)")
    if args.stream:
        print(f"answers: {med('kb_per_request'):.1f} KB, {med('events_per_request'):.0f} SSE events each; the client parsed "
              f"{med('events_per_s'):,.0f} events/s here, {med('events_per_request') * REAL_REQUESTS_PER_S:,.0f} events/s "
              f"at a real run's {REAL_REQUESTS_PER_S} requests/s")
    print(f"machine load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())

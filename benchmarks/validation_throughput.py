"""Validation cost as a ratio to reconstruction alone.

N synthetic provider responses (default 100,000; reasoning + content from the bundled corpus, some
with tool calls, usage counts from the true ids) go through, in the same run:
  reconstruct:  parse_response + prompt-free reconstruct_completion   (what must happen anyway)
  validate:     the same, plus every per-sample check (structure, decode, counts) and the verdict
and it prints samples/s of each and the added time (target: validation adds at most 50%).
The decode check is answered by Tokenizer.decodes_to: a tiktoken tokenizer proves it from the copy it
keeps of each plain encoding; that copy is made inside encode_plain, so it is paid in both passes (it
was not measurable above noise on reconstruction alone).

Usage: python benchmarks/validation_throughput.py [--n 100000] [--tokenizer DIR]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from eagledata.tokens.checks import (SampleStats, completion_verdict, convention_for, learn_conventions, prompt_verdict,
                              structural_codes, verdict)
from eagledata.tokens.learning import learn_prompt_variants, learn_reasoning_reliability, reasoning_checked
from eagledata.tokens.policy import resolve_policy
from eagledata.tokens.reconstruct import reconstruct_completion
from eagledata.tokens.responses import parse_response
from eagledata.tokens.samples import Sample

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reconstruction_throughput import _tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _bodies(n: int, tok, fam, seed: int = 0) -> list[str]:
    corpus = (ROOT / "src/eagledata/data/corpus.txt").read_text(encoding="utf-8")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randrange(len(corpus) - 2000), rng.randrange(len(corpus) - 1000)
        msg = {"role": "assistant", "reasoning": corpus[a:a + rng.randrange(200, 1200)],
               "content": corpus[b:b + rng.randrange(50, 600)]}
        finish = "stop"
        if i % 5 == 0:
            msg["tool_calls"] = [{"id": f"functions.lookup:{0}", "type": "function",
                                  "function": {"name": "lookup", "arguments": json.dumps({"q": corpus[b:b + 30]})}}]
            finish = "tool_calls"
        body = {"id": f"gen-{i}", "provider": "P", "choices": [{"index": 0, "finish_reason": finish, "message": msg}]}
        truth = reconstruct_completion(parse_response(json.dumps(body)), tok, fam)
        body["usage"] = {"prompt_tokens": 0, "completion_tokens": len(truth.ids),
                         "completion_tokens_details": {"reasoning_tokens": truth.reasoning_tokens + 1}}
        out.append(json.dumps(body))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--tokenizer")
    args = ap.parse_args()
    tok, fam, path = _tokenizer(args.tokenizer)
    t0 = time.perf_counter()
    bodies = _bodies(args.n, tok, fam)
    print(f"tokenizer {path}; built {args.n} bodies in {time.perf_counter() - t0:.1f}s")

    def reconstruct_only(chunk: list[str]) -> float:
        t0 = time.perf_counter()
        for raw in chunk:
            reconstruct_completion(parse_response(raw), tok, fam)
        return time.perf_counter() - t0

    def with_validation(chunk: list[str], stats: list[SampleStats]) -> float:
        t0 = time.perf_counter()
        for raw in chunk:
            parsed = parse_response(raw)
            rc = reconstruct_completion(parsed, tok, fam)
            sample = Sample(str(len(stats)), {}, parsed, [], rc, None)
            stats.append(SampleStats(sample.id, parsed.provider or "unknown", parsed.finish_reason, 0, len(rc.ids),
                                     rc.reasoning_tokens, rc.stopped, None, parsed.completion_tokens,
                                     parsed.reasoning_tokens, structural_codes(sample, tok, fam)))
        return time.perf_counter() - t0

    # The two passes alternate over 20 chunks (order flipped each round), so load from other
    # processes hits both alike; the ratio is the median over rounds and the total over all.
    stats: list[SampleStats] = []
    size = max(1, len(bodies) // 20)
    t_rec = t_val = 0.0
    ratios = []
    for k, i in enumerate(range(0, len(bodies), size)):
        chunk = bodies[i:i + size]
        if k % 2:
            v, r = with_validation(chunk, stats), reconstruct_only(chunk)
        else:
            r, v = reconstruct_only(chunk), with_validation(chunk, stats)
        t_rec, t_val = t_rec + r, t_val + v
        ratios.append(v / r)
    t0 = time.perf_counter()
    conventions = learn_conventions(stats)
    reliability = learn_reasoning_reliability(stats, conventions)
    learn_prompt_variants(stats)
    policy = resolve_policy("default")
    verdicts, admitted = [], 0
    for s in stats:
        v, codes = verdict(s, convention_for(conventions, s.provider, s.finish_reason),
                           reasoning_checked(reliability, s.provider))
        verdicts.append(v)
        admitted += policy.admits(completion_verdict(codes), prompt_verdict(s))
    t_val += time.perf_counter() - t0
    ratios.sort()
    median = ratios[len(ratios) // 2]

    exact = verdicts.count("exact")
    print(f"reconstruction alone:       {args.n / t_rec:,.0f} samples/s")
    print(f"reconstruction + validation: {args.n / t_val:,.0f} samples/s  ({exact}/{args.n} exact, {admitted} admitted)")
    added = median - 1
    print(f"per-round added time: median {added:.1%}, min {ratios[0] - 1:.1%}, max {ratios[-1] - 1:.1%}; "
          f"totals {t_val / t_rec - 1:.1%}")
    print(f"RESULT validation adds {added:.1%} to reconstruction time (target <= 50%): "
          f"{'OK' if added <= 0.5 else 'ABOVE TARGET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

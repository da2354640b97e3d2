"""Reconstruction throughput as a ratio to the raw tiktoken plain encode of the same text.

Builds N synthetic provider responses (reasoning + content from the bundled corpus; JSON bodies and
SSE streams), then times, in the same run:
  raw:            tiktoken encode_ordinary of every text segment (the floor: pure BPE)
  reconstruct:    parse_response(raw body) + reconstruct_completion (what the tokens stage does)
and prints tokens/s of each and the ratio (target >= 0.5 for JSON bodies).

Usage: python benchmarks/reconstruction_throughput.py [--n 2000] [--tokenizer DIR]
(default tokenizer: ../shared/tokenizers/kimi-k2.5, else the demo tokenizer built into a temp dir).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from eagledata.text.families import get_family
from eagledata.tokens.reconstruct import reconstruct_completion
from eagledata.tokens.responses import parse_response
from eagledata.text.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def _tokenizer(arg: str | None):
    fam = get_family("kimi-k2.5")
    path = Path(arg) if arg else ROOT.parent / "shared" / "tokenizers" / "kimi-k2.5"
    if not path.exists():
        from eagledata.demo.tokenizer import build_demo_tokenizer, default_corpus_path

        path = Path(tempfile.mkdtemp()) / "demo-tokenizer"
        build_demo_tokenizer(default_corpus_path(), path)
    return load_tokenizer(path, fam), fam, path


def _bodies(n: int, seed: int = 0):
    corpus = (ROOT / "src/eagledata/data/corpus.txt").read_text(encoding="utf-8")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a = rng.randrange(0, len(corpus) - 6000)
        reasoning = corpus[a:a + rng.randrange(1000, 4000)]
        b = rng.randrange(0, len(corpus) - 3000)
        content = corpus[b:b + rng.randrange(300, 2000)]
        msg = {"role": "assistant", "reasoning": reasoning, "content": content}
        body = {"id": f"gen-{i}", "provider": "P", "choices": [{"index": 0, "finish_reason": "stop", "message": msg}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 0}}
        chunks = [": OPENROUTER PROCESSING\n\n"]
        for kind, text in (("reasoning", reasoning), ("content", content)):
            for j in range(0, len(text), 16):
                chunks.append("data: " + json.dumps({"id": f"gen-{i}", "provider": "P", "choices": [
                    {"index": 0, "delta": {kind: text[j:j + 16]}, "finish_reason": None}]}) + "\n\n")
        chunks.append("data: " + json.dumps({"id": f"gen-{i}", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                                             "usage": body["usage"]}) + "\n\ndata: [DONE]\n\n")
        out.append((reasoning, content, json.dumps(body), "".join(chunks)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--tokenizer")
    args = ap.parse_args()
    tok, fam, path = _tokenizer(args.tokenizer)
    bodies = _bodies(args.n)
    enc = tok.encoding.encode_ordinary
    for reasoning, _, body, _ in bodies[:50]:  # warm up both paths equally
        enc(reasoning)
        reconstruct_completion(parse_response(body), tok, fam)

    t0 = time.perf_counter()
    raw_tokens = sum(len(enc(r)) + len(enc(c)) for r, c, _, _ in bodies)
    t_raw = time.perf_counter() - t0

    results = {}
    for label, idx in (("json", 2), ("sse", 3)):
        t0 = time.perf_counter()
        n_tok = 0
        for item in bodies:
            rc = reconstruct_completion(parse_response(item[idx]), tok, fam)
            n_tok += len(rc.ids)
        results[label] = (n_tok, time.perf_counter() - t0)

    print(f"tokenizer: {path}  samples: {args.n}  text tokens: {raw_tokens}")
    print(f"raw tiktoken encode_ordinary: {raw_tokens / t_raw:,.0f} tokens/s")
    for label, (n_tok, t) in results.items():
        print(f"reconstruct ({label} bodies):  {n_tok / t:,.0f} tokens/s  ratio to raw: {(n_tok / t) / (raw_tokens / t_raw):.3f}")
    ratio = (results["json"][0] / results["json"][1]) / (raw_tokens / t_raw)
    print(f"RESULT reconstruction/raw ratio (json) = {ratio:.3f} (target >= 0.5): {'OK' if ratio >= 0.5 else 'BELOW TARGET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

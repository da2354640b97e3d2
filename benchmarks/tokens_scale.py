"""The tokens stage at drafter-training size, as ratios measured in one run.

Builds synthetic imported datasets from the real recorded OpenRouter traffic in ../shared/recorded
(each recorded record repeated with a new id, so bodies, providers, tools and stream/JSON mix are
real), at each size in --sizes, then runs the tokens stage on each in a fresh process (one core, as a
Snakemake job runs it) and prints per size:
  wall time, tokens (prompt + completion) per second,
  the ratio to raw tiktoken encoding of the same text on one core (what the stage cannot beat),
  peak memory of the job (ru_maxrss), and how it grows with the dataset.

Usage: python benchmarks/tokens_scale.py [--sizes 10000,40000,80000] [--work DIR]
Needs ../shared (the recorded traffic and the Kimi K2 tokenizer).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
RECORDED = SHARED / "recorded" / "openrouter-kimi-k2-0905.jsonl"
TOKENIZER = SHARED / "tokenizers" / "kimi-k2-instruct"

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
from eagledata.text.families import get_family
from eagledata.text.tokenizer import load_tokenizer
from eagledata.tokens.shards import build_token_shards, read_shards
path, out, tok_dir = sys.argv[1:4]
fam = get_family("kimi-k2")
tok = load_tokenizer(tok_dir, fam)
t0 = time.perf_counter()
build_token_shards(path, out, tok, fam, "scale", shard_size=1000)
wall = time.perf_counter() - t0
rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
df = read_shards(out).select("prompt_len", "completion_len", "verdict")
print(json.dumps({"wall": wall, "rss_mb": rss_mb, "prompt": int(df["prompt_len"].sum()),
                  "completion": int(df["completion_len"].sum()), "rows": df.height}))
"""

RAW = r"""
import json, sys, time
from eagledata.text.families import get_family
from eagledata.text.tokenizer import load_tokenizer
from eagledata.text.chat import prompt_text
from eagledata.tokens.responses import parse_response
path, tok_dir, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
fam = get_family("kimi-k2")
tok = load_tokenizer(tok_dir, fam)
texts = []
for i, line in enumerate(open(path, encoding="utf-8")):
    if i >= n:
        break
    rec = json.loads(line)
    req = rec["request"]
    texts.append(prompt_text(tok, req.get("messages") or [], req.get("tools")))
    p = parse_response(rec["response_raw"])
    texts += [t for t in (p.reasoning, p.content) if t]
    texts += [c.arguments for c in p.tool_calls]
enc = tok.encoding
t0 = time.perf_counter()
n_tokens = sum(len(enc.encode(t, allowed_special="all")) for t in texts)
print(json.dumps({"tokens": n_tokens, "wall": time.perf_counter() - t0, "records": min(n, i + 1)}))
"""


def build_dataset(n: int, dest: Path) -> Path:
    records = [json.loads(line) for line in RECORDED.read_text(encoding="utf-8").splitlines() if line.strip()]
    path = dest / f"responses-{n}.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            rec = dict(records[i % len(records)])
            rec["id"] = f"{rec.get('id', 'r')}-{i:07d}"
            fh.write(json.dumps(rec) + "\n")
    return path


def run(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True,
                         env={"OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1", "POLARS_MAX_THREADS": "1",
                              "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10000,40000,80000")
    ap.add_argument("--work", help="directory for the synthetic datasets (default: a temp dir)")
    args = ap.parse_args()
    if not RECORDED.exists() or not TOKENIZER.exists():
        print(f"needs {RECORDED} and {TOKENIZER}")
        return 2
    work = Path(args.work or tempfile.mkdtemp(prefix="tokens-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for n in sizes:
        t0 = time.perf_counter()
        path = build_dataset(n, work)
        built = time.perf_counter() - t0
        stage = run(CHILD, str(path), str(work / f"tokens-{n}"), str(TOKENIZER))
        raw = run(RAW, str(path), str(TOKENIZER), str(min(n, 5000)))
        raw_rate = raw["tokens"] / raw["wall"]
        rate = (stage["prompt"] + stage["completion"]) / stage["wall"]
        rows.append((n, stage, rate, raw_rate))
        print(f"{n:>7} records ({path.stat().st_size / 1e6:,.0f} MB, built in {built:.1f}s): tokens stage "
              f"{stage['wall']:.1f}s, {rate / 1e6:.2f}M tokens/s on one core = {rate / raw_rate:.2f}x raw tiktoken "
              f"({raw_rate / 1e6:.2f}M/s); peak memory {stage['rss_mb']:.0f} MB", flush=True)
    base = rows[0][1]["rss_mb"]
    growth = ", ".join(f"{n}: {s['rss_mb'] / base:.2f}x" for n, s, _, _ in rows)
    flat = all(abs(s["rss_mb"] / base - 1) <= 0.10 for _, s, _, _ in rows)
    print(f"RESULT peak memory relative to {sizes[0]} records: {growth} ({'flat within 10%' if flat else 'NOT flat'})")
    worst = min(r / w for _, _, r, w in rows)
    print(f"RESULT tokens stage / raw tiktoken per core: worst {worst:.2f}x (target >= 0.3x): "
          f"{'OK' if worst >= 0.3 else 'BELOW TARGET'}")
    print("RESULT 1-core vs 2-core speed-up: one tokens job per dataset today (no per-shard jobs): 1.00x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

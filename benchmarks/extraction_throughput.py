"""Hidden-state extraction throughput and storage overhead, as ratios.

In one run, on the same model and the same batches (plan_batches over the same token shards):
  bare:     the base model's forward alone (no hooks, no copies, no files)
  extract:  eagledata.extract.core.extract_dataset end to end (parquet read, hooked forward, casts,
            background shard writes, sha256 of every output shard, index.parquet, manifest)
The two are interleaved batch by batch (each batch's bare forward runs inside the extraction
run, right before or after its extraction forward, alternating; extraction time = wall time of
the run minus the bare forwards), so load from other processes on a shared machine hits both
alike. Prints tokens/s of each and extract/bare (median of --repeats; target >= 0.85), then the
bytes written per token
against the theoretical minimum tokens x (n_layers + 1) x H x dtype size (+ the token id and loss
mask every trainer needs), target within 1%.

Usage: python benchmarks/extraction_throughput.py [--samples 96] [--dtype float32] [--threads 2]
       [--weights DIR] [--device cpu|cuda] [--compute-dtype auto|bfloat16] [--batch-tokens 4096]
Default model: the demo DeepseekV3 (random weights) built into a temp dir. On a GPU box pass a
>= 1B model directory with --weights and --device cuda --compute-dtype bfloat16.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path


def make_tokens(d: Path, vocab: int, samples: int, shards: int, seed: int = 0) -> Path:
    import numpy as np
    import polars as pl

    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    entries = []
    per = -(-samples // shards)
    for s in range(shards):
        rows = []
        for k in range(min(per, samples - s * per)):
            t = int(rng.integers(64, 1024))
            p = int(rng.integers(16, t // 2))
            rows.append({"id": f"b{s}-{k}", "input_ids": rng.integers(0, vocab, t).tolist(), "prompt_len": p,
                         "completion_len": t - p, "train": True})
        name = f"shard-{s:05d}.parquet"
        pl.DataFrame(rows, schema={"id": pl.Utf8, "input_ids": pl.List(pl.Int64), "prompt_len": pl.Int32,
                                   "completion_len": pl.Int32, "train": pl.Boolean}).write_parquet(d / name)
        entries.append({"file": name, "rows": len(rows), "sha256": hashlib.sha256((d / name).read_bytes()).hexdigest()})
    (d / "manifest.json").write_text(json.dumps({"dataset": "bench", "tokenizer_fingerprint": "bench", "shards": entries}))
    return d


class PairedBackend:
    """Wraps an HFBackend: every extraction batch also runs the bare forward of the same padded
    batch (timed into ``bare_s``), alternately before and after the extraction forward."""

    def __new__(cls, inner):
        from eagledata.extract.base import ExtractionBackend

        class _Paired(ExtractionBackend):
            name = inner.name

            def __init__(self):
                self.inner = inner
                for k in ("num_layers", "hidden_size", "vocab_size", "layers", "final_norm", "compute_dtype"):
                    setattr(self, k, getattr(inner, k))
                self.bare_s, self.tokens, self._k = 0.0, 0, 0

            def _bare(self, seqs):
                import torch

                dec = self.inner.decoder
                dev = dec.module.get_input_embeddings().weight.device
                lens = [len(x) for x in seqs]
                ids = torch.zeros((len(seqs), max(lens)), dtype=torch.long)
                mask = torch.zeros_like(ids)
                for b, x in enumerate(seqs):
                    ids[b, : lens[b]] = x
                    mask[b, : lens[b]] = 1
                ids, mask = ids.to(dev), mask.to(dev)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.inference_mode():
                    dec.module(input_ids=ids, attention_mask=mask, use_cache=False)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                self.bare_s += time.perf_counter() - t0
                self.tokens += sum(lens)

            def forward(self, seqs, out_dtype):
                self._k += 1
                if self._k % 2:
                    self._bare(seqs)
                    return self.inner.forward(seqs, out_dtype)
                out = self.inner.forward(seqs, out_dtype)
                self._bare(seqs)
                return out

        return _Paired()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compute-dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--weights", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the numbers to this file")
    args = ap.parse_args()

    import torch

    from eagledata.demo.model import build_demo_model
    from eagledata.extract import core as ex
    from eagledata.extract.hf import HFBackend, load_model
    from eagledata.extract.storage import ITEMSIZE

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="eagledata-bench-"))
    weights = Path(args.weights) if args.weights else build_demo_model(tmp / "model", 4096, seed=0)
    model = load_model(weights, args.compute_dtype, args.device)
    backend = HFBackend(model, None, args.compute_dtype)
    tokens = make_tokens(tmp / "tokens", backend.vocab_size, args.samples, args.shards)

    # warm up (allocator, kernels), then paired runs; the median ratio is reported
    ex.extract_dataset(tokens, tmp / "warm", weights, dtype=args.dtype, device=args.device,
                       batch_tokens=args.batch_tokens, compute_dtype=args.compute_dtype, model=backend)
    runs = []
    for r in range(args.repeats):
        paired = PairedBackend(backend)
        out = tmp / f"hidden-{r}"
        t0 = time.perf_counter()
        manifest = ex.extract_dataset(tokens, out, weights, dtype=args.dtype, device=args.device,
                                      batch_tokens=args.batch_tokens, compute_dtype=args.compute_dtype, model=paired)
        wall = time.perf_counter() - t0
        runs.append((paired.bare_s / (wall - paired.bare_s), paired.bare_s, wall - paired.bare_s))
    runs.sort()
    _, bare_s, ext_s = runs[len(runs) // 2]
    n = paired.tokens
    assert manifest["tokens"] == n
    nl, h = len(manifest["layers"]), manifest["hidden_size"]
    item = ITEMSIZE[args.dtype]
    shard_bytes = sum(s["bytes"] for s in manifest["shards"])
    all_bytes = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    hidden_min = n * (nl + 1) * h * item
    payload_min = hidden_min + n * (8 + 1)  # + int64 token id + int8 loss mask per token
    overhead_per_token = (all_bytes - payload_min) / n
    k25 = 4 * 7168 * 2  # 3 aux layers + final, H 7168, bf16
    res = {
        "model": str(weights), "device": args.device, "threads": args.threads, "dtype": args.dtype,
        "params": sum(p.numel() for p in model.parameters()), "tokens": n, "samples": manifest["samples"],
        "bare_forward_tokens_per_s": round(n / bare_s, 1), "extract_tokens_per_s": round(n / ext_s, 1),
        "extract_over_bare": round(bare_s / ext_s, 3),
        "extract_over_bare_all_runs": [round(r[0], 3) for r in runs],
        "bytes_per_token": round(all_bytes / n, 2), "min_hidden_bytes_per_token": (nl + 1) * h * item,
        "min_payload_bytes_per_token": (nl + 1) * h * item + 9,
        "shards_over_payload_min": round(shard_bytes / payload_min, 5),
        "all_files_over_payload_min": round(all_bytes / payload_min, 5),
        "all_files_over_hidden_min": round(all_bytes / hidden_min, 5),
        "k25_projected_over_hidden_min": round((k25 + 9 + overhead_per_token) / k25, 5),
    }
    print(f"model {res['model']} ({res['params']:,} params), {args.device}, {args.threads} threads, "
          f"{n} tokens in {res['samples']} samples, stored {args.dtype}")
    print(f"bare forward        {res['bare_forward_tokens_per_s']:>10,.0f} tokens/s")
    print(f"extraction          {res['extract_tokens_per_s']:>10,.0f} tokens/s")
    print(f"ratio extract/bare  {res['extract_over_bare']:>10.3f}   (target >= 0.85; runs {res['extract_over_bare_all_runs']})")
    print(f"bytes per token     {res['bytes_per_token']:>10.2f}   minimum {res['min_hidden_bytes_per_token']} hidden "
          f"+ 9 ids/mask = {res['min_payload_bytes_per_token']}")
    print(f"ratio shards/min    {res['shards_over_payload_min']:>10.5f}   all files (with index, manifest) "
          f"{res['all_files_over_payload_min']:.5f}   (target <= 1.01)")
    print(f"vs hidden-only min  {res['all_files_over_hidden_min']:>10.5f}   (ids + mask are 9 bytes/token; at K2.5's "
          f"{k25} bytes/token: {res['k25_projected_over_hidden_min']:.5f})")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

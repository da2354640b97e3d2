"""How far a sample's hidden states batched with others are from the same sample run alone, per
captured layer: the margin of extraction's re-run check (``eagledata.extract.checks.RERUN_RTOL``) on
a given model and device. Prints, for 4 of 8 random samples (64-1023 tokens, batched together and
right-padded, as extraction batches them), per layer: the largest difference of one token's hidden
vector relative to its norm (what the check compares with ``rtol``), its 99th percentile over tokens,
the whole tensor's relative difference, and the largest single value's difference relative to
(|value| + rms) (what the former per-value check compared).

Measured on an H200 with ``benchmarks/wide_model.py --layers 24`` (random weights, hidden 7168,
bfloat16 compute): up to 0.035 per token by layer 23 (tolerance 0.25), single values up to 0.13; in
float32 about 4e-5. Run it on the real model before a long bf16 extraction to see the margin.

Usage: python benchmarks/rerun_noise.py WEIGHTS_DIR [--compute-dtype bfloat16] [--device cuda] [--json F]
"""
from __future__ import annotations

import argparse
import json


def noise(weights: str, compute_dtype: str, device: str) -> dict:
    import numpy as np
    import torch

    from eagledata.extract.checks import rerun_rtol
    from eagledata.extract.hf import HFBackend, load_model

    be = HFBackend(load_model(weights, compute_dtype, device), None, compute_dtype)
    rng = np.random.default_rng(1)
    lens = [int(x) for x in rng.integers(64, 1024, 8)]
    seqs = [torch.from_numpy(rng.integers(0, be.vocab_size, n)) for n in lens]
    batched = be.forward(seqs, torch.float32)
    layers = be.layers + [be.num_layers - 1]
    out = {"layers": layers, "compute_dtype": compute_dtype, "rtol": rerun_rtol(compute_dtype, compute_dtype), "samples": []}
    for k in (0, 3, 5, 7):
        alone = be.forward([seqs[k]], torch.float32)[0]
        pairs = [(batched[k][0][:, j], alone[0][:, j]) for j in range(len(be.layers))] + [(batched[k][1], alone[1])]
        rows = []
        for layer, (b, a) in zip(layers, pairs):
            d = a - b
            token = d.norm(dim=-1) / b.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
            rows.append({"layer": layer, "token_rel_max": round(float(token.max()), 5),
                         "token_rel_p99": round(float(token.quantile(0.99)), 5),
                         "tensor_rel": round(float(d.norm() / b.norm()), 5),
                         "value_rel_max": round(float((d.abs() / (b.abs() + b.pow(2).mean().sqrt())).max()), 4)})
        out["samples"].append({"tokens": lens[k], "per_layer": rows})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("weights")
    ap.add_argument("--compute-dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res = noise(a.weights, a.compute_dtype, a.device)
    print(f"batched vs alone, compute {res['compute_dtype']}, check tolerance {res['rtol']:.3g} (per token):")
    for s in res["samples"]:
        print(f"  sample of {s['tokens']} tokens")
        for r in s["per_layer"]:
            print(f"    layer {r['layer']:>3}: token max {r['token_rel_max']:.5f}  p99 {r['token_rel_p99']:.5f}  "
                  f"tensor {r['tensor_rel']:.5f}  single value {r['value_rel_max']:.4f}")
    worst = max(r["token_rel_max"] for s in res["samples"] for r in s["per_layer"])
    print(f"RESULT worst token {worst:.4g} = {worst / res['rtol']:.3f} of the tolerance")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()

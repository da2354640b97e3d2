"""Extraction on each device, compared: the same token shards through the HF backend (the real model
class) on the CPU in float32 and on CUDA in float32, bfloat16 and FP8, printing each run's time and
checks and the largest difference from the CPU's float32 states, relative to each tensor's largest value
(integer tensors must be equal). A GPU box's first check; prints JSON and writes it to OUT/extract_devices.json.

Usage: python benchmarks/extract_devices.py [--tokens results/chat/tokens] [--weights results/_assets/demo-model]
       [--out DIR]   (defaults: a finished demo run's chat shards and its tiny random DeepSeek-V3)
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path

RUNS = [("cpu_float32", "cpu", "float32"), ("cuda_float32", "cuda", "float32"),
        ("cuda_bfloat16", "cuda", "bfloat16"), ("cuda_fp8", "cuda", "float8_e4m3fn")]


def compare(ref: Path, other: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    diffs: dict[str, float] = {}
    equal = []
    for f in sorted(ref.glob("*.safetensors")):
        a, b = load_file(f), load_file(other / f.name)
        for k in a:
            if a[k].dtype.is_floating_point:
                rel = ((a[k].float() - b[k].float()).abs().max() / a[k].float().abs().max().clamp_min(1e-12)).item()
                diffs[k] = max(diffs.get(k, 0.0), rel)
            elif k in b:
                equal.append(torch.equal(a[k], b[k]))
    return {"relative_max_abs_diff": diffs, "integer_tensors_equal": all(equal)}


def main() -> int:
    import torch
    from eagledata.extract.core import extract_dataset

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="results/chat/tokens")
    ap.add_argument("--weights", default="results/_assets/demo-model")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="extract-devices-"))
    result: dict = {"torch": torch.__version__,
                    "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    for name, device, dtype in RUNS:
        t0 = time.perf_counter()
        try:
            m = extract_dataset(args.tokens, out / name, args.weights, dtype=dtype, device=device, batch_tokens=512)
            result[name] = {"seconds": round(time.perf_counter() - t0, 2), "samples": m["samples"],
                            "tokens": m["tokens"], "checks": [s.get("checks") for s in m["shards"]][:2]}
        except Exception as exc:  # noqa: BLE001 - reported, the other runs go on
            result[name] = {"error": repr(exc), "trace": traceback.format_exc()[-1500:]}
    for name, _, dtype in RUNS[1:]:
        if "error" not in result[name] and "error" not in result["cpu_float32"] and dtype != "float8_e4m3fn":
            result[f"{name}_vs_cpu_float32"] = compare(out / "cpu_float32", out / name)
    text = json.dumps(result, indent=1, default=str)
    print(text)
    (out / "extract_devices.json").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

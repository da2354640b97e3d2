"""The run-wide ``validation.json``: datasets' validation documents summed (schema in
:mod:`eagledata.report.build`), with routing advice over the summed providers."""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping

from eagledata.report.routing import routing_advice
from eagledata.tokens.checks import VERDICTS

SCHEMA_VERSION = 2
COUNT_KEYS = ("total", "exact", "repaired", "mismatch", "error", "excluded", "included", "admitted_with_prompt_differs",
              "admitted_with_prompt_unproven")


def aggregate_validations(validations: Mapping[str, Mapping[str, Any]], min_samples: int = 5,
                          ignore_below: float = 0.5) -> dict[str, Any]:
    """Sum datasets' ``validation.json`` (name -> parsed file) into the run-wide document."""
    counts = {k: 0 for k in COUNT_KEYS}
    providers: dict[str, dict[str, Any]] = {}
    reasons: dict[str, dict[str, Any]] = {}
    datasets: dict[str, Any] = {}
    excluded: dict[str, list[str]] = {}
    for name, v in validations.items():
        c = v["counts"]
        for k in COUNT_KEYS:
            counts[k] += int(c.get(k, 0))
        for side in ("completion", "prompt"):
            for k, n in (c.get(side) or {}).items():
                counts.setdefault(side, {}).setdefault(k, 0)
                counts[side][k] += int(n)
        datasets[name] = {"counts": dict(c), "passed": v.get("passed"), "bad_fraction": v.get("bad_fraction"),
                          "max_bad_fraction": v.get("max_bad_fraction"), "policy": v.get("policy"),
                          "tokenizer_fingerprint": v.get("tokenizer_fingerprint")}
        excluded[name] = list(v.get("excluded_ids") or [])
        for prov, p in (v.get("providers") or {}).items():
            agg = providers.setdefault(prov, {"total": 0, **{k: 0 for k in VERDICTS}, "completion_verified": 0,
                                              "conventions": {}, "convention_support": Counter(),
                                              "convention_by_finish": {}, "transformations_seen": Counter(),
                                              "completion_diff": Counter(), "prompt_diff": Counter(), "datasets": [],
                                              "completion": Counter(), "prompt": Counter(), "admitted": 0,
                                              "prompt_variants": {}, "reasoning_count": {}})
            for k in ("total", *VERDICTS):
                agg[k] += int(p.get(k, 0))
            _add_sides(agg, name, p)
            # completion_verified: every completion-side check passes (older validation.json: exact + repaired)
            agg["completion_verified"] += int(p.get("completion_verified", int(p.get("exact", 0)) + int(p.get("repaired", 0))))
            agg["conventions"][name] = p.get("convention", "unknown")
            agg["convention_support"].update(p.get("convention_support") or {})
            for finish, conv in (p.get("convention_by_finish") or {}).items():
                agg["convention_by_finish"].setdefault(finish, set()).add(conv)
            agg["transformations_seen"].update(p.get("transformations_seen") or {})
            agg["completion_diff"].update({int(d): n for d, n in (p.get("completion_diff") or {}).items()})
            agg["prompt_diff"].update({int(d): n for d, n in (p.get("prompt_diff") or {}).items()})
            agg["datasets"].append(name)
        for code, r in (v.get("reasons") or {}).items():
            agg = reasons.setdefault(code, {"severity": r.get("severity"), "message": r.get("message"), "count": 0, "ids": {}})
            agg["count"] += int(r.get("count", 0))
            agg["ids"][name] = list(r.get("ids") or [])
    for p in providers.values():
        p["completion"], p["prompt"] = dict(p["completion"]), dict(p["prompt"])
        p["prompt_exact_share"] = round(p["prompt"].get("exact", 0) / p["total"], 4) if p["total"] else 0.0
        variants = {v for v in p["prompt_variants"].values() if v}
        p["prompt_variant"] = variants.pop() if len(variants) == 1 else ("mixed" if variants else None)
        p["exact_share"] = round(p["exact"] / p["total"], 4) if p["total"] else 0.0
        p["good_share"] = round((p["exact"] + p["repaired"]) / p["total"], 4) if p["total"] else 0.0
        p["completion_verified_share"] = round(p["completion_verified"] / p["total"], 4) if p["total"] else 0.0
        p["transformations_seen"] = dict(sorted(p["transformations_seen"].items()))
        p["convention_support"] = dict(sorted(p["convention_support"].items()))
        p["convention_by_finish"] = {f: (cs.pop() if len(cs) == 1 else "mixed")
                                     for f, cs in sorted(p["convention_by_finish"].items())}
        convs = set(p["conventions"].values())
        p["convention"] = convs.pop() if len(convs) == 1 else "mixed"
        p["completion_diff"] = {str(d): n for d, n in sorted(p["completion_diff"].items())}
        p["prompt_diff"] = {str(d): n for d, n in sorted(p["prompt_diff"].items())}
    bad = sum(_dataset_bad(v) for v in validations.values())
    providers = dict(sorted(providers.items()))
    return {
        "schema": SCHEMA_VERSION,
        "scope": "run",
        "passed": all(d["passed"] for d in datasets.values()) if datasets else True,
        "bad_fraction": round(bad / counts["total"], 6) if counts["total"] else 0.0,
        "counts": counts,
        "datasets": datasets,
        "providers": {k: _order_provider_keys(p) for k, p in providers.items()},
        "reasons": dict(sorted(reasons.items(), key=lambda kv: (-kv[1]["count"], kv[0]))),
        "excluded_ids": excluded,
        "routing_advice": routing_advice(providers, min_samples, ignore_below),
    }


def _dataset_bad(v: Mapping[str, Any]) -> int:
    """The dataset's bad samples as its gate counted them (``bad_counts``; version 1: joint verdicts)."""
    c = v["counts"]
    side = c.get("completion") if v.get("bad_counts") == "completion" else None
    src = side if side is not None else c
    return int(src.get("mismatch", 0)) + int(src.get("error", 0))


def _add_sides(agg: dict[str, Any], dataset: str, p: Mapping[str, Any]) -> None:
    """Sum one dataset's per-side verdicts, admissions and learned prompt/reasoning facts."""
    agg["completion"].update(p.get("completion") or {})
    agg["prompt"].update(p.get("prompt") or {})
    agg["admitted"] += int(p.get("admitted", 0))
    agg["prompt_variants"][dataset] = p.get("prompt_variant")
    if p.get("reasoning_count"):
        agg["reasoning_count"][dataset] = p["reasoning_count"]


def _order_provider_keys(p: dict[str, Any]) -> dict[str, Any]:
    keys = ["total", *VERDICTS, "exact_share", "good_share", "completion", "completion_verified", "completion_verified_share",
            "prompt", "prompt_exact_share", "prompt_variant", "prompt_variants", "reasoning_count", "admitted",
            "convention", "conventions", "convention_support", "convention_by_finish", "transformations_seen",
            "completion_diff", "prompt_diff", "datasets"]
    return {k: p[k] for k in keys if k in p}

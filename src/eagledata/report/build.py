"""Reports a person reads: self-contained HTML (inline CSS and SVG, no JavaScript, no network) per
dataset and for the whole run, a run-wide ``validation.json`` and routing advice.

Inputs are what the pipeline already wrote: each dataset's ``validation.json`` (see
:mod:`eagledata.validate.summary`) and token shards (see :mod:`eagledata.tokens.shards`). The per-dataset report
also needs the dataset's tokenizer, to decode each completion token on its own.

Outputs (paths chosen by the caller; the workflow uses these)::

    {results}/{dataset}/report.html   one dataset: totals, providers, count differences, lengths,
                                      reasons, the worst samples token by token, routing advice
    {results}/report.html             the whole run: the same, summed over datasets, with links
    {results}/validation.json         the whole run, summed (schema below)
    {results}/routing_advice.yaml     a ``provider:`` block to paste under ``generation:``

Run-wide ``validation.json`` (schema 2; counts are sums of the datasets' counts; the per-side
fields are those of :mod:`eagledata.validate.summary`)::

    {"schema": 2, "scope": "run", "passed", "bad_fraction",
     "counts": {"total", "exact", "repaired", "mismatch", "error", "excluded", "included",
                "completion": {VERDICT: N}, "prompt": {VERDICT: N}},
     "datasets": {NAME: {"counts", "passed", "bad_fraction", "max_bad_fraction", "policy",
                         "tokenizer_fingerprint"}},
     "providers": {NAME: {"total", "exact", "repaired", "mismatch", "error", "exact_share",
                          "good_share", "completion": {..}, "completion_verified", "completion_verified_share",
                          "prompt": {..}, "prompt_exact_share", "prompt_variant" (one, "mixed" or null),
                          "prompt_variants": {DATASET: variant}, "reasoning_count": {DATASET: {...}}, "admitted",
                          "convention" (one value, or "mixed"), "conventions": {DATASET: convention},
                          "convention_support", "convention_by_finish", "transformations_seen",
                          "completion_diff": {DIFF: N}, "prompt_diff": {DIFF: N}, "datasets": [...]}},
     "reasons": {CODE: {"severity", "message", "count", "ids": {DATASET: [...]}}},
     "excluded_ids": {DATASET: [...]},
     "routing_advice": {...}}

Worst samples: mismatch and error first, then repaired (exact samples are never listed), each tier
by largest ``|completion_diff|`` then ``|prompt_diff|``; while the limit allows, every reason code
and every provider that occurs gets at least one example. Each completion token is decoded on its own (a run of tokens
that only together form a UTF-8 character is shown as one unit); token boundaries are alternating
shades, special tokens are labelled chips, and the tokens a sample's reasons implicate are outlined
as described by :data:`IMPLICATED`.

Routing advice (:func:`routing_advice`): providers ranked by the share of verified completions
(completion verdict exact or repaired), then by the share of exact prompts. With at least
``min_samples`` samples, a provider whose verified share is at least ``ignore_below`` goes into
``order``; one below it, or with no verified completion at all, into ``ignore``; providers with fewer
samples are left out of both (OpenRouter may still fall back to them). A provider without a single
verified completion is never in ``order``. If no provider qualifies for ``order``, those with any
verified completion are kept in it, and nothing is ignored when none has one (a config ignoring every
provider fails every request); the advice says so. Every row says why. Provider names are turned into
OpenRouter slugs by lowercasing and dropping spaces (``"Moonshot AI"`` -> ``moonshotai``): a best
effort, check them against OpenRouter's provider list.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import polars as pl

from eagledata import __version__
from eagledata.io import atomic_write_text
from eagledata.report.aggregate import aggregate_validations
from eagledata.report.charts import VERDICT_COLOURS, verdict_stack
from eagledata.report.highlight import IMPLICATED
from eagledata.report.render import diff_charts, length_charts, provider_rows, reason_rows, template
from eagledata.report.routing import routing_advice, routing_advice_yaml
from eagledata.report.samples import anchor, full_rows, light_frame, sample_view, select_worst
from eagledata.report.settings import REPORT_DEFAULTS, report_settings


def load_validation(validation: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(validation, Mapping):
        return dict(validation)
    return json.loads(Path(validation).read_text(encoding="utf-8"))


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, creating its directory."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)


def extraction_facts(tokens_dir: str | Path) -> dict[str, Any] | None:
    """The length-limit counts of the dataset's hidden-state manifest (``{results}/{dataset}/hidden``
    beside ``tokens_dir``) when extraction has run, else ``None``: ``samples``, ``tokens``,
    ``max_seq_len``, ``on_long``, ``truncated``, ``skipped``, ``over_trainer_max`` and
    ``trainer_max_len``."""
    path = Path(tokens_dir).parent / "hidden" / "manifest.json"
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None
    lim = m.get("length_limit") or {}
    return {"samples": m.get("samples", 0), "tokens": m.get("tokens", 0), "max_seq_len": lim.get("max_seq_len"),
            "on_long": lim.get("on_long"), "truncated": lim.get("truncated", 0), "skipped": lim.get("skipped", 0),
            "over_trainer_max": lim.get("over_trainer_max") or {}, "trainer_max_len": lim.get("trainer_max_len") or {}}


def build_dataset_report(validation: str | Path | Mapping[str, Any], tokens_dir: str | Path, out_html: str | Path,
                         tokenizer, settings: Mapping[str, Any] | None = None,
                         run_report: str | None = None) -> dict[str, Any]:
    """Write one dataset's HTML report; returns the template context (for tests and logs).
    ``validation``: the dataset's ``validation.json`` (a path, or the parsed document)."""
    settings = {**REPORT_DEFAULTS, **(settings or {})}
    v = load_validation(validation)
    df = light_frame(tokens_dir)
    rows = df.to_dicts()
    worst_ids = select_worst(rows, int(settings["worst_samples"]))
    full = full_rows(tokens_dir, worst_ids)
    samples = [sample_view(full[i], tokenizer, settings) for i in worst_ids if i in full]
    shown = {s["id"] for s in samples}
    advice = routing_advice(v.get("providers") or {}, int(settings["min_samples"]), float(settings["ignore_below"]))
    ctx = {
        "scope": "dataset", "title": f"eagledata report: {v.get('dataset')}", "name": v.get("dataset"),
        "v": v, "counts": v["counts"], "stack": verdict_stack(v["counts"], width=1200, height=28),
        "providers": provider_rows(v.get("providers") or {}, advice),
        "diff_charts": diff_charts(v.get("providers") or {}),
        "length_charts": length_charts(df),
        "reasons": reason_rows(v.get("reasons") or {}, lambda ds, i: f"#{anchor(i)}" if i in shown else None),
        "samples": samples, "n_flagged": sum(1 for r in rows if r["verdict"] != "exact"),
        "implicated": IMPLICATED, "advice": advice,
        "advice_yaml": routing_advice_yaml(advice, f"dataset {v.get('dataset')}"),
        "datasets": [], "run_report": run_report, "version": __version__, "settings": settings,
        "colours": VERDICT_COLOURS, "extraction": extraction_facts(tokens_dir),
    }
    write_text(out_html, template().render(**ctx))
    return ctx


def build_run_report(datasets: Mapping[str, tuple[str | Path, str | Path]], out_html: str | Path,
                     out_json: str | Path, out_yaml: str | Path, settings: Mapping[str, Any] | None = None,
                     dataset_links: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Write the run-wide HTML report, ``validation.json`` and routing advice YAML.

    ``datasets``: name -> (validation.json path or parsed document, tokens dir); ``dataset_links``:
    name -> href of the dataset's own report, relative to ``out_html``."""
    settings = {**REPORT_DEFAULTS, **(settings or {})}
    validations = {name: load_validation(vp) for name, (vp, _) in datasets.items()}
    run = aggregate_validations(validations, int(settings["min_samples"]), float(settings["ignore_below"]))
    links = dict(dataset_links or {})
    frames, shown = [], {}
    for name, (_, tokens_dir) in datasets.items():
        df = light_frame(tokens_dir)
        if df.is_empty():  # a dataset of no sample (every prompt a duplicate, say): no columns to read
            shown[name] = set()
            continue
        frames.append(df.select(["prompt_len", "completion_len"]))
        shown[name] = set(select_worst(df.to_dicts(), int(settings["worst_samples"])))

    def link(ds, i):
        if ds not in links:
            return None
        return f"{links[ds]}#{anchor(i)}" if i in shown.get(ds, ()) else links[ds]

    all_lengths = pl.concat(frames) if frames else pl.DataFrame({"prompt_len": [], "completion_len": []})
    advice = run["routing_advice"]
    ds_rows = [{"name": name, **d, "link": links.get(name),
                "stack": verdict_stack(d["counts"], width=220, height=12, labels=False)} for name, d in run["datasets"].items()]
    ctx = {
        "scope": "run", "title": "eagledata report: run", "name": "run", "v": run, "counts": run["counts"],
        "stack": verdict_stack(run["counts"], width=1200, height=28),
        "providers": provider_rows(run["providers"], advice),
        "diff_charts": diff_charts(run["providers"]),
        "length_charts": length_charts(all_lengths),
        "reasons": reason_rows(run["reasons"], link),
        "samples": [], "n_flagged": run["counts"]["total"] - run["counts"]["exact"],
        "implicated": IMPLICATED, "advice": advice,
        "advice_yaml": routing_advice_yaml(advice, "datasets " + ", ".join(datasets)),
        "datasets": ds_rows, "run_report": None, "version": __version__, "settings": settings,
        "colours": VERDICT_COLOURS, "extraction": None,
    }
    write_text(out_json, json.dumps(run, indent=2) + "\n")
    write_text(out_yaml, ctx["advice_yaml"])
    write_text(out_html, template().render(**ctx))
    return ctx


# --------------------------------------------------------------------------------------------------
# Outside Snakemake: reports of whatever a run left, even when validation failed


def build_reports_from_config(config: Mapping[str, Any], out_dir: str | Path,
                              datasets: Sequence[str] | None = None) -> dict[str, Any]:
    """Every report for the datasets of ``config`` whose token shards exist, written under
    ``out_dir`` (``report.html``, ``validation.json``, ``routing_advice.yaml``,
    ``{dataset}/report.html``). A dataset whose ``validation.json`` is missing (the validate rule
    failed and Snakemake removed it) is summarised from its token shards. Returns the run context."""
    from eagledata.config import load_model_tokenizer
    from eagledata.validate.summary import summarize

    settings = report_settings(config)
    out = Path(out_dir)
    results = Path(config["results_dir"])
    found: dict[str, tuple[Any, Path]] = {}
    for name in datasets or list(config["datasets"]):
        tokens = results / name / "tokens"
        if not (tokens / "manifest.json").exists():
            continue
        vpath = results / name / "validation.json"
        if vpath.exists():
            validation: Any = vpath
        else:
            own = config["datasets"][name].get("validation") or {}
            limit = own.get("max_bad_fraction", config["validation"]["max_bad_fraction"])
            validation = summarize(tokens, limit)
        tokenizer = load_model_tokenizer(config, config["datasets"][name]["model"])
        build_dataset_report(validation, tokens, out / name / "report.html", tokenizer, settings, "../report.html")
        found[name] = (validation, tokens)
    if not found:
        raise FileNotFoundError(f"no token shards under {results}/*/tokens: run the pipeline's tokens stage first")
    return build_run_report(found, out / "report.html", out / "validation.json", out / "routing_advice.yaml",
                            settings, {n: f"{n}/report.html" for n in found})


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m eagledata.report.build --config CONFIG --out DIR [--dataset NAME ...]``"""
    import argparse
    import sys

    from eagledata.config import load_config

    ap = argparse.ArgumentParser(prog="python -m eagledata.report.build",
                                 description="Build the HTML reports outside Snakemake (e.g. after a failed validate).")
    ap.add_argument("--config", default="config/config.yaml")
    ap.add_argument("--out", required=True, help="output directory (keep it outside results_dir)")
    ap.add_argument("--dataset", action="append", help="only these datasets (repeatable)")
    args = ap.parse_args(argv)
    try:
        ctx = build_reports_from_config(load_config(args.config), args.out, args.dataset)
    except FileNotFoundError as exc:
        print(f"eagledata report: {exc}", file=sys.stderr)
        return 2
    print(f"{Path(args.out) / 'report.html'} ({', '.join(d['name'] for d in ctx['datasets'])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

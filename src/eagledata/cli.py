"""Command line: ``eagledata explain SAMPLE_ID`` prints one sample's segments, ids, counts and verdict.

``eagledata plan`` shows what generation would request and cost per dataset (nothing is sent);
``eagledata budget`` shows the spend recorded in the budget ledger and reconciles orphans;
``eagledata profiles`` the provider fidelity accumulated over runs; ``eagledata standin``, ``gpus``
and ``report`` run the stand-in, the GPU claim wrapper and the report builder with their own options.

Reads the token shards a pipeline run wrote (``{results_dir}/{dataset}/tokens``); it never calls an
API. ``--dataset`` narrows the search; without it every dataset of the config is searched.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import polars as pl

from eagledata.tokens.checks import explain as explain_codes
from .config import ConfigError, load_config, load_model_tokenizer


def _find(config: dict, sample_id: str, dataset: str | None):
    names = [dataset] if dataset else list(config["datasets"])
    for name in names:
        tokens = Path(config["results_dir"]) / name / "tokens"
        if not (tokens / "manifest.json").exists():
            continue
        for shard in sorted(tokens.glob("shard-*.parquet")):
            df = pl.read_parquet(shard).filter(pl.col("id") == sample_id)
            if df.height:
                return name, df.row(0, named=True)
    return None, None


def cmd_explain(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if args.dataset is not None and args.dataset not in config["datasets"]:
        print(f"eagledata explain: unknown dataset {args.dataset!r}; the config's: {sorted(config['datasets'])}",
              file=sys.stderr)
        return 2
    name, row = _find(config, args.sample_id, args.dataset)
    if row is None:
        print(f"eagledata: no sample {args.sample_id!r} in the token shards of "
              f"{args.dataset or 'any dataset'} (run the pipeline first)", file=sys.stderr)
        return 2
    tok = load_model_tokenizer(config, config["datasets"][name]["model"])
    ids = row["input_ids"]
    completion = ids[row["prompt_len"]:]
    print(f"sample {row['id']} (dataset {name}, provider {row['provider']}, finish {row['finish_reason']})")
    print(f"verdict: {row['verdict']} (completion {row['completion_verdict']}, prompt {row['prompt_verdict']}); "
          f"{'in training' if row['train'] else 'not in training'} (the dataset's validation.policy)")
    for line in explain_codes(row["reasons"]):
        print(f"  - {line}")
    print(f"prompt tokens: ours {row['prompt_len']}, billed {row['billed_prompt']} (diff {row['prompt_diff']})")
    print(f"completion tokens: ours {row['completion_len']}, billed {row['billed_completion']} "
          f"(diff under provider convention {row['completion_diff']})")
    print(f"reasoning tokens: ours {row['reasoning_len']}, billed {row['billed_reasoning']}")
    rewrites = json.loads(row["tool_id_rewrites"] or "[]")
    for r in rewrites:
        print(f"tool call {r['call']}: provider id {r['original']!r} rebuilt as {r['rebuilt']!r}")
    print("completion segments:")
    for seg in json.loads(row["segments"]):
        seg_ids = completion[seg["start"]:seg["end"]]
        shown = seg_ids if len(seg_ids) <= args.max_ids else seg_ids[: args.max_ids] + ["..."]
        label = tok.decode(seg_ids) if "text" not in seg else seg["text"]
        text = label if len(label) <= 80 else label[:77] + "..."
        print(f"  [{seg['start']:>5}:{seg['end']:<5}] {seg['kind']:<20} {text!r} {shown}")
    return 0


def cmd_profiles(args: argparse.Namespace) -> int:
    from eagledata.validate.profiles import accumulated_profiles, history_path

    config = load_config(args.config)
    path = history_path(config["cache_dir"])
    profiles = accumulated_profiles(path)
    if args.json:
        print(json.dumps(profiles, indent=2))
        return 0
    if not profiles:
        print(f"no validated runs recorded yet ({path})")
        return 0
    print(f"provider fidelity over every validated run ({path}); exact/repair/mism/error: the verdicts of both "
          "sides together (validation.txt's c.* columns count completions alone); c.ok: completions verified:")
    print(f"{'provider':<16}{'total':>7}{'exact':>7}{'repair':>7}{'mism':>7}{'error':>7}{'c.ok':>8}{'p.exact':>8}"
          "  convention   transformations seen; prompt variants; reasoning count")
    for name, p in profiles.items():
        seen = ", ".join(f"{k} x{n}" for k, n in p["transformations_seen"].items()) or "-"
        if p.get("prompt_variants"):
            seen += "; prompt " + ", ".join(p["prompt_variants"])
        if not p.get("reasoning_checksum", True):
            seen += "; reasoning count not a checksum"
        verified = p["completion_verified"] / p["total"] if p["total"] else 0.0
        print(f"{name:<16}{p['total']:>7}{p['exact']:>7}{p['repaired']:>7}{p['mismatch']:>7}{p['error']:>7}"
              f"{verified:>8.1%}{p.get('prompt_exact_share', 0.0):>8.1%}  {p['convention']:<12} {seen}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    modules = {name: module for name, module, _ in PASSTHROUGH}
    if argv and argv[0] in modules:  # every argument after the name is that module's own
        return _passthrough(modules[argv[0]])(argparse.Namespace(rest=argv[1:]))
    ap = argparse.ArgumentParser(prog="eagledata", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="print one sample's segments, ids, counts and verdict")
    ex.add_argument("sample_id")
    ex.add_argument("--dataset")
    ex.add_argument("--config", default="config/config.yaml")
    ex.add_argument("--max-ids", type=int, default=12, help="ids shown per segment")
    ex.set_defaults(func=cmd_explain)
    pr = sub.add_parser("profiles", help="provider fidelity accumulated over every validated run")
    pr.add_argument("--config", default="config/config.yaml")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=cmd_profiles)
    pl_ = sub.add_parser("plan", help="what generation would request and cost, per dataset (sends nothing)")
    pl_.add_argument("datasets", nargs="*", help="default: every dataset of the config")
    pl_.add_argument("--config", default="config/config.yaml")
    pl_.add_argument("--json", action="store_true")
    pl_.set_defaults(func=_lazy("eagledata.generate.plan", "cmd_plan"))
    bu = sub.add_parser("budget", help="spend per dataset and provider from the budget ledger; reconcile orphans")
    bu.add_argument("--config", default="config/config.yaml")
    bu.add_argument("--json", action="store_true")
    bu.add_argument("--reconcile", action="store_true",
                    help="settle orphaned reservations from OpenRouter (/generation, then /key usage); needs OPENROUTER_API_KEY")
    bu.add_argument("--release-orphans", action="store_true",
                    help="settle every orphaned reservation at $0 (after checking the provider's activity page)")
    bu.add_argument("--orphan-host", metavar="HOST", action="append", default=[],
                    help="orphan the reservations in flight of jobs on HOST (gone with its machine: its pids cannot "
                         "be checked from here); first, before --reconcile and --release-orphans")
    bu.set_defaults(func=_lazy("eagledata.generate.budgetcli", "cmd_budget"))
    rt = sub.add_parser("retry", help="forget the cached final errors (4xx) so that the next run requests them again")
    rt.add_argument("datasets", nargs="*", help="default: every generated dataset of the config")
    rt.add_argument("--config", default="config/config.yaml")
    rt.add_argument("--status", type=int, action="append", metavar="N",
                    help="only final errors of this HTTP status (repeatable; default: all)")
    rt.add_argument("--dry-run", action="store_true", help="count them, change nothing")
    rt.set_defaults(func=_lazy("eagledata.generate.retryfinal", "cmd_retry"))
    for name, module, help_ in PASSTHROUGH:
        sp = sub.add_parser(name, help=help_, add_help=False)
        sp.add_argument("rest", nargs=argparse.REMAINDER)
        sp.set_defaults(func=_passthrough(module))
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:  # a config that does not load or validate: its message names the file and key
        print(f"eagledata {args.command}: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"eagledata {args.command}: {exc.strerror}: {exc.filename}", file=sys.stderr)
        return 2


#: Subcommands whose arguments belong to another module's own ``main`` (``eagledata standin --help``).
PASSTHROUGH = (
    ("standin", "eagledata.standin.cli", "run the local OpenRouter/SGLang stand-in (demo backend, rehearsals with faults)"),
    ("gpus", "eagledata.extract.gpus", "claim N GPUs (flock) and run a command with CUDA_VISIBLE_DEVICES set"),
    ("report", "eagledata.report.build", "build the HTML reports from existing token shards (after a failed validate)"),
)


def _passthrough(module: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        return int(importlib.import_module(module).main(args.rest) or 0)

    return run


def _lazy(module: str, name: str):
    """A subcommand implemented in another module, imported only when it runs."""

    def run(args: argparse.Namespace) -> int:
        import importlib

        return getattr(importlib.import_module(module), name)(args)

    return run


if __name__ == "__main__":
    sys.exit(main())

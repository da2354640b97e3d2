"""``eagledata budget``: the ledger's spend per dataset and provider, real spend apart from the
stand-in's and a local server's, the caps and what is left; orphans orphaned by host, reconciled
from OpenRouter or released (:mod:`eagledata.generate.budget`)."""

from __future__ import annotations

from typing import Any, Mapping

from eagledata.config import dataset_settings
from eagledata.generate.budget import (BILLED_BACKEND, BudgetLedger, account, account_backend, backend_totals, format_usd,
                                       ledger_path)


def format_report(rows: list[dict[str, Any]], totals: Mapping[str, Mapping[str, float]], budget_usd: float | None,
                  dataset_budgets: Mapping[str, float | None]) -> str:
    """The ``eagledata budget`` table: spent and held per account (a dataset's real spend under its
    name, the stand-in's under ``dataset@simulator``) and provider, the caps (``dataset_budgets``:
    account -> cap) and what is left."""
    head = f"{'dataset':<16} {'provider':<22} {'attempts':>8} {'spent':>11} {'in flight':>11} {'orphaned':>11} {'tokens in/out':>21}"
    lines = [head, "-" * len(head)]
    for r in rows:
        usd = [format_usd(r[k]) for k in ("spent_usd", "in_flight_usd", "orphaned_usd")]
        lines.append(f"{r['dataset']:<16} {str(r['provider'])[:22]:<22} {r['attempts']:>8} {usd[0]:>11} {usd[1]:>11} "
                     f"{usd[2]:>11} {str(r['prompt_tokens']) + '/' + str(r['completion_tokens']):>21}")
    spent, held = backend_totals(totals, BILLED_BACKEND)
    lines.append(f"total: spent {format_usd(spent)}, held {format_usd(held)} (in flight + orphaned, counted as spent until reconciled)")
    for backend in sorted({account_backend(k) for k in totals} - {BILLED_BACKEND}):
        other_spent, other_held = backend_totals(totals, backend)
        lines.append(f"{backend} (not billed; capped apart from real spend): spent {format_usd(other_spent)}, held {format_usd(other_held)}")
    if budget_usd is not None:
        lines.append(f"budget_usd {budget_usd:g}: remaining {format_usd(budget_usd - spent - held)}")
    for ds, cap in dataset_budgets.items():  # ``ds``: the dataset's account (its backend's spend)
        if cap is not None:
            t = totals.get(ds, {"spent": 0.0, "held": 0.0})
            lines.append(f"datasets.{ds.partition('@')[0]}.budget_usd {cap:g}: remaining {format_usd(cap - t['spent'] - t['held'])}"
                         + (f" ({account_backend(ds)})" if account_backend(ds) != BILLED_BACKEND else ""))
    return "\n".join(lines)


def cmd_budget(args: Any) -> int:
    """``eagledata budget [--orphan-host HOST] [--reconcile] [--release-orphans] [--json]``."""
    import asyncio
    import json
    import sys

    from eagledata.config import load_config

    config = load_config(args.config)
    path = ledger_path(config["cache_dir"])
    if not path.exists():
        print(f"eagledata budget: no ledger yet at {path} (nothing was generated with this cache_dir)", file=sys.stderr)
        return 0 if not (args.reconcile or args.release_orphans or args.orphan_host) else 2
    ledger = BudgetLedger(path)
    try:
        notes = [f"orphaned {ledger.orphan_host(host)} reservation(s) in flight on host {host}" for host in args.orphan_host]
        if args.reconcile:
            from eagledata.generate.errors import GenerationError
            from eagledata.generate.openrouter import api_key, key_usage, reconcile_generations

            try:
                headers = {"Authorization": f"Bearer {api_key('eagledata budget --reconcile')}"}
            except GenerationError as exc:
                print(exc, file=sys.stderr)
                return 2
            bases = sorted({r["api_base"] for r in ledger.orphans() if r["api_base"]})
            for base in bases:
                notes.append(f"{base}: /generation: {asyncio.run(reconcile_generations(ledger, base, headers))}")
                usage = asyncio.run(key_usage(base, headers))
                if usage is not None:
                    notes.append(f"{base}: /key usage ${usage:.4f}: {ledger.reconcile_by_key_usage(base, usage)}")
            if not bases:
                notes.append("no orphaned reservation to reconcile")
        if args.release_orphans:
            notes.append(f"released {ledger.release_orphans()} orphaned reservation(s) at $0")
        rows, totals = ledger.report(), ledger.totals()
        caps = {account(ds, dataset_settings(config, ds).backend): (config["datasets"].get(ds) or {}).get("budget_usd")
                for ds in config["datasets"]}
        if args.json:
            print(json.dumps({"ledger": str(path), "budget_usd": config.get("budget_usd"), "rows": rows, "totals": totals,
                              "orphans": ledger.orphans(), "notes": notes}, indent=1))
        else:
            for n in notes:
                print(n)
            print(format_report(rows, totals, config.get("budget_usd"), caps))
            orphans = ledger.orphans()
            if orphans:
                print(f"{len(orphans)} orphaned reservation(s) (answers lost: timeouts, cancelled or killed jobs); "
                      f"`eagledata budget --reconcile` settles them from OpenRouter")
    finally:
        ledger.close()
    return 0


__all__ = ["cmd_budget", "format_report"]

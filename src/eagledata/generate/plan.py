"""Cost estimates (shared by the budget ledger and ``eagledata plan``) and the plan itself.

Worst case of one request = prompt tokens (upper estimate) x prompt price + ``max_tokens`` x
completion price, at the PRICE BOUND: the routing's ``provider.max_price`` where set (OpenRouter then
never routes above it), else ``models.NAME.price_per_mtok``. Prompt tokens come from the model's chat
template and tokenizer when it loads (+2 %, +25 % with tools, since providers render tool
declarations their own way), else from the UTF-8 size of the messages (one token per byte at most,
for byte-level BPE vocabularies).

``eagledata plan`` (no request is sent, nothing is paid): per dataset, the samples, how many are
cached, how many would be requested, and the cost range of those: low (prompt + one completion
token each), expected (prompt + the mean completion length of the dataset's cached responses, when
there are any) and worst case (the budget reservation); plus the ledger's spend and the budget left,
and, for a dataset with its own ``budget_usd``, what is left of that cap (its own account, as the job's
reservations count it), with a note where its worst case exceeds it.
With ``turns: all`` the plan counts turns, not records: ``samples`` is every user turn of every
conversation (:func:`eagledata.generate.conversation.user_turns` x ``samples_per_prompt``),
``cached`` the turns answered in the cache (followed conversation by conversation, as the job
does), ``to_request`` the turns left of the conversations not ended. ``cached`` counts the answers
the job will carry over from other datasets' caches (:mod:`eagledata.generate.carryover`) too; with
``turns: all`` only once the job has carried them (the plan then errs on the side of cost). A later turn's prompt holds the
model's earlier replies, not known before they are generated, so its estimate is the record's own
messages up to that turn (system, user and tool messages; the original assistant replies left out)
and its worst case adds :data:`HISTORY_TOKENS_PER_TURN` per earlier turn: ``max_tokens`` (the
longest reply the model may give) plus that many template tokens. The worst case assumes every
conversation runs to its last turn (none ends early at a tool mismatch).

A dataset whose token plan (the ``token_plan`` checkpoint) is not current (requests to send, or a
``plan.json`` older than its responses or missing) gets a note: ``snakemake -n`` cannot list its
token_shard and extract_shard jobs until the plan is rewritten (:func:`shard_jobs_known`).

A dataset with requests for OpenRouter and no usable ``OPENROUTER_API_KEY`` gets a warning (the plan itself
needs no key). It also runs the cheap part of the generate job's preflight (:func:`eagledata.generate.tokenizers.tokenizer_problem`:
the tokenizer directory is found and holds tokenizer files) and exits 1, naming the path, where it
fails; a config error (unknown key, bad dataset name) stops it with the message, exit 2.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from eagledata.config import DatasetSettings, dataset_settings
from eagledata.errors import InputError
from eagledata.generate.budget import BILLED_BACKEND, BudgetLedger, account, format_usd, ledger_path
from eagledata.generate.cache import ResponseCache
from eagledata.generate.carryover import carried_records
from eagledata.generate.errors import GenerationError
from eagledata.generate.progress import stderr_log
from eagledata.generate.prompts import canonical_json
from eagledata.generate.dedup import dataset_option
from eagledata.generate.requests import dataset_work
from eagledata.generate.respell import Respeller
from eagledata.generate.retryfinal import config_option, final_errors, status_counts
from eagledata.generate.tokenizers import cached_model_tokenizer, tokenizer_problem, workflow_built


#: Template tokens around one earlier reply in a later turn's prompt (its role markers and tool-call
#: markup), on top of the reply's own ``max_tokens`` at most (worst case of ``turns: all``).
HISTORY_TOKENS_PER_TURN = 32


@dataclass(frozen=True)
class Price:
    prompt: float  # USD per million tokens
    completion: float
    source: str

    def cost(self, prompt_tokens: float, completion_tokens: float) -> float:
        return (prompt_tokens * self.prompt + completion_tokens * self.completion) / 1e6


def price_bound(settings: DatasetSettings) -> Price:
    """The price bound of a dataset: ``provider.max_price`` where set, else ``price_per_mtok``."""
    own = settings.model.get("price_per_mtok") or {}
    price = Price(float(own.get("prompt", 0) or 0), float(own.get("completion", 0) or 0), f"models.{settings.model_name}.price_per_mtok")
    max_price = ((settings.generation.get("provider") or {}).get("max_price") or {}) if settings.backend == "openrouter" else {}
    if isinstance(max_price, Mapping) and any(isinstance(max_price.get(k), (int, float)) for k in ("prompt", "completion")):
        return Price(float(max_price.get("prompt", price.prompt)), float(max_price.get("completion", price.completion)),
                     "generation.provider.max_price")
    return price


class PromptEstimator:
    """Prompt-token counts of request bodies: exact from the chat template when a tokenizer is
    given, else an upper bound from the UTF-8 size."""

    def __init__(self, tokenizer: Any = None, why_not: str | None = None):
        self.tokenizer = tokenizer
        self.why_not = why_not

    @property
    def method(self) -> str:
        return "chat template" if self.tokenizer is not None else f"bytes ({self.why_not or 'no tokenizer'})"

    def count(self, messages: Any, tools: Any, reasoning: Any = None) -> tuple[int, int]:
        """(estimate, upper bound) of the prompt tokens. With tools, the bound covers a provider that
        declares them as JSON rather than in the model's own declaration (TypeScript for Kimi K2.5:
        about 1.4 times fewer tokens than the JSON a provider may render)."""
        if self.tokenizer is not None:
            from eagledata.text.chat import ChatTemplateError, prompt_ids, request_thinking

            thinking = request_thinking({"reasoning": reasoning})
            try:
                n = len(prompt_ids(self.tokenizer, messages, tools, thinking=thinking))
                most = max(n, len(prompt_ids(self.tokenizer, messages, tools, thinking=thinking, tool_declaration="json"))) \
                    if tools else n
                return n, math.ceil(most * (1.25 if tools else 1.02)) + 16
            except ChatTemplateError:
                pass
        n_bytes = len(canonical_json({"messages": messages, "tools": tools or None}).encode("utf-8"))
        upper = n_bytes + 8 * len(messages or []) + 64
        return max(1, n_bytes // 4), upper


def load_estimator(config: Mapping[str, Any], settings: DatasetSettings) -> PromptEstimator:
    """A prompt-token estimator from the model tokenizer; the byte bound when it does not load."""
    try:
        return PromptEstimator(cached_model_tokenizer(config, settings.model_name))
    except Exception as exc:  # noqa: BLE001 - any load failure falls back to the byte bound
        return PromptEstimator(None, f"tokenizer unavailable: {type(exc).__name__}")


def _mean_completion_tokens(cache_path: Path, index: Mapping[str, tuple[int, int]], limit: int = 200) -> float | None:
    from eagledata.tokens.responses import parse_response

    values = []
    with open(cache_path, "rb") as fh:
        for offset, length in list(dict.fromkeys(index.values()))[:limit]:  # a record once (aliases)
            fh.seek(offset)
            rec = json.loads(fh.read(length))
            if rec.get("status") == 200:
                n = parse_response(rec.get("response_raw") or "").completion_tokens
                if n is not None:
                    values.append(n)
    return sum(values) / len(values) if values else None


def plan_dataset(config: Mapping[str, Any], name: str, estimator: PromptEstimator | None = None) -> dict[str, Any]:
    """The plan of one dataset (see the module docstring)."""
    s = dataset_settings(config, name)
    if s.imported:
        return {"dataset": name, "backend": "import", "samples": None, "cached": None, "to_request": 0,
                "cost_low": 0.0, "cost_expected": 0.0, "cost_worst": 0.0, "note": f"imported from {s.responses}"}
    estimator = estimator or load_estimator(config, s)
    try:
        work = dataset_work(config, name, tokenizer=estimator.tokenizer)
    except InputError as exc:  # the prompts file (its line and field): what the generate job would refuse
        return {"dataset": name, "backend": s.backend, "samples": None, "cached": None, "to_request": 0,
                "cost_low": 0.0, "cost_expected": None, "cost_worst": 0.0, "error": str(exc),
                "note": f"bad input, generation would refuse it: {exc}"}
    except Exception as exc:  # noqa: BLE001 - e.g. the simulator's tokenizer is not built yet
        why = f"{type(exc).__name__}: {str(exc)[:120]}"
        later = bool(tokenizer_problem(s.model, s.model_name)) and workflow_built(s.model["tokenizer"], config)
        if tokenizer_problem(s.model, s.model_name):  # say so, not what a hub lookup of the path said
            why = (f"tokenizer {s.model['tokenizer']} is built by the workflow and not built yet"
                   if later else tokenizer_problem(s.model, s.model_name))
        out = {"dataset": name, "backend": s.backend, "samples": None, "cached": None, "to_request": 0,
               "cost_low": 0.0, "cost_expected": None, "cost_worst": 0.0,
               "note": f"cannot compute the requests {'yet ' if later else ''}({why})"}
        if not later:  # a tokenizer there but unreadable, say: the generate job refuses it too
            out["error"] = f"cannot compute the requests: {why}"
        return out
    cache = ResponseCache(Path(config["cache_dir"]) / name / "responses.jsonl")
    index = cache.load()
    price = price_bound(s)
    max_tokens = int(s.generation.get("max_tokens", 4096))
    if work.turns == "all":
        samples, cached, n, prompt_est, prompt_upper, turns = _turns_plan(work, cache, estimator, max_tokens)
    else:
        todo = {it.cache_key: it for it in work.items if it.cache_key not in index}
        if todo and Respeller(cache, work.salt).take(todo.values()):  # 1 and 1.0: one request
            todo = {k: it for k, it in todo.items() if k not in index}
        carried: set[str] = set()
        if todo and dataset_option(config, name, "dedup"):
            carried = {rec["cache_key"] for _, rec in carried_records(todo, config["cache_dir"], name, stderr_log)}
            todo = {k: it for k, it in todo.items() if k not in carried}
        prompt_est = prompt_upper = 0
        for it in todo.values():
            est, upper = estimator.count(it.chat_request.get("messages"), it.chat_request.get("tools"), it.chat_request.get("reasoning"))
            prompt_est += est
            prompt_upper += upper
        cached = sum(1 for it in work.items if it.cache_key in index or it.cache_key in carried)
        samples, n, turns = len(work.items), len(todo), None
    mean = _mean_completion_tokens(cache.path, index) if index and n else None
    return {"dataset": name, "backend": s.backend, "model": s.api_model, "samples": samples,
            "cached": cached, "to_request": n, **({"turns": turns} if turns else {}),
            "final_errors": cached_final_errors(cache, work.items),
            "duplicates": len(work.duplicates),
            "prompt_tokens": prompt_est, "max_tokens": max_tokens,
            "price_per_mtok": {"prompt": price.prompt, "completion": price.completion, "source": price.source},
            "cost_low": price.cost(prompt_est, n), "cost_expected": price.cost(prompt_est, n * mean) if mean is not None else None,
            "cost_worst": price.cost(prompt_upper, n * max_tokens), "mean_completion_tokens": mean,
            "prompt_estimate": estimator.method,
            "dataset_budget_usd": (config["datasets"][name].get("budget_usd"))}


def cached_final_errors(cache: ResponseCache, items: Iterable[Any]) -> dict[str, int]:
    """HTTP status -> how many of ``items`` have a final error cached (counted as cached: not requested
    again until ``eagledata retry`` forgets them)."""
    return status_counts(final_errors(cache, keys=(it.cache_key for it in items)))


def _turns_plan(work: Any, cache: ResponseCache, estimator: PromptEstimator,
                max_tokens: int) -> tuple[int, int, int, int, int, dict[str, Any]]:
    """``turns: all``: (turns, cached, to request, prompt estimate, prompt upper bound, details) as in
    the module docstring."""
    from eagledata.generate.conversation import split_turns, user_turns
    from eagledata.generate.requests import sample_id
    from eagledata.generate.turns import TurnPlanner

    state = TurnPlanner(work, cache, work.tokenizer, Respeller(cache, work.salt)).advance()
    work.items = state.items  # every turn known, as the job sees them (its cached final errors counted too)
    n_samples = int(work.settings.generation.get("samples_per_prompt", 1))
    reasoning = work.settings.generation.get("reasoning")
    total = todo = est_sum = upper_sum = 0
    for p in work.prompts:
        preamble, turns = split_turns(p.messages)
        total += len(turns) * n_samples
        counts = []  # (estimate, upper) of turn t's prompt without the replies
        history = list(preamble)
        for t, turn in enumerate(turns):
            history += turn.opening
            est, upper = estimator.count(history, p.tools, reasoning)
            counts.append((est, upper + t * (max_tokens + HISTORY_TOKENS_PER_TURN)))
            history += turn.tool_results
        for k in range(n_samples):
            conv = sample_id(p.id, k, n_samples)
            if conv in state.ends:
                continue
            for est, upper in counts[state.answered.get(conv, 0):user_turns(p.messages)]:
                todo += 1
                est_sum += est
                upper_sum += upper
    cached = sum(1 for it in state.items if it.cache_key in cache.index)
    details = {"conversations": len(state.answered), "ended": len(state.ends),
               "worst_case": f"every conversation to its last turn; each earlier reply {max_tokens}+"
                             f"{HISTORY_TOKENS_PER_TURN} tokens of the later prompts"}
    return total, cached, todo, est_sum, upper_sum, details


def plan(config: Mapping[str, Any], datasets: list[str] | None = None) -> dict[str, Any]:
    """The plan of ``datasets`` (all by default) with the ledger's spend and the budget left."""


    names = datasets or list(config["datasets"])
    rows = [plan_dataset(config, n) for n in names]
    for row in rows:
        row["token_plan"] = str(Path(config.get("results_dir", "results")) / row["dataset"] / "tokens.work" / "plan.json")
        row["shard_jobs_known"] = shard_jobs_known(row["token_plan"], row.get("to_request") or 0)
        model_name = config["datasets"][row["dataset"]]["model"]
        model = config["models"][model_name]
        built = workflow_built(model["tokenizer"], config) and not Path(model["tokenizer"]).exists()
        row["preflight"] = None if built else tokenizer_problem(model, model_name)
        row["api_key_problem"] = api_key_problem(row)
    path = ledger_path(config["cache_dir"])
    spent = held = 0.0
    totals: dict[str, dict[str, float]] = {}
    if path.exists():
        ledger = BudgetLedger(path)
        try:
            totals = ledger.totals()
            spent, held = ledger.billed_totals()  # a rehearsal's simulated spend is capped apart
        finally:
            ledger.close()
    for row in rows:  # a dataset's own cap counts its own account only, as the job's reservations do
        if row.get("dataset_budget_usd") is not None:
            own = totals.get(account(row["dataset"], row["backend"]), {"spent": 0.0, "held": 0.0})
            row["dataset_remaining_usd"] = row["dataset_budget_usd"] - own["spent"] - own["held"]
    budget = config.get("budget_usd")
    worst = sum(r["cost_worst"] for r in rows)
    billed_worst = sum(r["cost_worst"] for r in rows if r["backend"] == BILLED_BACKEND)  # what budget_usd caps
    return {"datasets": rows, "budget_usd": budget, "spent_usd": spent, "held_usd": held,
            "remaining_usd": None if budget is None else budget - spent - held,
            "cost_low": sum(r["cost_low"] for r in rows), "cost_worst": worst, "billed_cost_worst": billed_worst,
            "ledger": str(path)}


def api_key_problem(row: Mapping[str, Any]) -> str | None:
    """Why the generate job would stop before its first request for want of a usable
    ``OPENROUTER_API_KEY`` (a dataset with requests to send to OpenRouter), else ``None``."""
    if row.get("backend") != BILLED_BACKEND or not row.get("to_request"):
        return None
    from eagledata.generate.openrouter import api_key  # here: it imports the HTTP client

    try:
        api_key(f"dataset {row['dataset']!r} uses backend openrouter")
    except GenerationError as exc:
        return str(exc)
    return None


def shard_jobs_known(token_plan: str | Path, to_request: int) -> bool:
    """Whether ``snakemake -n`` can list a dataset's per-shard jobs: its token plan (a checkpoint, whose
    shards Snakemake learns only when it has run) is current: nothing to request, and ``plan.json``
    exists and is newer than the responses beside its work directory."""
    plan_file = Path(token_plan)
    try:
        return not to_request and plan_file.stat().st_mtime_ns >= (plan_file.parent.parent / "responses.jsonl").stat().st_mtime_ns
    except OSError:
        return False


def format_plan(p: Mapping[str, Any], config_path: str | None = None) -> str:
    """The plan as the table ``eagledata plan`` prints (``config_path``: the config it read, repeated in
    the commands it suggests when it is not the default one)."""
    config_arg = config_option(config_path)
    def usd(v: float | None) -> str:
        return "-" if v is None else format_usd(v, ",")

    head = f"{'dataset':<16} {'backend':<10} {'samples':>8} {'cached':>8} {'request':>8} {'low':>11} {'expected':>11} {'worst':>11}  prompt estimate"
    lines = [head, "-" * len(head)]
    for r in p["datasets"]:
        if r.get("samples") is None:
            lines.append(f"{r['dataset']:<16} {r['backend']:<10} {'-':>8} {'-':>8} {'-':>8} {'-':>11} {'-':>11} {'-':>11}  {r['note']}")
            continue
        lines.append(f"{r['dataset']:<16} {r['backend']:<10} {r['samples']:>8} {r['cached']:>8} {r['to_request']:>8} "
                     f"{usd(r['cost_low']):>11} {usd(r['cost_expected']):>11} {usd(r['cost_worst']):>11}  {r['prompt_estimate']}")
    lines.append(f"total: {sum(r['to_request'] for r in p['datasets'])} request(s), cost {usd(p['cost_low'])} .. {usd(p['cost_worst'])} (worst case)")
    if p["budget_usd"] is None:
        lines.append(f"budget_usd: none set (ledger {p['ledger']}: spent {usd(p['spent_usd'])}, held {usd(p['held_usd'])})")
    else:
        lines.append(f"budget_usd {p['budget_usd']:g}: spent {usd(p['spent_usd'])}, held {usd(p['held_usd'])}, "
                     f"remaining {usd(p['remaining_usd'])} (ledger {p['ledger']})")
        if p["remaining_usd"] is not None and p["billed_cost_worst"] > p["remaining_usd"]:
            lines.append("note: the worst case exceeds what is left; generation stops starting requests at the budget "
                         "(completed responses stay cached)")
    for r in p["datasets"]:
        left = r.get("dataset_remaining_usd")
        if left is not None and (r.get("cost_worst") or 0.0) > left:
            lines.append(f"note: {r['dataset']}: the worst case {usd(r['cost_worst'])} exceeds what is left of "
                         f"datasets.{r['dataset']}.budget_usd {r['dataset_budget_usd']:g} ({usd(left)}); generation "
                         "stops starting requests at that cap (completed responses stay cached)")
    for r in p["datasets"]:
        if r.get("turns"):
            lines.append(f"note: {r['dataset']}: turns: all: samples/cached/request count turns of "
                         f"{r['turns']['conversations']} conversation(s); worst case: {r['turns']['worst_case']}")
        if r.get("duplicates"):
            lines.append(f"note: {r['dataset']}: {r['duplicates']} duplicate prompt(s) left out (dedup)")
        if r.get("final_errors"):
            by = ", ".join(f"HTTP {k}: {v}" for k, v in r["final_errors"].items())
            lines.append(f"note: {r['dataset']}: {sum(r['final_errors'].values())} of the cached are final errors ({by}), "
                         f"not requested again; once their cause is fixed, `eagledata retry {r['dataset']}{config_arg}` requests them again")
    for r in p["datasets"]:
        if r.get("shard_jobs_known") is False:
            first = "its requests are answered and " if r.get("to_request") else ""
            lines.append(f"note: {r['dataset']}: `snakemake -n` lists none of its token_shard and extract_shard jobs until "
                         f"{first}its token plan is rewritten (a checkpoint): `snakemake {r['token_plan']}`, then `snakemake -n`")
    for r in p["datasets"]:
        if r.get("preflight"):
            lines.append(f"error: {r['dataset']}: {r['preflight']} (generation would stop before its first request)")
    for r in p["datasets"]:
        if r.get("api_key_problem"):
            lines.append(f"warning: {r['api_key_problem']} (generation would stop before its first request)")
    for r in p["datasets"]:
        zero = [k for k in ("prompt", "completion") if (r.get("price_per_mtok") or {}).get(k) == 0]
        if zero and r["backend"] == "openrouter":
            lines.append(f"warning: {r['dataset']}: {r['price_per_mtok']['source']} has a {' and '.join(zero)} price of 0, "
                         f"so those tokens are estimated at $0 and the budget cannot reserve them: set "
                         f"models.<name>.price_per_mtok or provider.max_price")
    return "\n".join(lines)


def cmd_plan(args: Any) -> int:
    """``eagledata plan [DATASET...]``: see the module docstring."""
    import sys

    from eagledata.config import ConfigError, load_config

    try:
        config = load_config(args.config)
    except (ConfigError, OSError) as exc:
        print(f"eagledata plan: {exc}", file=sys.stderr)
        return 2
    unknown = [d for d in args.datasets if d not in config["datasets"]]
    if unknown:
        print(f"eagledata plan: unknown dataset(s) {unknown}; defined: {sorted(config['datasets'])}", file=sys.stderr)
        return 2
    p = plan(config, args.datasets or None)
    print(json.dumps(p, indent=1) if args.json else format_plan(p, args.config))
    return 1 if any(r.get("preflight") or r.get("error") for r in p["datasets"]) else 0

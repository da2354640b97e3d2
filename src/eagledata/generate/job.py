"""Generation: prompts -> exact response bodies, through OpenRouter, a local SGLang server, or the stand-in.

:func:`generate_dataset` (the ``generate`` rule's entry; also ``python -m eagledata.generate.job``) runs
one dataset's job in these steps, each in a module of its own:

1. **Work** (:mod:`~eagledata.generate.requests`): every sample's exact request body and cache key.
2. **Cache** (:mod:`~eagledata.generate.cache`): one job at a time writes a dataset's cache (an
   ``flock``, :mod:`~eagledata.generate.cachelock`); answers rescued by an earlier job whose disk was
   full are imported first; answers other datasets' caches hold for the same requests are carried
   over (:mod:`~eagledata.generate.carryover`: a renamed dataset pays nothing again); only samples
   not cached are requested.
3. **Preflight** (:mod:`~eagledata.generate.preflight`): before the first paid request, what a later
   stage would otherwise find only after paying (tokenizer, every prompt renders, weights, disk room).
4. **Ledger** (:mod:`~eagledata.generate.budget`): the reservations of dead processes are recovered, and
   OpenRouter orphans reconciled (:mod:`~eagledata.generate.openrouter`); each sample's worst-case cost
   (:mod:`~eagledata.generate.plan`) is what its attempts reserve.
5. **Requests** (:mod:`~eagledata.generate.attempts`): workers with retries; 401/402/budget stop the job
   (:class:`JobStopped`), SIGINT/SIGTERM and ``generation.job_timeout_s`` drain it (:class:`Interrupted`,
   exit status 128 + signal from the entry points), the answers received are made durable.
   With ``turns: all`` (:mod:`~eagledata.generate.turns`) the requests go in rounds, one turn of
   every unfinished conversation per round, each round's bodies computed from the replies cached
   by the rounds before (a conversation's turns in order, different conversations concurrently).
6. **Output**: ``results/{dataset}/responses.jsonl`` written atomically in prompt-file order, with a
   summary (``generation_summary.json``) beside the cache; a prompt still failing after
   ``max_attempts`` is listed in :class:`GenerationError` (the others are cached; a rerun sends only
   the failing ones).

SGLang (``backend: sglang``, ``generation.api_base`` = the server root). ``sglang_endpoint: chat``
(default) sends SGLang's OpenAI-compatible ``/v1/chat/completions`` with ``return_token_ids`` (never
streamed); ``generate`` sends the native ``/generate`` with ``input_ids`` rendered by the model's chat
template. Either way the record gets ``token_ids``: see
:func:`eagledata.generate.answers.sglang_completion_ids`; an answer without usable ids (a server that
ignores ``return_token_ids``, ids its own completion count disagrees with) stops the job.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from eagledata.config import DatasetSettings, dataset_generation, dataset_settings, validate_config
from eagledata.eventloop import run as run_event_loop
from eagledata.eventloop import uvloop_module
from eagledata.generate.attempts import LEDGER_WRITE_ERRORS, GenerationJob, ledger_write_error
from eagledata.generate.budget import OTHERS_WAIT_S, BudgetLedger, account, ledger_path
from eagledata.generate.ledgersession import LedgerSession
from eagledata.generate.cache import ResponseCache, import_rescued_answers, keep_paid_answers, write_jsonl_atomic
from eagledata.generate.dedup import dataset_option
from eagledata.generate.cachelock import CacheLockTimeout, acquire_writer_lock, lock_wait_s
from eagledata.generate.carryover import RequestClaims, carry_over
from eagledata.generate.errors import GenerationError, Interrupted, JobStopped
from eagledata.generate.openrouter import auth_headers, key_usage, reconcile_generations
from eagledata.generate.plan import Price, PromptEstimator, load_estimator, price_bound
from eagledata.generate.progress import Log, Progress, stderr_log
from eagledata.generate.prompts import read_prompts
from eagledata.generate.requests import (DEFAULT_API_BASE, DatasetWork, WorkItem, dataset_work, normalized_api_base,
                                         uses_native_endpoint)
from eagledata.generate.rescue import free_space
from eagledata.generate.respell import Respeller
from eagledata.generate.retries import ClientSettings, attempt_timeout_s
from eagledata.generate.servedmodel import MODEL_INFO_PATH, check_cached_answers, served_model_path
from eagledata.generate.turns import TurnPlanner, TurnState, conversation_summary
from eagledata.io import atomic_write_json, sha256_file

#: Fields of every record of ``results/{dataset}/responses.jsonl``.
RECORD_FIELDS = ("id", "prompt_id", "sample_index", "request", "status", "response_raw", "url", "cache_key",
                 "backend", "started_at", "elapsed_s", "attempts", "generation_id", "token_ids")
#: Fields present only where they apply (SGLang backend; native endpoint; ``turns: all``; an answer
#: carried over from another dataset's cache, :mod:`eagledata.generate.carryover`).
OPTIONAL_FIELDS = ("prompt_token_ids", "token_ids_info", "chat_request", "conversation", "turn", "carried_from",
                   "served_model")


@dataclass
class Run:
    """One job's state, from its setup to its summary."""

    config: dict[str, Any]
    dataset: str
    settings: DatasetSettings
    headers: dict[str, str]
    tokenizer: Any
    work: DatasetWork
    log: Log
    cache: ResponseCache | None = None
    todo: dict[str, WorkItem] = field(default_factory=dict)
    n_cached: int = 0
    api_base: str = ""
    job: GenerationJob | None = None
    reconciled: dict[str, Any] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=lambda: {"spent": 0.0, "held": 0.0})
    planner: TurnPlanner | None = None  # turns: all
    turn_state: TurnState | None = None
    rounds: int = 0
    carried: dict[str, int] = field(default_factory=dict)  # answers carried over, per dataset they came from
    respeller: Respeller | None = None  # answers cached under another spelling of the same settings
    claims: RequestClaims | None = None  # requests claimed across datasets while sent (dedup: false: never waits)
    served_model: str | None = None  # SGLang: the model path the server reports (recorded in each answer)
    prompts_sha256: str = ""  # of the prompts file as the job read it (:func:`check_prompts_unchanged`)


def never_failing(log: Log) -> Log:
    """``log``, falling back to stderr when its file cannot be written: a full disk must not keep
    the job from saving the answers it was paid for."""

    def safe(message: str) -> None:
        try:
            log(message)
        except OSError:
            try:
                stderr_log(message)
            except OSError:
                pass

    return safe


def prepare(config: Mapping[str, Any], dataset: str, log: Log) -> Run:
    """The validated config, the dataset's settings, headers, tokenizer (where the requests need
    it) and work; raises :class:`GenerationError` for a dataset that cannot be generated."""
    config = validate_config(copy.deepcopy(dict(config)))
    s = dataset_settings(config, dataset)
    if s.imported or not s.prompts:
        raise GenerationError(f"dataset {dataset!r} has 'responses:' (imported); it is not generated")
    if s.backend == "sglang" and normalized_api_base(s) == DEFAULT_API_BASE.removesuffix("/v1"):
        raise GenerationError(f"dataset {dataset!r} uses backend sglang: set generation.api_base to the SGLang server "
                              "(e.g. http://127.0.0.1:30000)")
    headers = auth_headers(s.backend, dataset)
    prompts_sha256 = sha256_file(s.prompts)
    read_prompts(s.prompts)  # a bad prompt file is reported (file:line:field) before the tokenizer is needed
    tokenizer = None
    # the requests themselves need it (keys, prompt ids), and dedup compares canonical prompt ids
    if s.backend == "simulator" or uses_native_endpoint(s) or dataset_option(config, dataset, "dedup"):
        from eagledata.generate.preflight import checked_tokenizer

        tokenizer = checked_tokenizer(config, s)  # found and self-checked, or a PreflightError naming the path
    work = dataset_work(config, dataset, tokenizer)
    for d in work.duplicates:
        log(f"generate {dataset}: {s.prompts}:{d.line}: prompt {d.id!r} left out, a duplicate of {d.duplicate_of} (dedup)")
    run = Run(config, dataset, s, headers, tokenizer, work, log, api_base=work.api_base, prompts_sha256=prompts_sha256)
    check_prompts_unchanged(run, "while the job read it")
    return run


def check_prompts_unchanged(run: Run, when: str) -> None:
    """A :class:`GenerationError` when the dataset's prompts file no longer has the content the job
    read. Snakemake records its inputs' checksums when a job ends, so an output written from the
    file as it was would pass for the file as it is: prompts appended while a long job runs would be
    left out, with every later dry run \"nothing to be done\". Failing instead removes the output, and
    the rerun requests only what is not cached."""
    path = run.settings.prompts
    try:
        now = sha256_file(path)
    except OSError as exc:
        now = f"unreadable ({exc})"
    if now != run.prompts_sha256:
        raise GenerationError(f"generate {run.dataset}: {path} changed {when} (it read {len(run.work.prompts)} prompt(s)); "
                              "the answers received are cached and will not be requested again: rerun to generate "
                              "what the file holds now")


async def take_cache_lock(config: Mapping[str, Any], dataset: str, log: Log) -> Any:
    """The dataset's cache writer lock (:mod:`eagledata.generate.cachelock`), waited for; a timeout is a
    :class:`GenerationError` naming the holder."""
    try:
        return await acquire_writer_lock(config["cache_dir"], dataset, lock_wait_s(dataset_generation(config, dataset)), log)
    except CacheLockTimeout as exc:
        raise GenerationError(f"generate {dataset}: {exc}") from None


def open_cache(run: Run) -> None:
    """Read the cache (the lock is held), import rescued answers, and find what is missing."""
    cache = run.cache = ResponseCache(Path(run.config["cache_dir"]) / run.dataset / "responses.jsonl", run.dataset)
    index = cache.load()
    if cache.skipped_lines:
        run.log(f"warning: {cache.path}: {cache.skipped_lines} unreadable line(s) ignored (those requests are sent again)")
    import_rescued_answers(cache, run.dataset, run.log)
    respeller = run.respeller = Respeller(cache, run.work.salt)
    if run.work.turns == "all":  # the planner asks the respeller for each turn it follows
        run.planner = TurnPlanner(run.work, cache, run.tokenizer, respeller)
        advance_turns(run)
    else:
        respeller.take(it for it in run.work.items if it.cache_key not in index)
    for it in run.work.items:
        if it.cache_key not in index:
            run.todo.setdefault(it.cache_key, it)
    if respeller.taken:
        run.log(f"generate {run.dataset}: {respeller.taken} answer(s) cached under another spelling of the same "
                "settings (an integer written as a float, or the reverse: 1 and 1.0) or of the same endpoint "
                "(localhost and 127.0.0.1, the default port written or not) taken, not requested again")
    carry_answers(run)
    run.n_cached = sum(1 for it in run.work.items if it.cache_key in index)
    s = run.settings
    run.log(f"generate {run.dataset}: {len(run.work.prompts)} prompts, {len(run.work.items)} samples; {run.n_cached} "
            f"cached in {cache.path}, {len(run.todo)} to request ({s.backend}, model {s.api_model})")


async def check_served_model(run: Run) -> None:
    """SGLang: ask the server which model path it serves (noted in each new answer) and refuse cached
    answers of another this job would output (:mod:`eagledata.generate.servedmodel`)."""
    if run.settings.backend != "sglang":
        return
    assert run.cache is not None
    root = normalized_api_base(run.settings)
    run.served_model = await served_model_path(root, run.headers)
    if run.served_model is None:
        run.log(f"warning: the SGLang server at {root} did not say which model it serves (GET {MODEL_INFO_PATH}): "
                "the cached answers are not checked against it, and new answers do not record it")
        return
    check_cached_answers(run.served_model, run.cache, (it.cache_key for it in run.work.items), run.dataset,
                         run.settings.model_name, root)


def carry_answers(run: Run) -> None:
    """Take the answers other datasets' caches hold for samples to request
    (:mod:`eagledata.generate.carryover`; ``dedup`` datasets only) into this dataset's cache, and
    request only the rest. ``turns: all``: each carried turn may make the conversation's next turn
    known, so the conversations are followed again until nothing more is carried."""
    cache = run.cache
    assert cache is not None
    if not run.todo:
        return
    if not dataset_option(run.config, run.dataset, "dedup"):
        # its own answers, never carried; but it claims what it sends, so that a dedup dataset generated
        # at once waits for its answers and carries them over instead of paying again
        run.claims = RequestClaims(run.config["cache_dir"], run.dataset, run.log, waits=False)
        return
    run.claims = RequestClaims(run.config["cache_dir"], run.dataset, run.log)
    run.claims.watch()  # before the scans: what the other caches gain from now on is read as it comes
    while run.todo:
        got = carry_over(cache, list(run.todo), run.config["cache_dir"], run.dataset, run.log)
        for name, n in got.items():
            run.carried[name] = run.carried.get(name, 0) + n
            run.log(f"generate {run.dataset}: {n} answer(s) carried over from the cache of dataset {name!r} "
                    "(the same requests, paid once), not requested again")
        if cache.write_error is not None:
            cache.close()  # the answers not written are in the rescue file the next run imports first
            raise GenerationError(f"generate {run.dataset}: the answers carried over from other datasets' caches could "
                                  f"not be written to {cache.path} ({cache.write_error}); nothing was sent: free space "
                                  "on the cache's disk and rerun")
        if not got:
            break
        run.todo = {k: it for k, it in run.todo.items() if k not in cache.index}
        if run.planner is None:
            break
        advance_turns(run)


def advance_turns(run: Run) -> dict[str, WorkItem]:
    """``turns: all``: follow every conversation through the cache; the work's items become every
    turn known, and the turns to request next are returned (and added to ``run.todo``)."""
    assert run.planner is not None
    state = run.turn_state = run.planner.advance()
    run.work.items = state.items
    new = {k: it for k, it in state.todo.items() if k not in run.todo}
    run.todo.update(new)
    return new


def run_preflight(run: Run, output_path: str | Path) -> None:
    """:func:`eagledata.generate.preflight.preflight` of the samples to request (none: nothing to check)."""
    if not run.todo:
        return
    from eagledata.generate.preflight import preflight

    assert run.cache is not None
    checked = preflight(run.config, run.settings, run.work.prompts, run.todo.values(), run.cache.path, output_path,
                        run.tokenizer)
    run.tokenizer = checked.tokenizer
    run.log(checked.summary(run.dataset))


def start_simulator(run: Run) -> Any:
    """The stand-in on loopback for the simulator backend (when anything is requested); ``None`` otherwise."""
    if not run.todo or run.settings.backend != "simulator":
        return None
    from eagledata.standin.server import SimulatorServer

    s, sim = run.settings, run.config.get("simulator") or {}
    server = SimulatorServer(run.tokenizer, s.family, seed=int(sim.get("seed", 0)), profile=sim.get("provider", "exact"),
                             latency_ms=float(sim.get("latency_ms", 0)), latency_jitter_ms=float(sim.get("latency_jitter_ms", 0)),
                             paced_streams=bool(sim.get("paced_streams", False)), first_token_ms=sim.get("first_token_ms"),
                             price_per_mtok=s.model.get("price_per_mtok")).start()
    run.api_base = server.base_url
    run.work.url = run.api_base + "/chat/completions"
    return server


async def reconcile_at_start(run: Run, ledger: BudgetLedger) -> None:
    """Recover the reservations of dead processes; reconcile OpenRouter orphans; note the key's usage."""
    assert run.cache is not None
    rec = ledger.recover(run.dataset, run.cache.refs)
    if rec["dead"] or rec["recovered"]:
        run.log(f"budget ledger: {rec['dead']} reservation(s) of dead processes orphaned, {rec['recovered']} settled "
                "from the response cache")
    if run.settings.backend != "openrouter":
        return
    if ledger.orphans(run.dataset, with_generation_id=True):
        run.reconciled["start"] = await reconcile_generations(ledger, run.api_base, run.headers, run.dataset)
        run.log(f"budget ledger: orphaned reservations reconciled from /generation: {run.reconciled['start']}")
    if run.todo:
        usage = await key_usage(run.api_base, run.headers)
        if usage is not None:
            ledger.add_key_snapshot(run.api_base, usage)


def next_round(run: Run, job: GenerationJob) -> dict[str, WorkItem]:
    """``turns: all``: the next turns to request once a round finished cleanly (none: done, or the
    job stopped, was interrupted or has failures, which a rerun resumes)."""
    if run.planner is None or job.halted or job.failures:
        return {}
    new = advance_turns(run)
    if new:
        run.rounds += 1
        run.log(f"generate {run.dataset}: turn round {run.rounds}: {len(new)} request(s) (each conversation's next turn)")
    return new


def worst_cases(run: Run, price: Price, items: Mapping[str, WorkItem] | None = None) -> dict[str, float]:
    """Each sample's reservation: its prompt's token upper bound and ``max_tokens`` at ``price``
    (samples of one prompt share the estimate)."""
    estimator = PromptEstimator(run.tokenizer) if run.tokenizer is not None else load_estimator(run.config, run.settings)
    max_tokens = int(run.settings.generation.get("max_tokens", 4096))
    reserve: dict[str, float] = {}
    per_prompt: dict[tuple[str, int | None], int] = {}
    for key, it in (run.todo if items is None else items).items():
        # a later turn's prompt holds its own conversation's (sample's) replies: one estimate per conversation and turn
        pk = (it.conversation or it.prompt_id, it.turn)
        if pk not in per_prompt:
            req = it.chat_request
            per_prompt[pk] = estimator.count(req.get("messages"), req.get("tools"), req.get("reasoning"))[1]
        reserve[key] = price.cost(per_prompt[pk], max_tokens)
    zero = [k for k in ("prompt", "completion") if getattr(price, k) == 0]
    if zero and run.settings.backend == "openrouter" and run.config.get("budget_usd") is not None:
        run.log(f"warning: {run.dataset}: {price.source} has a {' and '.join(zero)} price of 0, so reservations leave "
                f"those tokens out and budget_usd is no hard cap: set the real prices")
    return reserve


async def run_requests(run: Run, ledger: BudgetLedger, progress_stream: Any) -> None:
    """Send every sample to request; afterwards the ledger session is closed and every answer
    received is durable (in the cache, or a rescue file the next run imports)."""
    s, cache = run.settings, run.cache
    assert cache is not None
    price = price_bound(s)
    reserve = worst_cases(run, price)
    cs = ClientSettings.from_generation(s.generation, run.work.url, s.backend, run.headers)
    session = LedgerSession(ledger, run.dataset, run.config.get("budget_usd"),
                            run.config["datasets"][run.dataset].get("budget_usd"),
                            {"backend": s.backend, "model": s.api_model,
                             "api_base": None if s.backend == "simulator" else run.api_base},
                            others_wait_s=others_wait_s(run.config))
    progress = Progress(f"generate {run.dataset}", len(run.todo), run.log, stream=progress_stream)
    cache.open()
    job = run.job = GenerationJob(run.work, list(run.todo.values()), cs, cache, session, progress, run.log, reserve, price)
    job.served_model = run.served_model
    if run.claims is not None:  # the start's carry-over looked for these keys already
        job.claims = run.claims
        run.claims.want(run.todo, scanned=True)
    cache.on_write_error = lambda what: job.write_failed(f"cache write failed: {what}")
    session.on_error = lambda exc: job.write_failed(ledger_write_error(ledger.path, exc))
    t_run, c_run = time.monotonic(), time.process_time()
    try:
        await job.run()
        while (new := next_round(run, job)):
            if run.claims is not None:
                run.claims.want(new)
            reserve.update(worst_cases(run, price, new))
            progress.total += len(new)
            job.items = list(new.values())
            await job.run()
    finally:
        job.run_s, job.run_cpu_s = time.monotonic() - t_run, time.process_time() - c_run
        try:
            await session.close()
        except LEDGER_WRITE_ERRORS as exc:
            job.write_failed(ledger_write_error(ledger.path, exc))
        saved = await keep_paid_answers(cache, answer_wait_s(cs, t_run), run.log)
        if saved:
            job.stop_reason = f"{job.stop_reason}; {saved}" if job.stop_reason else saved
        if progress.done != progress.total:
            progress.update(force=True)
        progress.close()
    if job.over_reservation:
        run.log(f"warning: {job.over_reservation} response(s) cost more than their reserved worst case: "
                f"{price.source} is below the real price; raise it so the budget stays a hard cap")
    if job.unpriced:
        run.log(f"warning: {job.unpriced} answer(s) reported neither a cost nor token counts (no usage): each "
                "was held at its worst case until reconciled by its generation id (what is left: "
                "eagledata budget --reconcile)")


def others_wait_s(config: Mapping[str, Any]) -> float:
    """How long a request waits on other jobs' reservations only before it calls the oldest stale:
    :data:`~eagledata.generate.budget.OTHERS_WAIT_S`, or twice the longest attempt timeout of the
    config's datasets (a live request of any of them settles within that)."""
    longest = max((attempt_timeout_s(dataset_generation(config, d)) for d in config["datasets"]), default=600.0)
    return max(OTHERS_WAIT_S, 2 * longest + 60)


def answer_wait_s(cs: ClientSettings, t_run: float) -> float:
    """How long kept answers wait for space: what is left of the job timeout, else ``drain_timeout_s``."""
    if cs.job_timeout_s is not None:
        return max(0.0, cs.job_timeout_s - (time.monotonic() - t_run))
    return cs.drain_timeout_s


async def request_missing(run: Run, progress_stream: Any) -> None:
    """Steps 4 and 5 (ledger and requests) for the samples not cached; the cache, the stand-in and
    the ledger are closed whatever happens, and the ledger's totals for the dataset kept."""
    assert run.cache is not None
    ledger = BudgetLedger(ledger_path(run.config["cache_dir"]))
    server = None
    try:
        await reconcile_at_start(run, ledger)
        server = start_simulator(run)
        if run.todo:
            await run_requests(run, ledger, progress_stream)
            if run.settings.backend in ("openrouter", "simulator") and ledger.orphans(run.dataset, with_generation_id=True):
                run.reconciled["end"] = await reconcile_generations(ledger, run.api_base, run.headers, run.dataset,
                                                                    timeout=5.0)
    finally:
        if run.claims is not None:
            run.claims.close()
            note_carried_while_running(run)
        try:
            run.cache.close()
        finally:
            if server is not None:
                server.stop()
            run.totals = ledger.totals().get(account(run.dataset, run.settings.backend), run.totals)
            ledger.close()


def note_carried_while_running(run: Run) -> None:
    """Count (and log) the answers carried over while the job ran: requests another dataset's job
    was sending (claimed) or had answered since this job started."""
    assert run.claims is not None
    for name, n in run.claims.carried.items():
        run.carried[name] = run.carried.get(name, 0) + n
        run.log(f"generate {run.dataset}: {n} answer(s) received meanwhile by the job of dataset {name!r} (the same "
                "requests) carried over, not requested again")
    if run.claims.waited:
        run.log(f"generate {run.dataset}: {run.claims.waited} request(s) waited while another dataset's job sent them")


def summarize(run: Run, output_path: str | Path, elapsed: float) -> dict[str, Any]:
    """The job's summary (``generation_summary.json``)."""
    job, s = run.job, run.settings
    # the samples this job had to answer itself: not those another dataset's job answered meanwhile
    n_todo = len(run.todo) - (sum(run.claims.carried.values()) if run.claims is not None else 0)
    assert run.cache is not None
    summary: dict[str, Any] = {"dataset": run.dataset, "backend": s.backend, "model": s.api_model,
                               "samples": len(run.work.items), "cached": run.n_cached, "requested": n_todo,
                               "carried_over": dict(run.carried),
                               "respelled": run.respeller.taken if run.respeller else 0}
    summary.update({
        "http_requests": job.http_requests if job else 0, "ok": job.progress.ok if job else 0,
        "errors": ([{**e, "final": True} for e in job.final_errors]
                   + [{"id": k, "error": v, "final": False} for k, v in job.failures.items()]) if job else [],
        "cost_usd": round(job.cost, 6) if job else 0.0,
        # answers that reported no cost nor token counts: held in the ledger until reconciled
        "unpriced": job.unpriced if job else 0,
        "prompt_tokens": job.prompt_tokens if job else 0, "completion_tokens": job.completion_tokens if job else 0,
        "ledger": {"spent_usd": round(run.totals["spent"], 6) + 0.0, "held_usd": round(run.totals["held"], 6) + 0.0,
                   "reconciled": run.reconciled},
        "elapsed_s": round(elapsed, 3), "request_phase_s": round(job.run_s, 3) if job else 0.0,
        "request_phase_cpu_s": round(job.run_cpu_s, 3) if job else 0.0,
        "samples_per_s": round(n_todo / elapsed, 2) if n_todo else None,
        "completion_tokens_per_s": round(job.completion_tokens / elapsed, 1) if job else None,
        "stopped": (job.stop_reason or job.interrupt) if job else None,
        "output": str(output_path), "cache": str(run.cache.path)})
    summary["dedup"] = {"enabled": bool(dataset_option(run.config, run.dataset, "dedup")),
                        "dropped": [d.to_dict() for d in run.work.duplicates]}
    if run.turn_state is not None:
        summary["dedup"]["shared_turns"] = sorted(shared_turns(run))
        summary["turns"] = "all"
        summary["conversations"] = conversation_summary(run.turn_state, run.log, run.dataset)
    return summary


def raise_if_unfinished(run: Run) -> None:
    """:class:`Interrupted`, :class:`JobStopped` or :class:`GenerationError` (prompts still
    failing) when the job did not finish every sample."""
    job, cache, dataset = run.job, run.cache, run.dataset
    if job is None:
        return
    assert cache is not None
    # this dataset's samples answered (the cache may hold more: answers to requests since changed)
    cached = f"{sum(1 for it in run.work.items if it.cache_key in cache.index)} of its {len(run.work.items)} samples"
    if job.interrupt is not None:
        raise Interrupted(f"generate {dataset} interrupted ({job.interrupt}): {len(job.finished)} response(s) received "
                          f"this run; {cached} cached in {cache.path} (consistent); a rerun requests only "
                          "the rest.", job.signum)
    if job.stop_reason is not None:
        raise JobStopped(f"generate {dataset} stopped: {job.stop_reason}. {cached} are cached in "
                         f"{cache.path} and will not be requested again; fix the cause and rerun.")
    if job.failures:
        shown = "\n".join(f"  {i}: {p}" for i, p in list(job.failures.items())[:20])
        more = f"\n  ... and {len(job.failures) - 20} more" if len(job.failures) > 20 else ""
        raise GenerationError(f"generate {dataset}: {len(job.failures)} request(s) still failing after "
                              f"{run.settings.generation.get('max_attempts')} attempts (finished ones are cached in "
                              f"{cache.path}; a rerun requests only the failing ones):\n{shown}{more}")


def output_record(rec: dict[str, Any], item: WorkItem) -> dict[str, Any]:
    """A cached record as this run's output record: ids from the current prompt file."""
    rec.update(id=item.id, prompt_id=item.prompt_id, sample_index=item.sample_index, conversation=item.conversation,
               turn=item.turn)
    out = {k: rec.get(k) for k in RECORD_FIELDS}
    out.update({k: rec[k] for k in OPTIONAL_FIELDS if rec.get(k) is not None})
    return out


def shared_turns(run: Run) -> set[str]:
    """With ``turns: all`` and dedup on, the turns (item ids) whose request an earlier turn of the
    dataset sent already (conversations sharing their opening, or differing only in replies never
    sent): paid once, and output once, not trained on once per conversation."""
    if run.turn_state is None or not dataset_option(run.config, run.dataset, "dedup"):
        return set()
    seen: set[str] = set()
    shared = set()
    for it in run.work.items:
        if it.cache_key in seen:
            shared.add(it.id)
        seen.add(it.cache_key)
    return shared


def write_output(run: Run, output_path: str | Path) -> tuple[int, list[str]]:
    """``results/{dataset}/responses.jsonl`` from the cache, in prompt-file order (each turn an
    earlier one shares left out: :func:`shared_turns`), atomically; returns the count and the ids
    answered with a final HTTP error."""
    cache, shared = run.cache, shared_turns(run)
    items = [it for it in run.work.items if it.id not in shared]
    assert cache is not None
    error_ids: list[str] = []

    def records() -> Iterator[dict[str, Any]]:
        if not items:
            return
        with open(cache.path, "rb") as fh:
            for it in items:
                out = output_record(cache.get(it.cache_key, fh), it)
                if out.get("status") != 200:
                    error_ids.append(it.id)
                yield out

    return write_jsonl_atomic(output_path, records()), error_ids


def write_summary_beside_cache(run: Run, summary: Mapping[str, Any]) -> None:
    """``{cache_dir}/{dataset}/generation_summary.json`` (a warning when the disk refuses it)."""
    try:
        atomic_write_json(Path(run.config["cache_dir"]) / run.dataset / "generation_summary.json", summary, indent=1)
    except OSError as exc:
        run.log(f"warning: generation summary not written beside the cache ({exc.strerror or exc}; "
                f"{free_space(run.config['cache_dir'])})")


async def generate_dataset_async(config: Mapping[str, Any], dataset: str, output_path: str | Path,
                                 log: Log = stderr_log, summary_path: str | Path | None = None,
                                 progress_stream: Any = None) -> dict[str, Any]:
    """See :func:`generate_dataset`. The dataset's cache lock, taken before the cache is read, is
    held until the job ends."""
    t_start = time.monotonic()
    log = never_failing(log)
    run = prepare(config, dataset, log)
    lock = await take_cache_lock(run.config, dataset, log)
    try:
        open_cache(run)
        await check_served_model(run)
        run_preflight(run, output_path)  # before the ledger is opened and the first request is sent
        await request_missing(run, progress_stream)
        elapsed = time.monotonic() - t_start
        summary = summarize(run, output_path, elapsed)
        write_summary_beside_cache(run, summary)
        raise_if_unfinished(run)
        check_prompts_unchanged(run, "while the job ran")
        n_written, error_ids = write_output(run, output_path)
    finally:
        lock.release()
    summary.update(samples=n_written, final_errors=len(error_ids), final_error_ids=error_ids)
    if summary_path is not None:
        Path(summary_path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(summary_path, summary, indent=1)
    if error_ids:
        log(f"warning: {len(error_ids)} sample(s) answered with a final (non-retryable) HTTP error, kept in the "
            f"output with status and body: {', '.join(error_ids[:10])}{' ...' if len(error_ids) > 10 else ''}")
    log(f"generate {dataset}: wrote {n_written} records to {output_path} ({len(run.todo)} requested, "
        f"{summary['http_requests']} HTTP requests, ${summary['cost_usd']:.4f}, {elapsed:.1f} s)")
    return summary


def generate_dataset(config: Mapping[str, Any], dataset: str, output_path: str | Path, log: Log = stderr_log,
                     summary_path: str | Path | None = None, progress_stream: Any = None) -> dict[str, Any]:
    """Generate ``results/{dataset}/responses.jsonl`` for a prompts dataset; returns a summary
    (also written to ``summary_path`` and to ``{cache_dir}/{dataset}/generation_summary.json``).

    Backends: ``simulator`` (starts a :class:`~eagledata.standin.server.SimulatorServer` on loopback
    with the dataset's model tokenizer and stops it at the end), ``openrouter`` (``api_base``, key
    from ``OPENROUTER_API_KEY``), ``sglang`` (``api_base`` = the SGLang server). Raises
    :class:`GenerationError` when some sample still fails after ``max_attempts`` (after the cache
    is written, so a rerun retries only those), :class:`JobStopped` on 401/402/budget and
    :class:`Interrupted` on SIGINT/SIGTERM/job timeout.
    """
    kind = dataset_generation(config, dataset).get("event_loop", "auto")
    try:
        uvloop_module(kind)
    except ImportError as exc:
        raise GenerationError(str(exc)) from None
    return run_event_loop(generate_dataset_async(config, dataset, output_path, log, summary_path, progress_stream), kind)


def main(argv: list[str] | None = None) -> int:
    """``python -m eagledata.generate.job --config C --dataset D --output O``: the generate entry
    outside Snakemake (same code path as the rule). Exit status 0, 1 (an error, message on
    stderr) or 128 + signal (interrupted)."""
    from eagledata.config import load_config
    from eagledata.errors import EagledataError

    ap = argparse.ArgumentParser(prog="python -m eagledata.generate.job", description="generate one dataset's responses")
    ap.add_argument("--config", default="config/config.yaml")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--summary")
    args = ap.parse_args(argv)
    try:
        config = load_config(args.config)
        generate_dataset(config, args.dataset, args.output, summary_path=args.summary)
    except Interrupted as exc:
        print(f"eagledata generate: {exc}", file=sys.stderr)
        return exc.exit_code
    except EagledataError as exc:
        print(f"eagledata generate: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # run the importable module's main, so errors raised by other modules (eagledata.generate.preflight's,
    # subclasses of eagledata.generate.errors.GenerationError) are the classes main catches, not __main__'s
    from eagledata.generate.job import main as _main

    sys.exit(_main())

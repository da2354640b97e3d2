"""Generation: prompts -> exact response bodies, through OpenRouter or the local simulator.

:func:`generate_dataset` (the ``generate`` rule's entry) sends one chat-completions request per
sample with an async httpx client: bounded concurrency (``generation.concurrency`` workers),
retries with exponential backoff and jitter on 408/429/5xx, timeouts, transport errors and on
errors reported inside 200 bodies or streams (``eagledata.responses.parse_response``), honouring
``Retry-After``. Other 4xx answers are final: recorded (status and body) and not retried. 401 (bad
key) and 402 (no credits) stop the whole job; so does ``budget_usd`` being spent.

Resumability. Every finished request (success or final error) is appended to
``{cache_dir}/{dataset}/responses.jsonl`` at once (flush + fsync); this file is deliberately not a
Snakemake output, so a failed or killed job never loses paid responses. Entries are keyed by
:func:`cache_key`, the sha256 of the canonical JSON of the exact request body (plus the sample
number for samples after the first, and the simulator's identity for the simulator backend), so a
rerun requests only what is missing and any change of an output-shaping setting requests anew. A
torn last line (crash mid-write) is ignored and cut off. The rule output is then written
atomically, in prompt-file order.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from .config import DatasetSettings, dataset_settings, load_model_tokenizer, validate_config
from .prompts import Prompt, canonical_json, read_prompts, sha256_hex
from .responses import parse_response

Log = Callable[[str], None]

API_KEY_ENV = "OPENROUTER_API_KEY"
#: Generation settings that shape the responses (the rest only shape how they are fetched).
OUTPUT_SETTINGS = ("max_tokens", "temperature", "top_p", "seed", "reasoning", "provider", "stream",
                   "samples_per_prompt")
#: Fields of every record of ``results/{dataset}/responses.jsonl``.
RECORD_FIELDS = ("id", "prompt_id", "sample_index", "request", "status", "response_raw", "url", "cache_key",
                 "backend", "started_at", "elapsed_s", "attempts")
FINAL_STATUSES_FATAL = {401: "the API key was rejected (401): check OPENROUTER_API_KEY",
                        402: "OpenRouter answered 402 Payment Required (insufficient credits)"}


class GenerationError(RuntimeError):
    """The generation job cannot finish; the message says what to do. The cache is kept."""


class JobStopped(GenerationError):
    """A condition that stops every request (401, 402, budget)."""


def _stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Requests and keys


def build_request(prompt: Prompt, settings: DatasetSettings, sample_index: int = 0) -> dict[str, Any]:
    """The exact request body for one sample. Optional settings are sent only when not null; with
    a ``seed``, sample ``k`` uses ``seed + k``."""
    g = settings.generation
    body: dict[str, Any] = {"model": settings.api_model, "messages": prompt.messages}
    if prompt.tools:
        body["tools"] = prompt.tools
    body["max_tokens"] = g.get("max_tokens", 4096)
    for key in ("temperature", "top_p"):
        if g.get(key) is not None:
            body[key] = g[key]
    if g.get("seed") is not None:
        body["seed"] = int(g["seed"]) + sample_index
    for key in ("reasoning", "provider"):
        if g.get(key) is not None:
            body[key] = g[key]
    body["stream"] = bool(g.get("stream", False))
    body["usage"] = {"include": True}
    return body


def cache_key(body: Mapping[str, Any], sample_index: int = 0, salt: Mapping[str, Any] | None = None) -> str:
    """sha256 of the canonical JSON of ``body``; samples after the first and a backend ``salt``
    (the simulator's seed, profile and tokenizer) are appended, since they change the answer to
    an identical body."""
    text = canonical_json(body)
    extra = {k: v for k, v in (("sample", sample_index or None), ("salt", salt or None)) if v is not None}
    if extra:
        text += "\n" + canonical_json(extra)
    return sha256_hex(text)


def simulator_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    sim = dict(config.get("simulator") or {})
    return {"seed": sim.get("seed", 0), "provider": sim.get("provider", "exact")}


def request_params(settings: DatasetSettings, config: Mapping[str, Any]) -> dict[str, Any]:
    """The output-shaping settings of a dataset (the ``generate`` rule's ``params``): changing one
    reruns the rule, and the cache makes that rerun request only what changed. Concurrency,
    timeouts and retry settings are left out on purpose."""
    params: dict[str, Any] = {"backend": settings.backend, "model": settings.api_model}
    params.update({k: settings.generation.get(k) for k in OUTPUT_SETTINGS})
    if settings.backend == "simulator":
        params["simulator"] = simulator_settings(config)
        params["price_per_mtok"] = dict(settings.model.get("price_per_mtok") or {})
    return params


class GenerateRuleInputs:
    """The named input and params functions of ``rules/generate.smk``, bound to the workflow's
    config (kept here because ``snakemake --lint`` wants no functions beside rules)."""

    def __init__(self, config: Mapping[str, Any], tokenizer_input: Callable[[Any], Any]):
        self.config = config
        self.tokenizer_input = tokenizer_input

    def settings(self, wildcards: Any) -> DatasetSettings:
        return dataset_settings(self.config, wildcards.dataset)

    def prompts(self, wildcards: Any) -> str:
        return self.settings(wildcards).prompts

    def tokenizer(self, wildcards: Any) -> Any:
        """The simulator answers with the model's tokenizer, so its files shape the responses."""
        return self.tokenizer_input(wildcards) if self.settings(wildcards).backend == "simulator" else []

    def request(self, wildcards: Any) -> dict[str, Any]:
        """Output-shaping settings (see :func:`request_params`)."""
        return request_params(self.settings(wildcards), self.config)

    def imported(self, wildcards: Any) -> str:
        return self.settings(wildcards).responses


@dataclass(frozen=True)
class WorkItem:
    id: str
    prompt_id: str
    sample_index: int
    request: dict[str, Any]
    cache_key: str


def work_items(prompts: Iterable[Prompt], settings: DatasetSettings, salt: Mapping[str, Any] | None = None) -> list[WorkItem]:
    n = int(settings.generation.get("samples_per_prompt", 1))
    items = []
    for p in prompts:
        for k in range(n):
            body = build_request(p, settings, k)
            items.append(WorkItem(p.id if n == 1 else f"{p.id}#{k}", p.id, k, body, cache_key(body, k, salt)))
    return items


# ----------------------------------------------------------------------------------------------
# Cache


class ResponseCache:
    """Append-only JSONL of finished requests, indexed by ``cache_key`` (byte offsets, so records
    are read back only when the output is written)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.index: dict[str, tuple[int, int]] = {}
        self.skipped_lines = 0
        self._fh = None

    def load(self) -> dict[str, tuple[int, int]]:
        self.index.clear()
        if not self.path.exists():
            return self.index
        offset = 0
        with open(self.path, "rb") as fh:
            for line in fh:
                if line.endswith(b"\n"):
                    try:
                        key = json.loads(line)["cache_key"]
                        self.index[key] = (offset, len(line))
                    except (ValueError, KeyError, TypeError):
                        self.skipped_lines += 1
                offset += len(line)  # a last line without newline is a torn write: ignored
        return self.index

    def open(self) -> None:
        """Open for appending, first cutting off a torn last line (so the next record starts on a
        line of its own)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "ab")
        size = self._fh.seek(0, os.SEEK_END)
        keep = size
        with open(self.path, "rb") as r:
            while keep > 0:  # scan back to the last newline
                start = max(0, keep - 65536)
                r.seek(start)
                block = r.read(keep - start)
                nl = block.rfind(b"\n")
                if nl >= 0:
                    keep = start + nl + 1
                    break
                keep = start
        if keep != size:
            self._fh.truncate(keep)
            self._fh.seek(0, os.SEEK_END)

    def append(self, record: Mapping[str, Any]) -> None:
        if self._fh is None:
            self.open()
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        offset = self._fh.tell()
        self._fh.write(line)
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.index[record["cache_key"]] = (offset, len(line))

    def get(self, key: str, fh: Any = None) -> dict[str, Any]:
        """The record of ``key``; pass an open binary ``fh`` of the cache to read many."""
        offset, length = self.index[key]
        if fh is None:
            with open(self.path, "rb") as own:
                return self.get(key, own)
        fh.seek(offset)
        return json.loads(fh.read(length))

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def write_jsonl_atomic(path: str | Path, records: Iterable[Mapping[str, Any]]) -> int:
    """Write records to ``path`` via a temporary file and ``os.replace``; returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    n = 0
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as fh:
            for rec in records:
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
                n += 1
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return n


# ----------------------------------------------------------------------------------------------
# HTTP


@dataclass(frozen=True)
class ClientSettings:
    url: str
    backend: str
    headers: Mapping[str, str]
    concurrency: int
    max_attempts: int
    timeout_s: float
    backoff_base_s: float
    backoff_max_s: float

    @classmethod
    def from_generation(cls, g: Mapping[str, Any], api_base: str, backend: str, headers: Mapping[str, str]) -> "ClientSettings":
        return cls(api_base.rstrip("/") + "/chat/completions", backend, dict(headers), int(g.get("concurrency", 16)),
                   int(g.get("max_attempts", 6)), float(g.get("timeout_s", 600)), float(g.get("backoff_base_s", 1.0)),
                   float(g.get("backoff_max_s", 60.0)))


def retry_after_seconds(value: str | None) -> float | None:
    """``Retry-After`` as seconds (delta-seconds or an HTTP date); ``None`` when absent/unusable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def backoff_delay(attempt: int, base: float, cap: float, retry_after: float | None = None) -> float:
    """Exponential backoff with jitter (50-100 % of ``base * 2**(attempt-1)``, capped); a
    ``Retry-After`` is honoured as a lower bound."""
    delay = min(cap, base * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
    if retry_after is not None:
        delay = max(delay, retry_after * random.uniform(1.0, 1.1))
    return delay


def _retryable_status(status: int) -> bool:
    return status in (408, 429) or status >= 500


async def _post(client, cs: ClientSettings, body: Mapping[str, Any]) -> tuple[int, str, float | None]:
    data = json.dumps(body, ensure_ascii=False).encode("utf-8")
    async with client.stream("POST", cs.url, content=data, headers=cs.headers) as resp:
        raw = b"".join([chunk async for chunk in resp.aiter_bytes()])
        return resp.status_code, raw.decode("utf-8", errors="replace"), retry_after_seconds(resp.headers.get("retry-after"))


class RateGate:
    """Shared pause after a 429 with ``Retry-After``: the limit is per key, so every worker waits,
    not only the one that was told."""

    def __init__(self) -> None:
        self.until = 0.0

    def hold(self, seconds: float) -> None:
        self.until = max(self.until, time.monotonic() + seconds)

    async def wait(self) -> None:
        while (delay := self.until - time.monotonic()) > 0:
            await asyncio.sleep(delay)


@dataclass
class ItemResult:
    record: dict[str, Any] | None  # finished: success or final error
    problem: str | None = None  # last problem of a request that never finished
    cost: float = 0.0
    attempts: int = 0


async def request_with_retries(client, cs: ClientSettings, item: WorkItem, log: Log,
                               gate: RateGate | None = None) -> ItemResult:
    """Send one sample until it succeeds, fails for good, or ``max_attempts`` is spent."""
    import httpx

    gate = gate or RateGate()
    started = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
    t0 = time.monotonic()
    problem = ""
    for attempt in range(1, cs.max_attempts + 1):
        retry_after = None
        await gate.wait()
        try:
            status, text, retry_after = await asyncio.wait_for(_post(client, cs, item.request), cs.timeout_s)
        except (httpx.TimeoutException, asyncio.TimeoutError):
            problem = f"timeout after {cs.timeout_s:g} s"
        except httpx.TransportError as exc:
            problem = f"transport error ({type(exc).__name__}: {exc})"
        else:
            def record() -> dict[str, Any]:
                return {"id": item.id, "prompt_id": item.prompt_id, "sample_index": item.sample_index,
                        "request": item.request, "status": status, "response_raw": text, "url": cs.url,
                        "cache_key": item.cache_key, "backend": cs.backend, "started_at": started,
                        "elapsed_s": round(time.monotonic() - t0, 3), "attempts": attempt}

            if status in FINAL_STATUSES_FATAL:
                detail = parse_response(text, status).error
                raise JobStopped(f"{FINAL_STATUSES_FATAL[status]} on {item.id}: {detail.message if detail else text[:200]}")
            if status == 200:
                parsed = parse_response(text, status)
                if parsed.ok:
                    return ItemResult(record(), cost=parsed.cost or 0.0, attempts=attempt)
                err = parsed.error
                problem = f"error in 200 {'stream' if parsed.streamed else 'body'} ({err.where}, code {err.code}: {err.message})"
            elif _retryable_status(status):
                if status == 429 and retry_after:
                    gate.hold(retry_after)
                err = parse_response(text, status).error
                problem = f"HTTP {status}" + (f": {err.message}" if err and err.message != f"HTTP {status}" else "")
            else:
                log(f"{item.id}: HTTP {status} is final (not retried): {text.strip()[:300]}")
                return ItemResult(record(), attempts=attempt)
        if attempt < cs.max_attempts:
            delay = backoff_delay(attempt, cs.backoff_base_s, cs.backoff_max_s, retry_after)
            log(f"{item.id}: attempt {attempt}/{cs.max_attempts} failed: {problem}; retrying in {delay:.2f} s")
            await asyncio.sleep(delay)
    return ItemResult(None, problem, attempts=cs.max_attempts)


@dataclass
class RunStats:
    total: int
    done: int = 0
    ok: int = 0
    final_errors: int = 0
    http_requests: int = 0
    cost: float = 0.0
    started: float = 0.0
    last_log: float = 0.0


async def run_requests(items: list[WorkItem], cs: ClientSettings, cache: ResponseCache, log: Log,
                       budget_usd: float | None = None) -> tuple[RunStats, dict[str, str]]:
    """Send ``items`` with ``cs.concurrency`` workers, appending every finished one to ``cache``.
    Returns the stats and ``{item id: problem}`` for the items that never finished. Raises
    :class:`JobStopped` (after cancelling in-flight requests) on 401/402 or a spent budget."""
    import httpx

    stats = RunStats(total=len(items), started=time.monotonic(), last_log=time.monotonic())
    failures: dict[str, str] = {}
    pending = iter(items)
    stop: list[str] = []
    gate = RateGate()
    limits = httpx.Limits(max_connections=cs.concurrency, max_keepalive_connections=cs.concurrency)
    timeout = httpx.Timeout(cs.timeout_s, connect=min(30.0, cs.timeout_s))

    async def worker(client) -> None:
        for item in pending:
            if stop:
                return
            if budget_usd is not None and stats.cost >= budget_usd:
                stop.append(f"budget_usd {budget_usd:g} spent (${stats.cost:.4f} in this run)")
                return
            result = await request_with_retries(client, cs, item, log, gate)
            stats.http_requests += result.attempts
            stats.done += 1
            if result.record is None:
                failures[item.id] = result.problem or "unknown"
            else:
                cache.append(result.record)
                stats.cost += result.cost
                if result.record["status"] == 200:
                    stats.ok += 1
                else:
                    stats.final_errors += 1
            _progress(stats, log)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        tasks = [asyncio.create_task(worker(client)) for _ in range(max(1, min(cs.concurrency, len(items))))]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
    if stop:
        raise JobStopped(stop[0])
    return stats, failures


def _progress(stats: RunStats, log: Log, every_s: float = 15.0) -> None:
    now = time.monotonic()
    step = max(1, stats.total // 10)
    if stats.done == stats.total or stats.done % step == 0 or now - stats.last_log >= every_s:
        stats.last_log = now
        rate = stats.done / max(now - stats.started, 1e-9)
        log(f"  {stats.done}/{stats.total} done ({stats.ok} ok, {stats.final_errors} final errors), "
            f"{rate:.1f} samples/s, ${stats.cost:.4f}")


# ----------------------------------------------------------------------------------------------
# Entry points


async def generate_dataset_async(config: Mapping[str, Any], dataset: str, output_path: str | Path,
                                 log: Log = _stderr_log) -> dict[str, Any]:
    """See :func:`generate_dataset`."""
    t_start = time.monotonic()
    config = validate_config(copy.deepcopy(dict(config)))
    s = dataset_settings(config, dataset)
    if s.imported or not s.prompts:
        raise GenerationError(f"dataset {dataset!r} has 'responses:' (imported); it is not generated")
    if s.backend == "sglang":
        raise NotImplementedError("backend 'sglang' is not implemented yet (issue 4); use openrouter or simulator")
    prompts = read_prompts(s.prompts)
    g = s.generation
    server = None
    salt = None
    headers = {"Content-Type": "application/json", "X-Title": "eagledata"}
    if s.backend == "simulator":
        tokenizer = load_model_tokenizer(config, s.model_name)
        sim = simulator_settings(config)
        salt = {"simulator": {**sim, "tokenizer": tokenizer.fingerprint,
                              "price_per_mtok": dict(s.model.get("price_per_mtok") or {})}}
    elif s.backend == "openrouter":
        key = os.environ.get(API_KEY_ENV)
        if not key:
            raise GenerationError(f"dataset {dataset!r} uses backend openrouter: set {API_KEY_ENV} in the environment")
        headers["Authorization"] = f"Bearer {key}"
    else:
        raise GenerationError(f"dataset {dataset!r}: unknown backend {s.backend!r}")

    items = work_items(prompts, s, salt)
    cache = ResponseCache(Path(config["cache_dir"]) / dataset / "responses.jsonl")
    index = cache.load()
    if cache.skipped_lines:
        log(f"warning: {cache.path}: {cache.skipped_lines} unreadable line(s) ignored (those requests are sent again)")
    todo: dict[str, WorkItem] = {}
    for it in items:
        if it.cache_key not in index:
            todo.setdefault(it.cache_key, it)
    n_cached = sum(1 for it in items if it.cache_key in index)
    log(f"generate {dataset}: {len(prompts)} prompts, {len(items)} samples; {n_cached} cached in {cache.path}, "
        f"{len(todo)} to request ({s.backend}, model {s.api_model})")

    stats, failures = RunStats(total=0), {}
    try:
        if todo:
            api_base = g.get("api_base") or "https://openrouter.ai/api/v1"
            if s.backend == "simulator":
                from .simulator import SimulatorServer

                sim = config.get("simulator") or {}
                server = SimulatorServer(tokenizer, s.family, seed=int(sim.get("seed", 0)),
                                         profile=sim.get("provider", "exact"), latency_ms=float(sim.get("latency_ms", 0)),
                                         price_per_mtok=s.model.get("price_per_mtok")).start()
                api_base = server.base_url
            cs = ClientSettings.from_generation(g, api_base, s.backend, headers)
            cache.open()
            try:
                stats, failures = await run_requests(list(todo.values()), cs, cache, log, config.get("budget_usd"))
            except JobStopped as exc:
                raise JobStopped(f"generate {dataset} stopped: {exc}. {len(cache.index)} responses are cached in "
                                 f"{cache.path} and will not be requested again; fix the cause and rerun.") from None
    finally:
        cache.close()
        if server is not None:
            server.stop()

    if failures:
        shown = "\n".join(f"  {i}: {p}" for i, p in list(failures.items())[:20])
        more = f"\n  ... and {len(failures) - 20} more" if len(failures) > 20 else ""
        raise GenerationError(f"generate {dataset}: {len(failures)} request(s) still failing after "
                              f"{g.get('max_attempts')} attempts (finished ones are cached in {cache.path}; "
                              f"a rerun requests only the failing ones):\n{shown}{more}")

    error_ids: list[str] = []

    def records() -> Iterator[dict[str, Any]]:
        if not items:
            return
        with open(cache.path, "rb") as fh:
            for it in items:
                yield _output_record(cache.get(it.cache_key, fh), it, error_ids)

    n_written = write_jsonl_atomic(output_path, records())
    elapsed = time.monotonic() - t_start
    summary = {"dataset": dataset, "backend": s.backend, "samples": n_written, "cached": n_cached,
               "requested": len(todo), "http_requests": stats.http_requests, "ok": stats.ok,
               "final_errors": len(error_ids), "cost_usd": round(stats.cost, 6), "elapsed_s": round(elapsed, 3),
               "samples_per_s": round(len(todo) / elapsed, 2) if todo else None, "output": str(output_path),
               "cache": str(cache.path)}
    if error_ids:
        log(f"warning: {len(error_ids)} sample(s) answered with a final (non-retryable) HTTP error, kept in the "
            f"output with status and body: {', '.join(error_ids[:10])}{' ...' if len(error_ids) > 10 else ''}")
    log(f"generate {dataset}: wrote {n_written} records to {output_path} "
        f"({len(todo)} requested, {stats.http_requests} HTTP requests, ${stats.cost:.4f}, {elapsed:.1f} s)")
    return summary


def _output_record(rec: dict[str, Any], item: WorkItem, error_ids: list[str]) -> dict[str, Any]:
    """A cached record as this run's output record: ids from the current prompt file."""
    rec.update(id=item.id, prompt_id=item.prompt_id, sample_index=item.sample_index)
    if rec.get("status") != 200:
        error_ids.append(item.id)
    return {k: rec.get(k) for k in RECORD_FIELDS}


def generate_dataset(config: Mapping[str, Any], dataset: str, output_path: str | Path,
                     log: Log = _stderr_log) -> dict[str, Any]:
    """Generate ``results/{dataset}/responses.jsonl`` for a prompts dataset; returns a summary.

    Backends: ``simulator`` (starts a :class:`~eagledata.simulator.SimulatorServer` on loopback
    with the dataset's model tokenizer and stops it at the end), ``openrouter`` (``api_base``, key
    from ``OPENROUTER_API_KEY``), ``sglang`` (not implemented yet). Raises
    :class:`GenerationError` when some sample still fails after ``max_attempts`` (after the cache
    is written, so a rerun retries only those), and :class:`JobStopped` on 401/402/budget.
    """
    return asyncio.run(generate_dataset_async(config, dataset, output_path, log))


# ----------------------------------------------------------------------------------------------
# Import of existing responses


class ResponsesFileError(ValueError):
    """An imported responses line is unusable; the message starts with ``file:line:field``."""


def read_response_records(path: str | Path, dataset: str) -> Iterator[dict[str, Any]]:
    """Validate a responses file in the recorded format (``request``, ``status``,
    ``response_raw``; ``id`` optional, default ``<dataset>-<line:06d>``) and yield output records.
    Extra fields (``source``, ``recorded``, ...) are kept."""
    path = Path(path)
    seen: dict[str, int] = {}
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise ResponsesFileError(f"{path}: cannot read responses file: {exc.strerror or exc}") from None
    with fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ResponsesFileError(f"{where}:(line): not valid UTF-8 ({exc.reason})") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ResponsesFileError(f"{where}:(json): invalid JSON: {exc.msg} at column {exc.colno}") from None
            if not isinstance(rec, dict):
                raise ResponsesFileError(f"{where}: a line must be a JSON object")
            req = rec.get("request")
            if not isinstance(req, dict):
                raise ResponsesFileError(f"{where}:request: missing or not an object")
            if not isinstance(req.get("messages"), list) or not req["messages"]:
                raise ResponsesFileError(f"{where}:request.messages: missing or not a non-empty list")
            status = rec.get("status")
            if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
                raise ResponsesFileError(f"{where}:status: must be an HTTP status code, got {status!r}")
            if not isinstance(rec.get("response_raw"), str):
                raise ResponsesFileError(f"{where}:response_raw: missing or not a string (the exact body received)")
            rid = rec.get("id")
            if rid is None:
                rid = f"{dataset}-{lineno:06d}"
            elif isinstance(rid, bool) or not isinstance(rid, (str, int)) or not str(rid):
                raise ResponsesFileError(f"{where}:id: must be a non-empty string")
            rid = str(rid)
            if rid in seen:
                raise ResponsesFileError(f"{where}:id: duplicate id {rid!r}, first at line {seen[rid]}")
            seen[rid] = lineno
            out = {"id": rid, "prompt_id": rec.get("prompt_id", rid), "sample_index": rec.get("sample_index", 0),
                   "request": req, "status": status, "response_raw": rec["response_raw"], "url": rec.get("url"),
                   "cache_key": cache_key(req), "backend": rec.get("backend", "import"),
                   "started_at": rec.get("started_at", rec.get("recorded")), "elapsed_s": rec.get("elapsed_s"),
                   "attempts": rec.get("attempts")}
            out.update({k: v for k, v in rec.items() if k not in out})
            yield out


def import_responses(source: str | Path, dataset: str, output_path: str | Path, log: Log = _stderr_log) -> dict[str, Any]:
    """Validate ``source`` and write it atomically to ``output_path`` as the dataset's responses."""
    n = write_jsonl_atomic(output_path, read_response_records(source, dataset))
    if n == 0:
        Path(output_path).unlink(missing_ok=True)
        raise ResponsesFileError(f"{source}: no responses (file is empty or blank)")
    log(f"import {dataset}: {n} responses from {source} -> {output_path}")
    return {"dataset": dataset, "samples": n, "source": str(source), "output": str(output_path)}

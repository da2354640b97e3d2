"""Generation: prompts -> exact response bodies, through OpenRouter, a local SGLang server, or the stand-in.

:func:`generate_dataset` (the ``generate`` rule's entry; also ``python -m eagledata.generate.job``) sends
one request per sample from ``generation.concurrency`` workers, each with its own keep-alive
connection (:mod:`eagledata.generate.httpclient`).

Faults. 408, 429, 5xx, timeouts (``generation.timeout_s`` per attempt), transport errors, errors
inside 200 bodies, mid-stream errors and unparseable bodies are retried up to ``max_attempts`` with
exponential backoff and jitter; a ``Retry-After`` is a lower bound, and after a 429 every worker
waits it out (the limit is per key). Such an answer is never stored as a success. Other 4xx (400,
403, 404, 413, 422, ...) are final for that prompt: not retried, recorded (status and exact body)
in the cache and the output, reported per prompt in the log and the summary. 401 (bad key) and
402 (no credits) stop the job: no new request starts, the ones in flight finish and are cached, and
:class:`JobStopped` says what to fix. A prompt still failing after ``max_attempts`` is listed in
:class:`GenerationError` (the others are cached; a rerun sends only the failing ones).

Budget. Every attempt reserves its worst-case cost in the run-wide ledger (:mod:`eagledata.generate.budget`)
before it is sent and is settled at ``usage.cost``; when the caps would be passed no new request
starts (:class:`JobStopped`). Interruption. SIGINT/SIGTERM (and ``generation.job_timeout_s``) drain:
no new request or retry starts, requests in flight finish and are cached (up to
``generation.drain_timeout_s``; a second signal cancels them at once), the cache stays consistent,
and :class:`Interrupted` is raised (exit status 128 + signal from the entry points).

Resumability. Every finished request (success or final error) is appended to
``{cache_dir}/{dataset}/responses.jsonl`` at once with one ``write`` (so even ``kill -9`` loses no
received response; ``fsync`` follows at most every half second); this file is deliberately not a
Snakemake output. Entries are keyed by :func:`cache_key`, the sha256 of the canonical JSON of the
exact request body (plus the sample number for samples after the first, and a salt naming the
endpoint when it is not OpenRouter's, and the stand-in's identity for the simulator backend), so a
rerun requests only what is missing and any change of an output-shaping setting requests anew. A
torn last line is ignored and cut off. The rule output is written atomically, in prompt-file order,
with a summary (``generation_summary.json``) beside it. One job at a time writes a dataset's cache
(an ``flock``, :mod:`eagledata.generate.cachelock`); a second one waits, then requests only what is missing.
A failed cache or ledger write (a full disk) stops new requests and loses no answer received: see
:class:`ResponseCache`, :func:`keep_paid_answers` and :mod:`eagledata.generate.rescue`.

Preflight. Before the first request (and before the ledger is opened), :mod:`eagledata.generate.preflight`
checks what a later stage would otherwise find only after paying: the tokenizer is found and passes
its self-check, every prompt to request renders with the chat template, the extraction weights
exist (extraction enabled), and the cache disk has room for the answers at ``max_tokens``.

SGLang (``backend: sglang``, ``generation.api_base`` = the server root). ``sglang_endpoint: chat``
(default) sends SGLang's OpenAI-compatible ``/v1/chat/completions`` with ``return_token_ids`` (never
streamed: SGLang returns ids only for non-streamed chat); ``generate`` sends the native
``/generate`` with ``input_ids`` rendered by the model's chat template. Either way the record gets
``token_ids``: see :func:`sglang_completion_ids`.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import re
import signal
import sqlite3
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from eagledata.generate.budget import BudgetExhausted, BudgetLedger, LedgerSession, ledger_path
from eagledata.generate.cachelock import CacheLockTimeout, acquire_writer_lock, lock_wait_s
from eagledata.config import DatasetSettings, dataset_generation, dataset_settings, load_model_tokenizer, validate_config
from eagledata.eventloop import run as run_event_loop
from eagledata.eventloop import uvloop_module
from eagledata.generate.httpclient import Connection, Endpoint, RequestHead, TransportError
from eagledata.io import ResponsesFileError, iter_json_lines, normalize_response_line
from eagledata.generate.prompts import Prompt, canonical_json, read_prompts, sha256_hex
from eagledata.generate.rescue import RESCUE_ENV, RescueFile, find_rescue_files, free_space, read_rescue_lines
from eagledata.tokens.responses import parse_response

Log = Callable[[str], None]

API_KEY_ENV = "OPENROUTER_API_KEY"
DEFAULT_API_BASE = "https://openrouter.ai/api/v1"
#: Generation settings that shape the responses (the rest only shape how they are fetched).
OUTPUT_SETTINGS = ("max_tokens", "temperature", "top_p", "seed", "reasoning", "provider", "stream",
                   "samples_per_prompt", "tool_choice", "parallel_tool_calls", "extra_body", "sglang_endpoint")
#: Fields of every record of ``results/{dataset}/responses.jsonl``.
RECORD_FIELDS = ("id", "prompt_id", "sample_index", "request", "status", "response_raw", "url", "cache_key",
                 "backend", "started_at", "elapsed_s", "attempts", "generation_id", "token_ids")
#: Fields present only where they apply (SGLang backend; native endpoint).
OPTIONAL_FIELDS = ("prompt_token_ids", "token_ids_info", "chat_request")
FINAL_STATUSES_FATAL = {401: "the API key was rejected (401): check OPENROUTER_API_KEY",
                        402: "OpenRouter answered 402 Payment Required (insufficient credits): add credits or "
                             "lower the load, then rerun"}
FSYNC_INTERVAL_S = 0.5


class GenerationError(RuntimeError):
    """The generation job cannot finish; the message says what to do. The cache is kept."""


class JobStopped(GenerationError):
    """A condition that stops every request (401, 402, budget)."""


class Interrupted(GenerationError):
    """SIGINT/SIGTERM or the job timeout: in-flight requests were drained, the cache is consistent."""

    def __init__(self, message: str, signum: int | None = None):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum else 1


def _stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Requests and keys


def build_request(prompt: Prompt, settings: DatasetSettings, sample_index: int = 0) -> dict[str, Any]:
    """The exact OpenRouter request body for one sample. Optional settings are sent only when not
    null; with a ``seed``, sample ``k`` uses ``seed + k``; ``extra_body`` keys are added last
    (they cannot replace ``model``, ``messages`` or ``tools``)."""
    g = settings.generation
    body: dict[str, Any] = {"model": settings.api_model, "messages": prompt.messages}
    if prompt.tools:
        body["tools"] = prompt.tools
        for key in ("tool_choice", "parallel_tool_calls"):
            if g.get(key) is not None:
                body[key] = g[key]
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
    for key, value in (g.get("extra_body") or {}).items():
        if key not in ("model", "messages", "tools"):
            body[key] = value
    return body


def sglang_chat_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenRouter body as SGLang's ``/v1/chat/completions`` body: no ``provider``/``usage``
    (OpenRouter's), never streamed, and the generated (and prompt) token ids requested."""
    out = {k: v for k, v in body.items() if k not in ("provider", "usage", "stream")}
    out["stream"] = False
    out["return_token_ids"] = True
    out["return_prompt_token_ids"] = True
    return out


def sglang_generate_request(body: Mapping[str, Any], tokenizer: Any) -> dict[str, Any]:
    """The native ``/generate`` body: the prompt as ids from the model's chat template, the
    sampling settings in SGLang's names, special tokens kept in the text (so the text path can be
    checked against the ids)."""
    from eagledata.text.chat import prompt_ids, request_thinking

    sp: dict[str, Any] = {"max_new_tokens": body.get("max_tokens"), "skip_special_tokens": False, "no_stop_trim": True}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("seed", "sampling_seed")):
        if body.get(src) is not None:
            sp[dst] = body[src]
    for key in ("top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "stop"):
        if body.get(key) is not None:
            sp[key] = body[key]
    ids = prompt_ids(tokenizer, body["messages"], body.get("tools"), thinking=request_thinking(body))
    return {"input_ids": ids, "sampling_params": sp, "stream": False}


def cache_key(body: Mapping[str, Any], sample_index: int = 0, salt: Mapping[str, Any] | None = None) -> str:
    """sha256 of the canonical JSON of ``body``; samples after the first and a backend ``salt``
    (the endpoint; the simulator's seed, profile and tokenizer) are appended, since they change
    the answer to an identical body."""
    text = canonical_json(body)
    extra = {k: v for k, v in (("sample", sample_index or None), ("salt", salt or None)) if v is not None}
    if extra:
        text += "\n" + canonical_json(extra)
    return sha256_hex(text)


def simulator_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    sim = dict(config.get("simulator") or {})
    return {"seed": sim.get("seed", 0), "provider": sim.get("provider", "exact")}


def normalized_api_base(settings: DatasetSettings) -> str:
    base = str(settings.generation.get("api_base") or DEFAULT_API_BASE).rstrip("/")
    if settings.backend == "sglang":
        base = base.removesuffix("/v1")
    return base


def endpoint_salt(settings: DatasetSettings) -> dict[str, Any] | None:
    """What, beyond the body, selects the model that answers: a non-default endpoint."""
    if settings.backend == "simulator":
        return None
    base = normalized_api_base(settings)
    if settings.backend == "sglang":
        return {"endpoint": base, "sglang": settings.generation.get("sglang_endpoint", "chat")}
    return None if base == DEFAULT_API_BASE else {"endpoint": base}


def request_params(settings: DatasetSettings, config: Mapping[str, Any]) -> dict[str, Any]:
    """The output-shaping settings of a dataset (the ``generate`` rule's ``params``): changing one
    reruns the rule, and the cache makes that rerun request only what changed. Concurrency,
    timeouts, retry and budget settings are left out on purpose."""
    params: dict[str, Any] = {"backend": settings.backend, "model": settings.api_model}
    params.update({k: settings.generation.get(k) for k in OUTPUT_SETTINGS})
    salt = endpoint_salt(settings)
    if salt:
        params["endpoint"] = salt
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
        """The simulator answers with the model's tokenizer, and SGLang's native endpoint is sent
        prompt ids from it, so its files shape the responses there."""
        s = self.settings(wildcards)
        shaped = s.backend == "simulator" or (s.backend == "sglang" and s.generation.get("sglang_endpoint") == "generate")
        return self.tokenizer_input(wildcards) if shaped else []

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
    request: dict[str, Any]  # the exact body sent
    cache_key: str
    chat_request: dict[str, Any]  # the OpenAI-form request (== request for chat endpoints)
    body_json: str  # ``request`` serialised: the bytes sent, and embedded as-is in the record


@dataclass
class DatasetWork:
    settings: DatasetSettings
    prompts: list[Prompt]
    items: list[WorkItem]
    salt: dict[str, Any] | None
    url: str  # the completion endpoint
    api_base: str


def work_items(prompts: Iterable[Prompt], settings: DatasetSettings, salt: Mapping[str, Any] | None = None,
               tokenizer: Any = None) -> list[WorkItem]:
    n = int(settings.generation.get("samples_per_prompt", 1))
    native = settings.backend == "sglang" and settings.generation.get("sglang_endpoint") == "generate"
    items = []
    for p in prompts:
        for k in range(n):
            chat = build_request(p, settings, k)
            if settings.backend == "sglang":
                body = sglang_generate_request(chat, tokenizer) if native else sglang_chat_request(chat)
            else:
                body = chat
            items.append(WorkItem(p.id if n == 1 else f"{p.id}#{k}", p.id, k, body, cache_key(body, k, salt), chat,
                                  json.dumps(body, ensure_ascii=False)))
    return items


def simulator_salt(config: Mapping[str, Any], settings: DatasetSettings, tokenizer: Any) -> dict[str, Any]:
    return {"simulator": {**simulator_settings(config), "tokenizer": tokenizer.fingerprint,
                          "price_per_mtok": dict(settings.model.get("price_per_mtok") or {})}}


def dataset_work(config: Mapping[str, Any], dataset: str, tokenizer: Any = None) -> DatasetWork:
    """The work of a prompts dataset: every sample's exact request and cache key. ``tokenizer`` is
    needed for the simulator backend (its identity salts the keys) and SGLang's native endpoint."""
    s = dataset_settings(config, dataset)
    if s.imported or not s.prompts:
        raise GenerationError(f"dataset {dataset!r} has 'responses:' (imported); it is not generated")
    if s.backend not in ("openrouter", "sglang", "simulator"):
        raise GenerationError(f"dataset {dataset!r}: unknown backend {s.backend!r}")
    native = s.backend == "sglang" and s.generation.get("sglang_endpoint") == "generate"
    if tokenizer is None and (s.backend == "simulator" or native):
        tokenizer = load_model_tokenizer(config, s.model_name)
    prompts = read_prompts(s.prompts)
    salt = simulator_salt(config, s, tokenizer) if s.backend == "simulator" else endpoint_salt(s)
    base = normalized_api_base(s)
    if s.backend == "sglang":
        url = base + ("/generate" if native else "/v1/chat/completions")
    else:
        url = base + "/chat/completions"
    return DatasetWork(s, prompts, work_items(prompts, s, salt, tokenizer), salt, url, base)


# ----------------------------------------------------------------------------------------------
# Cache


class FsyncFailed(OSError):
    """An ``fsync`` of the cache failed: the records since the last successful one may be lost."""


class ResponseCache:
    """Append-only JSONL of finished requests, indexed by ``cache_key`` (byte offsets, so records
    are read back only when the output is written). ``refs``: the budget reservation behind each
    record (``ledger_ref`` -> cost, provider, generation id), for the ledger's crash recovery.

    One writer at a time (the generate job holding :mod:`eagledata.generate.cachelock`'s lock); any number
    of readers (:meth:`load` ignores a torn last line). A failed write or ``fsync`` (``OSError``,
    e.g. ENOSPC) never loses a line: the file is cut back to its last record known to be on disk,
    every line not known to be there is kept in :attr:`pending` (and appended to a
    :class:`~eagledata.generate.rescue.RescueFile` when ``dataset`` is given), :attr:`write_error` names the
    path, the error and the free space, ``on_write_error`` hears of it once (the job stops), and
    every later line goes to :attr:`pending` too; :meth:`write_pending` writes them once the disk
    takes them again."""

    def __init__(self, path: str | Path, dataset: str | None = None):
        self.path = Path(path)
        self.index: dict[str, tuple[int, int]] = {}
        self.refs: dict[str, dict[str, Any]] = {}
        self.skipped_lines = 0
        self.pending: list[tuple[str, bytes]] = []  # received, not (known to be) in the file
        self.write_error: str | None = None
        self.on_write_error: Callable[[str], None] | None = None
        self.rescue = RescueFile(self.path, dataset) if dataset else None
        self._rescued = 0  # pending lines already in the rescue file
        self._fd: int | None = None
        self._size = 0  # end of the last record written
        self._durable = 0  # end of the last record covered by a successful fsync
        self._unsynced: list[tuple[str, bytes]] = []  # the records between the two
        self._sync_mark = (0, 0)  # (size, unsynced count) that the background fsync in progress covers
        self._synced = 0.0
        self._syncing: Future | None = None  # the background fsync in progress
        self._sync_thread: ThreadPoolExecutor | None = None

    def load(self) -> dict[str, tuple[int, int]]:
        self.index.clear()
        self.refs.clear()
        if not self.path.exists():
            return self.index
        offset = 0
        with open(self.path, "rb") as fh:
            for line in fh:
                if line.endswith(b"\n"):
                    try:
                        self._index_line(json.loads(line), offset, len(line))
                    except (ValueError, KeyError, TypeError):
                        self.skipped_lines += 1
                offset += len(line)  # a last line without newline is a torn write: ignored
        return self.index

    def _index_line(self, rec: Mapping[str, Any], offset: int, length: int) -> None:
        self.index[rec["cache_key"]] = (offset, length)
        if rec.get("ledger_ref"):
            self.refs[rec["ledger_ref"]] = {"cost": rec.get("cost"), "provider": rec.get("provider"),
                                            "generation_id": rec.get("generation_id")}

    def open(self) -> None:
        """Open for appending (once), first cutting off a torn last line (so the next record
        starts on a line of its own)."""
        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        size = os.lseek(fd, 0, os.SEEK_END)
        keep = size
        while keep > 0:  # scan back to the last newline
            start = max(0, keep - 65536)
            block = os.pread(fd, keep - start, start)
            nl = block.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            keep = start
        if keep != size:
            os.ftruncate(fd, keep)
            os.fsync(fd)
        self._fd, self._size, self._durable = fd, keep, keep

    # -- writing --------------------------------------------------------------------------------
    def _write_some(self, fd: int, data: memoryview) -> int:
        """One ``os.write`` (the seam where tests inject a full disk)."""
        return os.write(fd, data)

    def _fsync(self, fd: int) -> None:
        """``os.fsync`` (a seam for tests too)."""
        os.fsync(fd)

    def _write_all(self, data: bytes) -> None:
        """Write ``data`` at the end; on failure cut the file back to the last record and re-raise."""
        assert self._fd is not None
        view = memoryview(data)
        try:
            while view:
                view = view[self._write_some(self._fd, view):]
        except OSError:
            self._cut_back()
            raise

    def _cut_back(self) -> None:
        """Drop any bytes after the last record (a partly written line); best effort."""
        try:
            if self._fd is not None and os.lseek(self._fd, 0, os.SEEK_END) != self._size:
                os.ftruncate(self._fd, self._size)
        except OSError:
            pass

    def append_line(self, key: str, line: bytes) -> None:
        """Append one complete record line with a single ``write`` (crash-safe against a killed
        process: the kernel has the bytes once ``write`` returns); ``fsync`` (against power loss)
        at most every :data:`FSYNC_INTERVAL_S`, on a background thread so that a slow disk never
        stalls the requests in flight. Never raises ``OSError``: after a failed write or fsync the
        line is kept (see the class docstring)."""
        if self.write_error is None:
            try:
                self._append(key, line)
                return
            except OSError as exc:
                self._write_failed(exc, isinstance(exc, FsyncFailed))
        self._keep([(key, line)])

    def _append(self, key: str, line: bytes) -> None:
        if self._fd is None:
            self.open()
        if self._syncing is not None and self._syncing.done():
            self._check_sync()
        self._write_all(line)
        self.index[key] = (self._size, len(line))
        self._size += len(line)
        self._unsynced.append((key, line))
        if time.monotonic() - self._synced >= FSYNC_INTERVAL_S and self._syncing is None:
            self._synced = time.monotonic()
            if self._sync_thread is None:
                self._sync_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-fsync")
            self._sync_mark = (self._size, len(self._unsynced))
            self._syncing = self._sync_thread.submit(self._fsync, self._fd)

    def append(self, record: Mapping[str, Any]) -> None:
        self.append_line(record["cache_key"], (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))

    def _check_sync(self) -> None:
        """Account for the finished (else: wait for the) background ``fsync``: the records it
        covered are durable; raises :class:`FsyncFailed` if it failed."""
        fut, self._syncing = self._syncing, None
        if fut is None:
            return
        exc = fut.exception()
        if exc is not None:
            raise FsyncFailed(getattr(exc, "errno", None), getattr(exc, "strerror", None) or str(exc))
        size, n = self._sync_mark
        self._durable = max(self._durable, size)
        del self._unsynced[:n]

    def _sync_now(self) -> OSError | None:
        """``fsync`` now, after any background one; the error when the records are not all durable."""
        try:
            self._check_sync()
            if self._fd is not None and self._unsynced:
                try:
                    self._fsync(self._fd)
                except OSError as exc:
                    raise FsyncFailed(exc.errno, exc.strerror or str(exc)) from exc
                self._durable, self._unsynced = self._size, []
        except OSError as exc:
            return exc
        self._synced = time.monotonic()
        return None

    def sync(self) -> None:
        """``fsync`` now, on the caller's thread. Never raises ``OSError``: records a failed fsync
        cannot vouch for are kept as after a failed write."""
        exc = self._sync_now()
        if exc is not None:
            self._write_failed(exc, True)

    def _write_failed(self, exc: OSError, fsync_failed: bool) -> None:
        """A failed write or fsync. The records written since the last successful fsync are
        durable only if an fsync succeeds now, never after a failed one (the kernel may have
        dropped their pages and reports that once): then they are kept and cut off the file."""
        first = self.write_error is None
        if first:
            self.write_error = (f"{self.path}: {'fsync' if fsync_failed else 'write'} failed: "
                                f"{exc.strerror or exc} ({free_space(self.path)})")
        if not fsync_failed and self._sync_now() is not None:
            fsync_failed = True
        if fsync_failed and self._unsynced:
            lost, self._unsynced = self._unsynced, []
            for key, _ in lost:
                self.index.pop(key, None)
            self._size = self._durable
            self._cut_back()
            self._keep(lost)
        if first and self.on_write_error is not None:
            self.on_write_error(self.write_error)

    def _keep(self, lines: list[tuple[str, bytes]]) -> None:
        """Hold lines the file did not take, and append them to the rescue file (best effort now;
        :meth:`rescue_all` tries again)."""
        self.pending.extend(lines)
        if self.rescue is not None:
            try:
                self.rescue.append(line for _, line in self.pending[self._rescued:])
                self._rescued = len(self.pending)
            except OSError:
                pass

    def write_pending(self) -> int:
        """Write the kept lines at the end of the cache and ``fsync``; returns how many. Raises
        ``OSError`` while the disk still refuses them (the file cut back, nothing lost). Then the
        rescue file, no longer needed, is deleted."""
        if not self.pending:
            return 0
        self.open()
        self._cut_back()
        self._write_all(b"".join(line for _, line in self.pending))
        try:
            self._fsync(self._fd)
        except OSError:
            self._cut_back()
            raise
        offset = self._size
        for key, line in self.pending:
            self.index[key] = (offset, len(line))
            offset += len(line)
        self._size = self._durable = offset
        n, self.pending, self._rescued = len(self.pending), [], 0
        if self.rescue is not None:
            self.rescue.discard()
        return n

    def rescue_all(self) -> Path:
        """Make sure every kept line is in the rescue file; returns its path. Raises
        :class:`GenerationError` naming every place tried (and its free space) when none takes them."""
        if self.rescue is None:
            self.rescue = RescueFile(self.path, self.path.parent.name)
        try:
            self.rescue.append(line for _, line in self.pending[self._rescued:])
        except OSError:
            raise GenerationError(
                f"{len(self.pending)} paid answer(s) could be written neither to the cache ({self.write_error}) nor "
                f"to a rescue file ({'; '.join(self.rescue.errors)}); they are lost when this process ends. Free space, "
                f"or point ${RESCUE_ENV} at a disk with room, before the next run") from None
        self._rescued = len(self.pending)
        assert self.rescue.path is not None
        return self.rescue.path

    def import_rescued(self, files: Iterable[Path]) -> int:
        """Before anything is sent: the records of rescue files (:mod:`eagledata.generate.rescue`) that are
        not cached yet are written to the cache and fsync'ed, then the files are deleted. Returns
        how many were imported. Raises ``OSError`` while the cache refuses them (files kept)."""
        files = list(files)
        found: dict[str, tuple[dict[str, Any], bytes]] = {}
        for f in files:
            for line in read_rescue_lines(f):
                try:
                    rec = json.loads(line)
                    if rec["cache_key"] not in self.index:
                        found[rec["cache_key"]] = (rec, line)
                except (ValueError, KeyError, TypeError):
                    continue
        self.pending = [(key, line) for key, (_, line) in found.items()]
        n = self.write_pending()
        for key, (rec, _) in found.items():
            self._index_line(rec, *self.index[key])
        for f in files:
            f.unlink(missing_ok=True)
        return n

    # -- reading --------------------------------------------------------------------------------
    def get(self, key: str, fh: Any = None) -> dict[str, Any]:
        """The record of ``key``; pass an open binary ``fh`` of the cache to read many."""
        offset, length = self.index[key]
        if fh is None:
            with open(self.path, "rb") as own:
                return self.get(key, own)
        fh.seek(offset)
        return json.loads(fh.read(length))

    def close(self) -> None:
        """``fsync`` and close; a failed fsync keeps its records in :attr:`pending` (and the
        rescue file) as after a failed write."""
        if self._fd is not None:
            self.sync()
            os.close(self._fd)
            self._fd = None
        if self._sync_thread is not None:
            self._sync_thread.shutdown(wait=True)
            self._sync_thread = None
        if self.rescue is not None:
            self.rescue.close()


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


def write_json_atomic(path: str | Path, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------------------------
# Retries


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
    job_timeout_s: float | None = None
    drain_timeout_s: float = 60.0

    @classmethod
    def from_generation(cls, g: Mapping[str, Any], url: str, backend: str, headers: Mapping[str, str]) -> "ClientSettings":
        job = g.get("job_timeout_s")
        return cls(url, backend, dict(headers), int(g.get("concurrency", 16)), int(g.get("max_attempts", 6)),
                   float(g.get("timeout_s", 600)), float(g.get("backoff_base_s", 1.0)), float(g.get("backoff_max_s", 60.0)),
                   float(job) if job is not None else None, float(g.get("drain_timeout_s", 60.0)))


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


# ----------------------------------------------------------------------------------------------
# Interpreting one answer


@dataclass
class Answer:
    ok: bool
    problem: str = ""  # when not ok
    where: str = ""  # http | body | stream | finish | malformed | ids
    cost: float | None = None  # reported by the server
    provider: str | None = None
    generation_id: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    streamed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # token_ids etc. for the record


def sglang_completion_ids(ids: Any, finish_type: str | None, matched: Any) -> tuple[list[int] | None, dict[str, Any]]:
    """Normalise the ids an SGLang server returned into the record's ``token_ids``: exactly the
    completion the model sampled after the prompt (for K2.5 after the prompt's ``<think>``), up to
    and INCLUDING the end-of-turn id when the model stopped on it (``finish_reason`` stop /
    tool_calls with an integer ``matched_stop``); no end of turn after ``length``. Versions that
    leave the matched stop id out of the returned ids get it appended (``appended_stop``)."""
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return None, {"problem": "no token ids in the answer"}
    out = list(ids)
    info: dict[str, Any] = {"returned": len(ids), "finish": finish_type, "matched_stop": matched, "appended_stop": False}
    if finish_type in ("stop", "tool_calls") and isinstance(matched, int) and not isinstance(matched, bool):
        if not out or out[-1] != matched:
            out.append(matched)
            info["appended_stop"] = True
    return out, info


def interpret(backend: str, native: bool, status: int, text: str) -> Answer:
    """What one HTTP answer means; never raises."""
    if backend == "sglang" and native:
        try:
            body = json.loads(text)
        except ValueError as exc:
            return Answer(False, f"unparseable body ({exc})", "malformed")
        if status != 200 or not isinstance(body, dict) or "output_ids" not in body:
            msg = body.get("message") or body.get("error") if isinstance(body, dict) else None
            return Answer(False, f"HTTP {status}: {str(msg or text[:200])}", "http" if status != 200 else "body")
        meta = body.get("meta_info") or {}
        fin = meta.get("finish_reason") or {}
        ids, info = sglang_completion_ids(body.get("output_ids"), fin.get("type"), fin.get("matched"))
        if ids is None:
            return Answer(False, info["problem"], "ids")
        if fin.get("type") == "abort":
            return Answer(False, f"generation aborted: {fin.get('message') or fin}", "finish")
        return Answer(True, generation_id=meta.get("id"), provider="sglang", prompt_tokens=meta.get("prompt_tokens"),
                      completion_tokens=meta.get("completion_tokens"), extra={"token_ids": ids, "token_ids_info": info})
    parsed = parse_response(text, status)
    common = dict(cost=parsed.cost, provider=parsed.provider, generation_id=parsed.generation_id,
                  prompt_tokens=parsed.prompt_tokens, completion_tokens=parsed.completion_tokens, streamed=parsed.streamed)
    if not parsed.ok:
        err = parsed.error
        assert err is not None
        if status != 200:
            detail = f": {err.message}" if err.message and err.message != f"HTTP {status}" else ""
            return Answer(False, f"HTTP {status}{detail}", "http", **common)
        return Answer(False, f"error in 200 {'stream' if parsed.streamed else 'body'} ({err.where}, code {err.code}: "
                             f"{err.message})", err.where, **common)
    if backend != "sglang":
        return Answer(True, **common)
    try:
        choice = json.loads(text)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return Answer(False, "unparseable body", "malformed", **common)
    ids, info = sglang_completion_ids(choice.get("token_ids"), choice.get("finish_reason"), choice.get("matched_stop"))
    if ids is None:
        return Answer(False, "SGLang returned no token_ids: this server does not support return_token_ids on "
                             "/v1/chat/completions; set generation.sglang_endpoint: generate", "ids", **common)
    extra: dict[str, Any] = {"token_ids": ids, "token_ids_info": info}
    if isinstance(choice.get("prompt_token_ids"), list):
        extra["prompt_token_ids"] = choice["prompt_token_ids"]
    common["provider"] = common["provider"] or "sglang"
    return Answer(True, extra=extra, **common)


_JSON = json.JSONEncoder(ensure_ascii=False)
_SSE_ID = re.compile(rb'data:\s*\{[^\n]*?"id"\s*:\s*"([^"]+)"')


# ----------------------------------------------------------------------------------------------
# The job


@dataclass
class Outcome:
    kind: str  # ok | final | fatal | retry
    problem: str = ""
    retry_after: float | None = None
    line: bytes | None = None  # the cache line (ok, final)
    status: int = 0


#: What a failed budget-ledger write raises (SQLite's "database or disk is full" is an sqlite3.Error).
LEDGER_WRITE_ERRORS = (sqlite3.Error, OSError)


def ledger_write_error(path: Path, exc: BaseException) -> str:
    return f"budget ledger write failed: {path}: {exc} ({free_space(path)})"


class GenerationJob:
    """One dataset's requests: workers, retries, ledger, cache, progress, signals."""

    def __init__(self, work: DatasetWork, items: list[WorkItem], cs: ClientSettings, cache: ResponseCache,
                 ledger: Any, progress: Any, log: Log, reserve_usd: Mapping[str, float], price: Any):
        self.work, self.items, self.cs, self.cache, self.ledger = work, items, cs, cache, ledger
        self.progress, self.log, self.reserve_usd, self.price = progress, log, reserve_usd, price
        self.endpoint = Endpoint.parse(cs.url)
        self.native = work.settings.backend == "sglang" and work.settings.generation.get("sglang_endpoint") == "generate"
        self.stream = bool(work.items and work.items[0].request.get("stream"))
        self.gate = RateGate()
        self.stop_reason: str | None = None  # 401/402/budget: JobStopped
        self.interrupt: str | None = None  # signal / job timeout: Interrupted
        self.signum: int | None = None
        self.halt = asyncio.Event()
        self.failures: dict[str, str] = {}
        self.final_errors: list[dict[str, Any]] = []
        self.finished: set[str] = set()
        self.http_requests = 0
        self.cost = 0.0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.over_reservation = 0
        self.run_s = 0.0
        self.run_cpu_s = 0.0
        self.tasks: list[asyncio.Task] = []
        self.headers = {**cs.headers, "Content-Type": "application/json"}
        self.head = RequestHead("POST", self.endpoint, self.headers)
        self.deadlines: dict[Any, float] = {}  # connection -> deadline of its attempt (one watchdog for all)

    # -- control --------------------------------------------------------------------------------
    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            self.log(f"stopping: {reason}; no new request starts, requests in flight finish")
        self.halt.set()

    def interrupt_now(self, reason: str, signum: int | None = None) -> None:
        if self.interrupt is not None:
            self.log(f"{reason} again: cancelling the requests in flight")
            self.cancel_all()
            return
        self.interrupt, self.signum = reason, signum
        self.halt.set()
        in_flight = self.progress.in_flight
        self.log(f"{reason}: draining {in_flight} request(s) in flight (at most {self.cs.drain_timeout_s:g} s; "
                 f"send the signal again to cancel them), no new request or retry starts")
        asyncio.get_running_loop().call_later(self.cs.drain_timeout_s, self.cancel_all)

    def cancel_all(self) -> None:
        for t in self.tasks:
            t.cancel()

    @property
    def halted(self) -> bool:
        return self.halt.is_set()

    # -- workers --------------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        handlers = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.add_signal_handler(sig, self.interrupt_now, f"received {signal.Signals(sig).name}", sig)
                    handlers.append(sig)
                except (NotImplementedError, RuntimeError):
                    pass
        timer = None
        if self.cs.job_timeout_s is not None:
            timer = loop.call_later(self.cs.job_timeout_s, self.interrupt_now,
                                    f"job timeout ({self.cs.job_timeout_s:g} s, generation.job_timeout_s)")
        pending = iter(self.items)
        n = max(1, min(self.cs.concurrency, len(self.items)))
        watchdog = asyncio.create_task(self.watchdog())
        try:
            self.tasks = [asyncio.create_task(self.worker(pending)) for _ in range(n)]
            results = await asyncio.gather(*self.tasks, return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                    raise r
        finally:
            watchdog.cancel()
            if timer is not None:
                timer.cancel()
            for sig in handlers:
                loop.remove_signal_handler(sig)

    async def watchdog(self) -> None:
        """Aborts the connection of every attempt past its deadline (one timer for all requests,
        checked every ``timeout_s / 8``, at most every second: a timeout fires within that of
        ``timeout_s``; cheaper than a timer per request, and no task is ever cancelled)."""
        tick = min(1.0, max(0.01, self.cs.timeout_s / 8))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for conn, deadline in list(self.deadlines.items()):
                if deadline <= now and not conn.timed_out:
                    conn.timed_out = True
                    conn.abort()

    async def worker(self, pending: Iterator[WorkItem]) -> None:
        """Sends one request at a time on its own connection. With a ledger, the reservation of
        its next item is asked for as soon as the current request holds its own (see
        :meth:`LedgerSession.reserve_ahead`), so that the next request goes out the moment the
        current answer is stored instead of waiting a ledger transaction."""
        ep = self.endpoint
        conn = Connection(ep.scheme, ep.host, ep.port, connect_timeout=min(30.0, self.cs.timeout_s))
        queue: list[tuple[WorkItem, asyncio.Future | None]] = []  # the next item, its reservation asked ahead

        def take_next() -> None:
            if not queue and (nxt := next(pending, None)) is not None:
                ledger = self.ledger
                ahead = None if ledger is None or self.halted else ledger.reserve_ahead(
                    self.reserve_usd[nxt.cache_key], item=nxt.id, cache_key=nxt.cache_key, attempt=1)
                queue.append((nxt, ahead))

        def drop_next() -> None:  # a retry must not wait behind this worker's own next reservation
            if queue and queue[0][1] is not None:
                self.ledger.give_back(queue[0][1])
                queue[0] = (queue[0][0], None)

        try:
            take_next()
            while queue and not self.halted:
                item, ahead = queue.pop()
                await self.process(item, conn, ahead, take_next, drop_next)
                take_next()
        finally:
            for _, ahead in queue:
                if ahead is not None:
                    self.ledger.give_back(ahead)
            conn.close()

    async def process(self, item: WorkItem, conn: Any, ahead: asyncio.Future | None = None,
                      on_reserved: Callable[[], None] | None = None, drop_next: Callable[[], None] | None = None) -> None:
        """All attempts of one item. ``ahead``: its reservation asked for in advance (``None`` as
        result: did not fit then, so ask and wait now; given back if never used); ``on_reserved``
        runs once the first attempt holds its reservation; ``drop_next`` gives back the worker's
        next reservation before a retry asks for one."""
        started = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        t0 = time.monotonic()
        problem = "not started"
        try:
            for attempt in range(1, self.cs.max_attempts + 1):
                if attempt > 1 and self.halted:
                    problem += f" (no retry: {self.interrupt or self.stop_reason})"
                    break
                await self.gate.wait()
                ref = None
                if self.ledger is not None:
                    asked, ahead = ahead, None
                    ref, not_started = await self.reservation(item, attempt, asked, drop_next)
                    if ref is None:
                        problem = not_started
                        break
                if on_reserved is not None:
                    on_reserved()
                    on_reserved = None
                self.http_requests += 1
                self.progress.in_flight += 1
                try:
                    out = await self.attempt(item, conn, ref, attempt, started, t0)
                finally:
                    self.progress.in_flight -= 1
                if out.kind in ("ok", "final"):
                    assert out.line is not None
                    self.cache.append_line(item.cache_key, out.line)
                    self.finished.add(item.id)
                    self.progress.done += 1
                    if out.kind == "ok":
                        self.progress.ok += 1
                    else:
                        self.progress.final_errors += 1
                        self.final_errors.append({"id": item.id, "status": out.status, "error": out.problem})
                        self.log(f"{item.id}: HTTP {out.status} is final (not retried): {out.problem}")
                    self.progress.update()
                    return
                if out.kind == "fatal":
                    self.stop(f"{out.problem} (on {item.id})")
                    problem = out.problem
                    break
                problem = out.problem
                self.progress.retries += 1
                if attempt < self.cs.max_attempts:
                    delay = backoff_delay(attempt, self.cs.backoff_base_s, self.cs.backoff_max_s, out.retry_after)
                    self.log(f"{item.id}: attempt {attempt}/{self.cs.max_attempts} failed: {problem}; retrying in {delay:.2f} s")
                    try:
                        await asyncio.wait_for(self.halt.wait(), delay)
                    except asyncio.TimeoutError:
                        pass
            self.failures[item.id] = problem
        except asyncio.CancelledError:
            self.failures[item.id] = "cancelled while in flight"
            raise
        finally:
            if ahead is not None:  # never awaited (e.g. cancelled while a Retry-After held the gate)
                self.ledger.give_back(ahead)

    async def reservation(self, item: WorkItem, attempt: int, ahead: asyncio.Future | None,
                          drop_next: Callable[[], None] | None) -> tuple[str | None, str]:
        """The reservation of one attempt: ``ahead``'s when it was granted, else one asked for now
        (waiting while the caps are full). Returns ``(ref, "")``, or ``(None, why not started)``
        when the budget, a stop, an interruption or a failed ledger write comes first."""
        ref = None
        try:
            if ahead is not None:
                try:
                    ref = await ahead
                except asyncio.CancelledError:
                    self.ledger.give_back(ahead)
                    raise
                if ref is not None:
                    self.ledger.claim(ref)
            elif attempt > 1 and drop_next is not None:
                drop_next()
            if ref is None:
                ref = await self.ledger.reserve(self.reserve_usd[item.cache_key], stop=self.halt, item=item.id,
                                                cache_key=item.cache_key, attempt=attempt)
        except BudgetExhausted as exc:
            self.stop(f"budget: {exc}")
            return None, "not started: budget"
        except LEDGER_WRITE_ERRORS as exc:
            self.write_failed(ledger_write_error(self.ledger.ledger.path, exc))
            return None, f"not started: {self.stop_reason}"
        if ref is None or self.halted:  # stopped or interrupted while waiting for the reservation
            if ref is not None:
                self.ledger.settle(ref, 0.0, note="not sent: job stopping")
            return None, f"not started: {self.stop_reason or self.interrupt}"
        return ref, ""

    def write_failed(self, what: str) -> None:
        """A cache or ledger write failed (a full disk): no new request starts; the answers in
        flight are kept (:meth:`ResponseCache.append_line`, then :func:`keep_paid_answers`)."""
        self.stop(f"{what}; answers received are kept")

    async def attempt(self, item: WorkItem, conn: Any, ref: str | None, attempt: int, started: str, t0: float) -> Outcome:
        led = self.ledger
        gen: dict[str, Any] = {"id": None, "sniff": b""}

        def on_head(status: int, headers: Mapping[str, str]) -> None:
            gid = headers.get("x-generation-id")
            if gid and ref is not None:
                gen["id"] = gid
                led.note(ref, generation_id=gid)

        def on_data(piece: bytes) -> None:
            if gen["id"] is None and self.stream and len(gen["sniff"]) < 16384:
                gen["sniff"] += piece
                m = _SSE_ID.search(gen["sniff"])
                if m and ref is not None:
                    gen["id"] = m.group(1).decode("utf-8", "replace")
                    led.note(ref, generation_id=gen["id"])

        conn.timed_out = False
        self.deadlines[conn] = time.monotonic() + self.cs.timeout_s
        try:
            try:
                resp = await conn.request("POST", self.endpoint, self.head, item.body_json.encode("utf-8"), on_head, on_data)
            except TransportError as exc:
                if conn.timed_out and exc.sent:  # aborted by the watchdog: this attempt's timeout
                    raise asyncio.TimeoutError() from None
                raise
            finally:
                self.deadlines.pop(conn, None)
        except (asyncio.TimeoutError, TimeoutError):
            conn.close()
            if ref is not None:
                led.orphan(ref, generation_id=gen["id"], note="timeout")
            return Outcome("retry", f"timeout after {self.cs.timeout_s:g} s")
        except TransportError as exc:
            if ref is not None:
                if exc.sent:
                    led.orphan(ref, generation_id=gen["id"], note=f"transport error: {exc}"[:200])
                else:
                    led.settle(ref, 0.0, note="not sent")
            if conn.timed_out:
                return Outcome("retry", f"timeout after {self.cs.timeout_s:g} s (before the request was sent: {exc})")
            return Outcome("retry", f"transport error ({exc})")
        except asyncio.CancelledError:
            if ref is not None:
                led.orphan(ref, generation_id=gen["id"], note="cancelled in flight")
            raise
        status = resp.status
        text = resp.body.decode("utf-8", errors="replace")
        ans = interpret(self.work.settings.backend, self.native, status, text)
        gid = gen["id"] or ans.generation_id

        def settle(cost: float, **extra: Any) -> None:
            if ref is not None:
                led.settle(ref, cost, generation_id=gid, provider=ans.provider, prompt_tokens=ans.prompt_tokens,
                           completion_tokens=ans.completion_tokens, **extra)

        if status in FINAL_STATUSES_FATAL and self.work.settings.backend == "openrouter":
            settle(0.0, note=f"HTTP {status}")
            return Outcome("fatal", f"{FINAL_STATUSES_FATAL[status]}: {ans.problem}")
        if ans.ok or (status != 200 and not _retryable_status(status)):
            cost = ans.cost
            if cost is None:
                cost = self.price.cost(ans.prompt_tokens or 0, ans.completion_tokens or 0) if ans.ok else 0.0
            settle(cost)
            if ans.ok:
                self.cost += cost
                self.prompt_tokens += ans.prompt_tokens or 0
                self.completion_tokens += ans.completion_tokens or 0
                self.progress.cost += cost
                self.progress.completion_tokens += ans.completion_tokens or 0
                if cost > self.reserve_usd[item.cache_key] + 1e-12:
                    self.over_reservation += 1
            rec = {"id": item.id, "prompt_id": item.prompt_id, "sample_index": item.sample_index, "status": status,
                   "url": self.cs.url, "cache_key": item.cache_key, "backend": self.cs.backend, "started_at": started,
                   "elapsed_s": round(time.monotonic() - t0, 3), "attempts": attempt, "generation_id": gid,
                   "token_ids": ans.extra.get("token_ids"),
                   **{k: ans.extra[k] for k in ("prompt_token_ids", "token_ids_info") if k in ans.extra},
                   "ledger_ref": ref, "cost": cost, "provider": ans.provider}
            if "messages" not in item.request:  # native SGLang: the same request in chat form
                rec["chat_request"] = item.chat_request
            head = _JSON.encode(rec)
            line = f'{head[:-1]},"request":{item.body_json},"response_raw":{_JSON.encode(text)}}}\n'.encode("utf-8")
            return Outcome("ok" if ans.ok else "final", ans.problem, line=line, status=status)
        # retryable
        if status != 200:
            settle(0.0, note=f"HTTP {status}")
            retry_after = retry_after_seconds(resp.headers.get("retry-after"))
            if status == 429 and retry_after:
                self.gate.hold(retry_after)
            return Outcome("retry", ans.problem, retry_after=retry_after, status=status)
        if ans.cost is not None:
            settle(ans.cost, note=ans.problem[:200])
        elif ans.where in ("stream", "finish", "malformed") and ref is not None:
            # cut mid-stream, or a body that does not parse: the model may have generated (and the
            # provider billed) it, so it stays held until reconciled (by generation id when known)
            led.orphan(ref, generation_id=gid, note=f"{ans.where} failure without a cost: {ans.problem}"[:200])
        else:  # an error object in a 200 body: not billed
            settle(0.0, note=ans.problem[:200])
        return Outcome("retry", ans.problem, status=status)


# ----------------------------------------------------------------------------------------------
# Reconciliation over HTTP (OpenRouter's /generation and /key; the stand-in has both)


async def _get_json(conn: Any, url: str, headers: Mapping[str, str], timeout: float) -> tuple[int, Any]:
    resp = await asyncio.wait_for(conn.request("GET", Endpoint.parse(url), headers, b""), timeout)
    try:
        return resp.status, json.loads(resp.body.decode("utf-8", "replace") or "null")
    except ValueError:
        return resp.status, None


async def reconcile_generations(ledger: Any, api_base: str, headers: Mapping[str, str], dataset: str | None = None,
                                timeout: float = 10.0, limit: int = 2000) -> dict[str, int]:
    """Settle orphans that have a generation id from ``GET {api_base}/generation?id=``
    (``total_cost``). Unknown ids (404: the request was never billed, or not yet visible) stay."""
    from urllib.parse import quote

    rows = [r for r in ledger.orphans(dataset, with_generation_id=True) if (r["api_base"] or api_base) == api_base][:limit]
    done = missing = 0
    if not rows:
        return {"checked": 0, "settled": 0, "unknown": 0}
    ep = Endpoint.parse(api_base)
    conn = Connection(ep.scheme, ep.host, ep.port, connect_timeout=timeout)
    try:
        for r in rows:
            try:
                status, body = await _get_json(conn, f"{api_base}/generation?id={quote(r['generation_id'])}", headers, timeout)
            except (TransportError, asyncio.TimeoutError):
                conn.close()
                missing += 1
                continue
            data = (body or {}).get("data") if isinstance(body, dict) else None
            if status == 200 and isinstance(data, dict) and isinstance(data.get("total_cost"), (int, float)):
                done += ledger.settle(r["ref"], float(data["total_cost"]), provider=data.get("provider_name"),
                                      prompt_tokens=data.get("native_tokens_prompt"),
                                      completion_tokens=data.get("native_tokens_completion"),
                                      note="reconciled from /generation")
            else:
                missing += 1
    finally:
        conn.close()
    return {"checked": len(rows), "settled": done, "unknown": missing}


async def key_usage(api_base: str, headers: Mapping[str, str], timeout: float = 10.0) -> float | None:
    """The key's usage (USD) from ``GET {api_base}/key``; ``None`` when unavailable."""
    ep = Endpoint.parse(api_base)
    conn = Connection(ep.scheme, ep.host, ep.port, connect_timeout=timeout)
    try:
        status, body = await _get_json(conn, f"{api_base}/key", headers, timeout)
    except (TransportError, asyncio.TimeoutError):
        return None
    finally:
        conn.close()
    data = body.get("data") if isinstance(body, dict) else None
    if status == 200 and isinstance(data, dict) and isinstance(data.get("usage"), (int, float)):
        return float(data["usage"])
    return None


# ----------------------------------------------------------------------------------------------
# Entry points


def _auth_headers(backend: str, dataset: str) -> dict[str, str]:
    headers = {"X-Title": "eagledata"}
    if backend == "openrouter":
        key = os.environ.get(API_KEY_ENV)
        if not key:
            raise GenerationError(f"dataset {dataset!r} uses backend openrouter: set {API_KEY_ENV} in the environment")
        headers["Authorization"] = f"Bearer {key}"
    return headers


def _never_failing(log: Log) -> Log:
    """``log``, falling back to stderr when its file cannot be written: a full disk must not keep
    the job from saving the answers it was paid for."""

    def safe(message: str) -> None:
        try:
            log(message)
        except OSError:
            try:
                _stderr_log(message)
            except OSError:
                pass

    return safe


async def take_cache_lock(config: Mapping[str, Any], dataset: str, log: Log) -> Any:
    """The dataset's cache writer lock (:mod:`eagledata.generate.cachelock`), waited for; a timeout is a
    :class:`GenerationError` naming the holder."""
    try:
        return await acquire_writer_lock(config["cache_dir"], dataset, lock_wait_s(dataset_generation(config, dataset)), log)
    except CacheLockTimeout as exc:
        raise GenerationError(f"generate {dataset}: {exc}") from None


def import_rescued_answers(cache: ResponseCache, dataset: str, log: Log) -> int:
    """Answers an earlier job saved in rescue files (its cache disk was full) go into the cache
    before anything is sent; raises :class:`GenerationError` (nothing sent) while the cache
    refuses them."""
    files = find_rescue_files(cache.path, dataset)
    if not files:
        return 0
    try:
        n = cache.import_rescued(files)
    except OSError as exc:
        cache.close()
        raise GenerationError(
            f"generate {dataset}: paid answers saved in {', '.join(map(str, files))} could not be imported into the "
            f"cache {cache.path} ({exc.strerror or exc}; {free_space(cache.path)}); nothing was sent: free space on "
            "the cache's disk and rerun") from None
    log(f"imported {n} paid answer(s) from {', '.join(map(str, files))} into {cache.path} before any request "
        "(the rescue files are deleted)")
    return n


async def keep_paid_answers(cache: ResponseCache, wait_s: float, log: Log) -> str:
    """After the requests: make every answer received durable. Answers that a failed write left
    in memory are written to the cache as soon as it takes them (retried with backoff for
    ``wait_s``), else stay in the rescue file, which the next run imports before it sends
    anything. Returns what happened to them, for the stop message ("" when nothing failed);
    raises :class:`GenerationError` when neither the cache nor a rescue directory takes them."""
    cache.sync()
    if not cache.pending:
        return ""
    n, deadline, delay, noted = len(cache.pending), time.monotonic() + wait_s, 0.25, 0.0
    while True:
        try:
            cache.write_pending()
        except OSError as exc:
            now = time.monotonic()
            if now + delay > deadline:
                break
            if now - noted >= 5.0:
                noted = now
                log(f"{n} paid answer(s) kept in memory: {cache.path} refuses them ({exc.strerror or exc}; "
                    f"{free_space(cache.path)}); retrying for {deadline - now:.0f} s more")
            await asyncio.sleep(delay)
            delay = min(2 * delay, 5.0)
            continue
        log(f"{n} paid answer(s) kept in memory are now written to {cache.path} (space came back)")
        return f"the {n} answer(s) kept in memory were written to the cache once space came back"
    where = cache.rescue_all()
    log(f"{n} paid answer(s) saved in {where}: the next run imports them into the cache before sending anything")
    return (f"{n} paid answer(s) received are saved in {where}, not in the cache; the next run imports them "
            "before it sends anything: free space on the cache's disk, then rerun")


def answer_wait_s(cs: ClientSettings, t_run: float) -> float:
    """How long kept answers wait for space: what is left of the job timeout, else ``drain_timeout_s``."""
    if cs.job_timeout_s is not None:
        return max(0.0, cs.job_timeout_s - (time.monotonic() - t_run))
    return cs.drain_timeout_s


async def generate_dataset_async(config: Mapping[str, Any], dataset: str, output_path: str | Path,
                                 log: Log = _stderr_log, summary_path: str | Path | None = None,
                                 progress_stream: Any = None) -> dict[str, Any]:
    """See :func:`generate_dataset`. The dataset's cache lock, taken before the cache is read, is
    held until the job ends."""
    held: list[Any] = []
    try:
        return await _generate_locked(config, dataset, output_path, _never_failing(log), summary_path,
                                      progress_stream, held)
    finally:
        for lock in held:
            lock.release()


async def _generate_locked(config: Mapping[str, Any], dataset: str, output_path: str | Path, log: Log,
                           summary_path: str | Path | None, progress_stream: Any, held: list[Any]) -> dict[str, Any]:
    """See :func:`generate_dataset`; appends the cache lock it takes to ``held``."""
    from eagledata.generate.plan import PromptEstimator, load_estimator, price_bound
    from eagledata.generate.progress import Progress

    t_start = time.monotonic()
    config = validate_config(copy.deepcopy(dict(config)))
    s = dataset_settings(config, dataset)
    if s.imported or not s.prompts:
        raise GenerationError(f"dataset {dataset!r} has 'responses:' (imported); it is not generated")
    g = s.generation
    if s.backend == "sglang" and normalized_api_base(s) == DEFAULT_API_BASE.removesuffix("/v1"):
        raise GenerationError(f"dataset {dataset!r} uses backend sglang: set generation.api_base to the SGLang server "
                              "(e.g. http://127.0.0.1:30000)")
    headers = _auth_headers(s.backend, dataset)
    tokenizer = None
    native = s.backend == "sglang" and g.get("sglang_endpoint") == "generate"
    if s.backend == "simulator" or native:  # the requests themselves need it (cache keys, prompt ids)
        from eagledata.generate.preflight import checked_tokenizer

        tokenizer = checked_tokenizer(config, s)  # found and self-checked, or a PreflightError naming the path
    work = dataset_work(config, dataset, tokenizer)
    items = work.items
    held.append(await take_cache_lock(config, dataset, log))
    cache = ResponseCache(Path(config["cache_dir"]) / dataset / "responses.jsonl", dataset)
    index = cache.load()
    if cache.skipped_lines:
        log(f"warning: {cache.path}: {cache.skipped_lines} unreadable line(s) ignored (those requests are sent again)")
    import_rescued_answers(cache, dataset, log)
    todo: dict[str, WorkItem] = {}
    for it in items:
        if it.cache_key not in index:
            todo.setdefault(it.cache_key, it)
    n_cached = sum(1 for it in items if it.cache_key in index)
    log(f"generate {dataset}: {len(work.prompts)} prompts, {len(items)} samples; {n_cached} cached in {cache.path}, "
        f"{len(todo)} to request ({s.backend}, model {s.api_model})")
    if todo:  # before the ledger is opened and the first request is sent (eagledata.generate.preflight)
        from eagledata.generate.preflight import preflight

        checked = preflight(config, s, work.prompts, todo.values(), cache.path, output_path, tokenizer)
        tokenizer = checked.tokenizer
        log(checked.summary(dataset))

    ledger = BudgetLedger(ledger_path(config["cache_dir"]))
    server = None
    job: GenerationJob | None = None
    summary: dict[str, Any] = {"dataset": dataset, "backend": s.backend, "model": s.api_model}
    reconciled: dict[str, Any] = {}
    try:
        rec = ledger.recover(dataset, cache.refs)
        if rec["dead"] or rec["recovered"]:
            log(f"budget ledger: {rec['dead']} reservation(s) of dead processes orphaned, {rec['recovered']} settled "
                "from the response cache")
        api_base = work.api_base
        if todo and s.backend == "simulator":
            from eagledata.standin.server import SimulatorServer

            sim = config.get("simulator") or {}
            server = SimulatorServer(tokenizer, s.family, seed=int(sim.get("seed", 0)), profile=sim.get("provider", "exact"),
                                     latency_ms=float(sim.get("latency_ms", 0)),
                                     price_per_mtok=s.model.get("price_per_mtok")).start()
            api_base = server.base_url
            work.url = api_base + "/chat/completions"
        if s.backend in ("openrouter",) and ledger.orphans(dataset, with_generation_id=True):
            reconciled["start"] = await reconcile_generations(ledger, api_base, headers, dataset)
            log(f"budget ledger: orphaned reservations reconciled from /generation: {reconciled['start']}")
        if todo and s.backend == "openrouter":
            usage = await key_usage(api_base, headers)
            if usage is not None:
                ledger.add_key_snapshot(api_base, usage)
        price = price_bound(s)
        if todo:
            estimator = PromptEstimator(tokenizer) if tokenizer is not None else load_estimator(config, s)
            max_tokens = int(g.get("max_tokens", 4096))
            reserve: dict[str, float] = {}
            per_prompt: dict[str, int] = {}  # samples of one prompt share the estimate
            for key, it in todo.items():
                if it.prompt_id not in per_prompt:
                    per_prompt[it.prompt_id] = estimator.count(it.chat_request.get("messages"), it.chat_request.get("tools"),
                                                               it.chat_request.get("reasoning"))[1]
                reserve[key] = price.cost(per_prompt[it.prompt_id], max_tokens)
            if price.prompt == price.completion == 0 and s.backend == "openrouter" and config.get("budget_usd") is not None:
                log(f"warning: {dataset}: price_per_mtok is 0, so reservations are $0 and budget_usd only counts settled "
                    "costs: set models.<name>.price_per_mtok (or generation.provider.max_price) for a hard cap")
            session = LedgerSession(ledger, dataset, config.get("budget_usd"), config["datasets"][dataset].get("budget_usd"),
                                    {"backend": s.backend, "model": s.api_model,
                                     "api_base": None if s.backend == "simulator" else api_base})
            cs = ClientSettings.from_generation(g, work.url, s.backend, headers)
            progress = Progress(f"generate {dataset}", len(todo), log, stream=progress_stream)
            cache.open()
            job = GenerationJob(work, list(todo.values()), cs, cache, session, progress, log, reserve, price)
            cache.on_write_error = lambda what: job.write_failed(f"cache write failed: {what}")
            session.on_error = lambda exc: job.write_failed(ledger_write_error(ledger.path, exc))
            t_run, c_run = time.monotonic(), time.process_time()
            try:
                await job.run()
            finally:
                job.run_s, job.run_cpu_s = time.monotonic() - t_run, time.process_time() - c_run
                try:
                    await session.close()
                except LEDGER_WRITE_ERRORS as exc:
                    job.write_failed(ledger_write_error(ledger.path, exc))
                saved = await keep_paid_answers(cache, answer_wait_s(cs, t_run), log)
                if saved:
                    job.stop_reason = f"{job.stop_reason}; {saved}"
                if progress.done != progress.total:
                    progress.update(force=True)
                progress.close()
            if job.over_reservation:
                log(f"warning: {job.over_reservation} response(s) cost more than their reserved worst case: "
                    f"{price.source} is below the real price; raise it so the budget stays a hard cap")
            if s.backend in ("openrouter", "simulator") and ledger.orphans(dataset, with_generation_id=True):
                reconciled["end"] = await reconcile_generations(ledger, api_base, headers, dataset, timeout=5.0)
    finally:
        try:
            cache.close()
        finally:
            if server is not None:
                server.stop()
            totals = ledger.totals().get(dataset, {"spent": 0.0, "held": 0.0})
            ledger.close()

    elapsed = time.monotonic() - t_start
    summary.update({"samples": len(items), "cached": n_cached, "requested": len(todo),
                    "http_requests": job.http_requests if job else 0,
                    "ok": job.progress.ok if job else 0,
                    "errors": ([{**e, "final": True} for e in job.final_errors]
                               + [{"id": k, "error": v, "final": False} for k, v in job.failures.items()]) if job else [],
                    "cost_usd": round(job.cost, 6) if job else 0.0,
                    "prompt_tokens": job.prompt_tokens if job else 0, "completion_tokens": job.completion_tokens if job else 0,
                    "ledger": {"spent_usd": round(totals["spent"], 6), "held_usd": round(totals["held"], 6),
                               "reconciled": reconciled},
                    "elapsed_s": round(elapsed, 3), "request_phase_s": round(job.run_s, 3) if job else 0.0,
                    "request_phase_cpu_s": round(job.run_cpu_s, 3) if job else 0.0,
                    "samples_per_s": round(len(todo) / elapsed, 2) if todo else None,
                    "completion_tokens_per_s": round(job.completion_tokens / elapsed, 1) if job else None,
                    "stopped": (job.stop_reason or job.interrupt) if job else None,
                    "output": str(output_path), "cache": str(cache.path)})
    try:
        write_json_atomic(Path(config["cache_dir"]) / dataset / "generation_summary.json", summary)
    except OSError as exc:
        log(f"warning: generation summary not written beside the cache ({exc.strerror or exc}; "
            f"{free_space(config['cache_dir'])})")
    if job is not None and job.interrupt is not None:
        raise Interrupted(f"generate {dataset} interrupted ({job.interrupt}): {len(job.finished)} response(s) received "
                          f"this run; {len(cache.index)} cached in {cache.path} (consistent); a rerun requests only "
                          "the rest.", job.signum)
    if job is not None and job.stop_reason is not None:
        raise JobStopped(f"generate {dataset} stopped: {job.stop_reason}. {len(cache.index)} responses are cached in "
                         f"{cache.path} and will not be requested again; fix the cause and rerun.")
    if job is not None and job.failures:
        shown = "\n".join(f"  {i}: {p}" for i, p in list(job.failures.items())[:20])
        more = f"\n  ... and {len(job.failures) - 20} more" if len(job.failures) > 20 else ""
        raise GenerationError(f"generate {dataset}: {len(job.failures)} request(s) still failing after "
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
    summary["samples"] = n_written
    summary["final_errors"] = len(error_ids)
    summary["final_error_ids"] = error_ids
    if summary_path is not None:
        write_json_atomic(summary_path, summary)
    if error_ids:
        log(f"warning: {len(error_ids)} sample(s) answered with a final (non-retryable) HTTP error, kept in the "
            f"output with status and body: {', '.join(error_ids[:10])}{' ...' if len(error_ids) > 10 else ''}")
    log(f"generate {dataset}: wrote {n_written} records to {output_path} ({len(todo)} requested, "
        f"{summary['http_requests']} HTTP requests, ${summary['cost_usd']:.4f}, {elapsed:.1f} s)")
    return summary


def _output_record(rec: dict[str, Any], item: WorkItem, error_ids: list[str]) -> dict[str, Any]:
    """A cached record as this run's output record: ids from the current prompt file."""
    rec.update(id=item.id, prompt_id=item.prompt_id, sample_index=item.sample_index)
    if rec.get("status") != 200:
        error_ids.append(item.id)
    out = {k: rec.get(k) for k in RECORD_FIELDS}
    out.update({k: rec[k] for k in OPTIONAL_FIELDS if rec.get(k) is not None})
    return out


def generate_dataset(config: Mapping[str, Any], dataset: str, output_path: str | Path, log: Log = _stderr_log,
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
    outside Snakemake (same code path as the rule)."""
    from eagledata.config import ConfigError, load_config
    from eagledata.generate.prompts import PromptFileError

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
    except (GenerationError, PromptFileError, ConfigError) as exc:
        print(f"eagledata generate: {exc}", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------------------------
# Import of existing responses



def read_response_records(path: str | Path, dataset: str) -> Iterator[dict[str, Any]]:
    """Validate a responses file in the recorded format (``request``, ``status``,
    ``response_raw``; ``id`` optional, default ``<dataset>-<line:06d>``) and yield output records.
    Extra fields (``source``, ``recorded``, ...) are kept."""
    path = Path(path)
    seen: dict[str, int] = {}
    for lineno, where, rec in iter_json_lines(path, ResponsesFileError, "responses file"):
        rec = normalize_response_line(rec)
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


if __name__ == "__main__":
    # run the importable module's main, so errors raised by other modules (eagledata.generate.preflight's,
    # subclasses of eagledata.generate.job.GenerationError) are the classes main catches, not __main__'s
    from eagledata.generate.job import main as _main

    sys.exit(_main())

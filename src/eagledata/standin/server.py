"""A local stand-in for OpenRouter's chat-completions API (and for a local SGLang server), with ground truth.

:class:`SimulatorServer` is a real HTTP server on loopback (asyncio, on a background thread) speaking

* ``POST /api/v1/chat/completions``: JSON bodies (headers with ``X-Generation-Id`` and OpenRouter's
  leading whitespace padding first, the body after the latency) and SSE streams (``: OPENROUTER
  PROCESSING`` comments, ``data: {chunk}`` lines shaped like the recorded traffic, ``data: [DONE]``);
* ``GET /api/v1/generation?id=``: OpenRouter's generation stats (native token counts, cost);
* ``GET /api/v1/key``: the key's usage (everything the stand-in billed);
* ``GET /_sim/truth?id=``: the ground truth, i.e. the exact completion token ids and their segments;
* ``GET /_sim/counters``: what the stand-in was asked and billed (``requests_total``,
  ``requests_per_prompt`` keyed by :func:`prompt_hash`, ``billed_usd``, ...; see
  :meth:`SimulatorServer.counters`), so a test or a user outside its process can prove "each prompt
  paid once";
* with ``api="sglang"``: SGLang's ``POST /v1/chat/completions`` (``return_token_ids``) and native
  ``POST /generate`` (``input_ids`` -> ``output_ids``, ``meta_info``) instead of the OpenRouter routes.

Every completion is made as TOKEN IDS FIRST (:class:`~eagledata.standin.model.CompletionModel`),
then a :class:`~eagledata.standin.profiles.ProviderProfile` may change the ids (quirks of the served
model), the response fields are DECODED from the ids, as a serving stack does, and the profile's
response quirks apply on top; the bodies are built by :mod:`eagledata.standin.responses`.

Faults (HTTP errors with ``Retry-After``, errors inside 200 bodies, mid-stream error chunks, hangs,
dropped and reset connections, malformed bodies) are injected per request number or by a callable;
see :class:`~eagledata.standin.faults.Fault`. Cost accounting: every generation is billed at
``price_per_mtok`` (``billed_usd``); errors inside 200 bodies are not billed, streams cut mid-way half.

Run it from a shell with ``python -m eagledata.standin`` (:mod:`eagledata.standin.cli`).
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import replace
from typing import Any, Mapping, Sequence
from urllib.parse import parse_qs, urlparse

from eagledata.eventloop import new_event_loop
from eagledata.generate.prompts import canonical_json, sha256_hex
from eagledata.standin.faults import ERROR_MESSAGES, HTTP_REASONS, Fault, FaultPlan, error_body, sglang_error_body
from eagledata.standin.model import Completion, CompletionModel, RequestError, generation_key, request_max_tokens
from eagledata.standin.profiles import ProviderProfile, QuirkContext, count_noise, decode_completion, get_profile
from eagledata.standin.responses import (
    Generation,
    Memo,
    SharedAnswer,
    dumps,
    json_body,
    prompt_hash,
    sglang_aborted,
    sglang_chat_body,
    sglang_chat_engine_request,
    sglang_generate_body,
    pace_events,
    sse_stream,
)
from eagledata.text.chat import ChatTemplateError
from eagledata.text.families import ModelFamily
from eagledata.text.tokenizer import Tokenizer

API_PREFIX = "/api/v1"
_ID_RNG = random.Random()  # generation ids: unique, not secret
PROCESSING_COMMENT = ": OPENROUTER PROCESSING"


class SimulatorServer:
    """The stand-in server; see the module docstring. Use as a context manager::

        with SimulatorServer(tok, family, seed=7) as sim:
            httpx.post(sim.base_url + "/chat/completions", json=body)

    ``api``: ``openrouter`` (``/api/v1/chat/completions``, ``/api/v1/generation``, ``/api/v1/key``)
    or ``sglang`` (SGLang's ``/v1/chat/completions`` with ``return_token_ids`` and its native
    ``/generate``; see :func:`~eagledata.standin.responses.sglang_chat_body` and
    :func:`~eagledata.standin.responses.sglang_generate_body`);
    ``sglang_trim_stop``: the SGLang stand-in leaves the matched stop id out of the returned ids;
    ``sglang_prompt_echo``: its output ids start with the prompt's last N ids (5 in SGLang releases
    whose detokenizer returned its decode window); ``sglang_chat_token_ids=False``: its chat endpoint
    ignores ``return_token_ids``, as SGLang did before sgl-project/sglang#30917 (see
    :func:`~eagledata.standin.responses.sglang_output_ids`). ``price_per_mtok``: ``{"prompt": usd, "completion": usd}`` per million
    tokens (or a pair). ``faults``: ``{request_number: Fault | "429" | ...}`` (1-based, over
    completion requests) or a callable ``(request_number, body) -> Fault | str | None``.
    ``latency_ms`` (+ up to ``latency_jitter_ms``) is spent before the answer's body, after its
    headers (with ``X-Generation-Id``) and OpenRouter's keep-alive padding. ``paced_streams``: an SSE
    stream is spread over that latency instead of sent whole after it: the first chunk after
    ``first_token_ms`` (default: a tenth of the latency), then chunks of a few tokens at the constant
    rate that ends the stream at the latency, the chunks due within ``stream_write_ms`` in one write
    (the bytes are those of the unpaced stream; see
    :func:`~eagledata.standin.responses.pace_events`). Truth and stats are kept
    for the last ``max_generations`` responses. Extra keyword arguments go to
    :class:`CompletionModel` (``reasoning_tokens``, ``content_tokens``: (min, max) target lengths;
    ``tool_call_probability``).

    Counters: ``requests_total``, ``request_counts`` (per :func:`prompt_hash`), ``authorizations``
    (per Authorization header), ``billed_usd`` (total charged: the key's usage), ``in_flight`` and
    ``max_in_flight`` (requests being answered).
    The server runs an asyncio loop on a background thread.
    """

    def __init__(self, tokenizer: Tokenizer, family: ModelFamily, seed: int = 0,
                 profile: str | ProviderProfile = "exact", latency_ms: float = 0,
                 price_per_mtok: Mapping[str, float] | Sequence[float] | None = None,
                 faults: FaultPlan = None, host: str = "127.0.0.1", port: int = 0,
                 max_generations: int = 50_000, api: str = "openrouter", sglang_trim_stop: bool = False,
                 sglang_prompt_echo: int = 0, sglang_chat_token_ids: bool = True,
                 latency_jitter_ms: float = 0, paced_streams: bool = False, first_token_ms: float | None = None,
                 stream_write_ms: float = 20, model_path: str = "simulator", **model_options: Any):
        if api not in ("openrouter", "sglang"):
            raise ValueError(f"api must be 'openrouter' or 'sglang', got {api!r}")
        self.engine = CompletionModel(tokenizer, family, seed, **model_options)
        self.tokenizer, self.family, self.seed = tokenizer, family, seed
        self.profile = get_profile(profile)
        self.latency_ms, self.latency_jitter_ms = latency_ms, latency_jitter_ms
        self.paced_streams, self.first_token_ms, self.stream_write_ms = paced_streams, first_token_ms, stream_write_ms
        self.api, self.sglang_trim_stop = api, sglang_trim_stop
        self.model_path = model_path  # what GET /get_model_info reports (SGLang's --model-path)
        self.sglang_prompt_echo, self.sglang_chat_token_ids = sglang_prompt_echo, sglang_chat_token_ids
        if price_per_mtok is None:
            price_per_mtok = {"prompt": 0.6, "completion": 2.5}
        if not isinstance(price_per_mtok, Mapping):
            price_per_mtok = {"prompt": price_per_mtok[0], "completion": price_per_mtok[1]}
        self.price = {"prompt": float(price_per_mtok.get("prompt", 0)), "completion": float(price_per_mtok.get("completion", 0))}
        self.faults = faults
        self.host, self.port = host, port
        self.request_counts: Counter[str] = Counter()
        self.requests_total = 0
        self.authorizations: Counter[str] = Counter()
        self.billed_usd = 0.0
        self.in_flight = 0
        self.max_in_flight = 0
        self.generations: OrderedDict[str, Generation] = OrderedDict()  # newest last, bounded
        self.max_generations = max_generations
        self._memo = Memo(4096)
        self._raw_memo = Memo(4096)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[_Connection] = set()

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """OpenRouter mode: ``.../api/v1``; SGLang mode: ``.../v1`` (OpenAI-compatible base)."""
        return self.root_url + (API_PREFIX if self.api == "openrouter" else "/v1")

    def start(self) -> "SimulatorServer":
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = new_event_loop()  # uvloop when installed: less CPU, latency closer to the configured one
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    loop.create_server(lambda: _Connection(self), self.host, self.port, backlog=1024))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # noqa: BLE001 - reported to start()
                errors.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name=f"simulator:{self.port}", daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            raise errors[0]
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for c in list(self._connections):
                if c.transport is not None:
                    c.transport.abort()
            for t in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                t.cancel()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=5)
        except Exception:  # noqa: BLE001 - already stopping
            pass
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=5)
        self._thread = None
        self._loop = None
        self._server = None

    def __enter__(self) -> "SimulatorServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- queries --------------------------------------------------------------------------------
    def truth(self, generation_id: str) -> dict[str, Any] | None:
        g = self.generations.get(generation_id)
        if g is None:
            return None
        return {"id": g.id, "provider": g.provider, **g.completion.to_dict()}

    def generation_stats(self, generation_id: str) -> dict[str, Any] | None:
        g = self.generations.get(generation_id)
        if g is None:
            return None
        u = g.usage
        return {"data": {
            "id": g.id, "created_at": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(g.created)),
            "model": g.model, "provider_name": g.provider, "streamed": g.streamed, "cancelled": False,
            "total_cost": g.billed, "usage": g.billed, "is_byok": False,
            "tokens_prompt": u["prompt_tokens"], "tokens_completion": u["completion_tokens"],
            "native_tokens_prompt": u["prompt_tokens"], "native_tokens_completion": u["completion_tokens"],
            "native_tokens_reasoning": u["completion_tokens_details"]["reasoning_tokens"],
            "finish_reason": g.message.finish_reason, "native_finish_reason": g.message.native_finish_reason,
            "latency": int(g.latency_ms), "generation_time": int(g.latency_ms),
        }}

    def counters(self) -> dict[str, Any]:
        """One consistent snapshot of the counters (``GET /_sim/counters``): ``requests_total``
        (completion requests received, faults included), ``requests_per_prompt`` (:func:`prompt_hash`
        -> requests), ``billed_usd`` (total charged, = the key's usage), ``generations`` (answers
        made), ``in_flight``/``max_in_flight``, ``keys`` (distinct Authorization headers; the keys
        themselves are never shown)."""
        with self._lock:
            return {"requests_total": self.requests_total, "requests_per_prompt": dict(self.request_counts),
                    "billed_usd": round(self.billed_usd, 12), "generations": len(self.generations),
                    "in_flight": self.in_flight, "max_in_flight": self.max_in_flight, "keys": len(self.authorizations)}

    def key_info(self) -> dict[str, Any]:
        return {"data": {"label": "sk-or-v1-sim...", "usage": round(self.billed_usd, 12), "limit": None,
                         "limit_remaining": None, "is_free_tier": False, "is_provisioning_key": False}}

    # -- request handling -----------------------------------------------------------------------
    def _register(self, body: Mapping[str, Any], auth: str | None, phash: str | None = None) -> tuple[int, Fault | None]:
        with self._lock:
            self.requests_total += 1
            n = self.requests_total
            self.request_counts[phash or prompt_hash(body)] += 1
            if auth:
                self.authorizations[auth] += 1
        plan = self.faults
        spec = plan(n, body) if callable(plan) else (plan or {}).get(n)
        return n, (Fault.parse(spec) if spec else None)

    def truth_of(self, body: Mapping[str, Any]) -> Completion:
        """The ground truth for a request body as this server answers it (the profile's model
        quirks applied): what ``/_sim/truth`` reports for any answer to ``body``."""
        return self._truth_for(body)

    def _truth_for(self, body: Mapping[str, Any]) -> Completion:
        """The completion (with the profile's model quirks), memoised by request content."""
        native = "messages" not in body and "input_ids" in body
        if native:
            sp = body.get("sampling_params") or {}
            key = ("ids", canonical_json(body.get("input_ids")), canonical_json(sp))
            make = lambda: self.engine.complete_ids(body["input_ids"], sp.get("max_new_tokens"), sp)  # noqa: E731
        else:
            key = ("chat", generation_key(body, self.seed), request_max_tokens(body))
            make = lambda: self.engine.complete(body)  # noqa: E731

        def build() -> Completion:
            c = make()
            gk = key[1] if not native else sha256_hex(key[1] + key[2])
            ctx = QuirkContext(random.Random(gk), self.family, body, self.tokenizer)
            for hook in self.profile.completion_hooks:
                c = hook(c, ctx)
            return c

        return self._memo.get_or(key, build)

    def _base(self, body: Mapping[str, Any]) -> SharedAnswer:
        """What every answer to this request shares: the truth, the decoded message before the
        response quirks, the usage, and (when no quirk depends on the generation) the serialised
        choices of a JSON answer."""
        completion = self._truth_for(body)
        profile = self.profile
        msg = decode_completion(completion.ids, self.tokenizer, self.family, completion.thinking, completion.finish_reason)
        if profile.reasoning_tokens_include_close and completion.thinking:
            close = self.tokenizer.special_id(self.family.think_close)
            msg.reasoning_tokens += int(close in completion.ids)
        if completion.stopped and not profile.counts_end_of_turn:
            msg.completion_tokens -= 1
        if profile.reasoning_count_noise and msg.reasoning_tokens:
            msg.reasoning_tokens = max(0, msg.reasoning_tokens + count_noise(profile.reasoning_count_noise, prompt_hash(body)))
        pt, ct = len(completion.prompt_ids), msg.completion_tokens
        p_cost, c_cost = pt * self.price["prompt"] / 1e6, ct * self.price["completion"] / 1e6
        usage = {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct,
                 "cost": round(p_cost + c_cost, 12), "is_byok": False,
                 "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                 "cost_details": {"upstream_inference_cost": None, "upstream_inference_prompt_cost": round(p_cost, 12),
                                  "upstream_inference_completions_cost": round(c_cost, 12)},
                 "completion_tokens_details": {"reasoning_tokens": msg.reasoning_tokens, "image_tokens": 0}}
        shared = not profile.hooks and not (isinstance(body.get("reasoning"), Mapping) and body["reasoning"].get("exclude"))
        return SharedAnswer(completion, msg, usage, shared, prompt_hash(body))

    def make_generation(self, body: Mapping[str, Any], raw: bytes | None = None) -> Generation:
        """A new generation (id, truth, message, usage) for ``body``; ``raw`` (the exact request
        bytes) memoises the shared part."""
        base = self._raw_memo.get_or(raw, lambda: self._base(body)) if raw is not None else self._base(body)
        gen_id = f"gen-{int(time.time())}-{_ID_RNG.getrandbits(80):020x}"
        if base.shared:
            msg = base.message
        else:
            msg = replace(base.message, tool_calls=[dict(c) for c in base.message.tool_calls])
            ctx = QuirkContext(random.Random(gen_id), self.family, body, self.tokenizer)
            for hook in self.profile.hooks:
                hook(msg, ctx)
            if isinstance(body.get("reasoning"), Mapping) and body["reasoning"].get("exclude"):
                msg.reasoning = None
        g = Generation(gen_id, int(time.time()), str(body.get("model")), base.completion, msg, base.usage,
                       self.profile.provider_name, bool(body.get("stream")), self.latency_ms, base=base)
        with self._lock:
            self.generations[gen_id] = g
            while len(self.generations) > self.max_generations:
                self.generations.popitem(last=False)
        return g

    def _bill(self, g: Generation, fraction: float = 1.0) -> None:
        with self._lock:
            g.billed = round(g.usage["cost"] * fraction, 12)
            self.billed_usd += g.billed

    # -- the HTTP server (asyncio protocol; every answer is a list of actions) -------------------
    @staticmethod
    def _head(status: int, content_type: str, length: int | None, headers: Mapping[str, str] | None = None) -> bytes:
        lines = [f"HTTP/1.1 {status} {HTTP_REASONS.get(status, 'Status')}", f"Content-Type: {content_type}",
                 "Server: eagledata-simulator/2"]
        lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _send(self, status: int, text: str, content_type: str = "application/json",
              headers: Mapping[str, str] | None = None) -> list[tuple]:
        data = text.encode("utf-8")
        return [("write", self._head(status, content_type, len(data), headers) + data)]

    def _error(self, status: int, message: str, headers: Mapping[str, str] | None = None, raw: str = "") -> list[tuple]:
        body = sglang_error_body(status, message) if self.api == "sglang" \
            else error_body(status, message, self.profile.provider_name, raw)
        return self._send(status, dumps(body), headers=headers)

    def _latency(self) -> float:
        extra = random.uniform(0, self.latency_jitter_ms) if self.latency_jitter_ms else 0.0
        return (self.latency_ms + extra) / 1000

    def respond(self, method: str, target: str, headers: Mapping[str, str], raw: bytes) -> list[tuple]:
        """The answer to one request as actions: ``("write", bytes)``, ``("sleep", s)``,
        ``("mark",)``, ``("until", s)`` (s seconds after the last mark), ``("close",)``, ``("reset",)``."""
        url = urlparse(target)
        if method == "GET":
            gid = (parse_qs(url.query).get("id") or [""])[0]
            if url.path == f"{API_PREFIX}/generation":
                stats = self.generation_stats(gid)
                return self._send(200, dumps(stats)) if stats else self._error(404, f"Generation {gid} not found")
            if url.path == f"{API_PREFIX}/key":
                return self._send(200, dumps(self.key_info()))
            if url.path == "/_sim/counters":
                return self._send(200, dumps(self.counters()))
            if url.path == "/_sim/truth":
                truth = self.truth(gid) or self.truth(f"gen-{gid}")
                return self._send(200, dumps(truth)) if truth else self._error(404, f"Generation {gid} not found")
            if url.path in ("/health", "/health_generate"):
                return self._send(200, "")
            if url.path == "/get_model_info":
                return self._send(200, dumps({"model_path": self.model_path, "is_generation": True}))
            return self._error(404, f"no route {url.path}")
        if method != "POST":
            return self._error(405, f"method {method} not allowed")
        routes = ({f"{API_PREFIX}/chat/completions": "chat"} if self.api == "openrouter"
                  else {"/v1/chat/completions": "chat", "/generate": "generate"})
        kind = routes.get(url.path)
        if kind is None:
            return self._error(404, f"no route {url.path}")
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("body is not a JSON object")
        except (ValueError, UnicodeDecodeError) as exc:
            return self._error(400, f"invalid JSON body: {exc}")
        return self._complete(kind, body, raw, headers)

    def _complete(self, kind: str, body: dict[str, Any], raw: bytes, headers: Mapping[str, str]) -> list[tuple]:
        base = self._raw_memo.get(raw)
        _, fault = self._register(body, headers.get("authorization"), base.prompt_hash if base is not None else None)
        pre: list[tuple] = []
        if fault is not None:
            if fault.kind == "hang":
                pre.append(("sleep", fault.seconds or 3600))
            elif fault.kind == "disconnect":
                return [("close",)]
            elif fault.kind == "reset":
                return [("reset",)]
            elif fault.kind == "http":
                extra = {"Retry-After": f"{fault.retry_after:g}"} if fault.retry_after is not None else None
                return self._error(fault.status, fault.message or ERROR_MESSAGES.get(fault.status, "Error"), extra, fault.raw)
        if kind == "chat" and not body.get("model"):
            return pre + self._error(400, "model is required")
        stream = bool(body.get("stream"))
        if self.api == "sglang" and kind == "chat" and stream and body.get("return_token_ids"):
            return pre + self._error(400, "return_token_ids is not supported with stream=True for chat completions")
        if self.api == "sglang" and kind == "chat":
            body = sglang_chat_engine_request(body)  # the thinking SGLang renders the prompt with
        try:
            g = self.make_generation(body, raw)
        except (RequestError, ChatTemplateError) as exc:
            return pre + self._error(400, str(exc))
        failing = fault is not None and fault.kind in ("error_in_200", "mid_stream", "abort")
        malformed = fault is not None and fault.kind == "malformed"
        no_usage = fault is not None and fault.kind == "no_usage"
        if self.api == "sglang":
            self._bill(g)
            if failing and fault.kind != "abort":
                text = dumps(sglang_error_body(500, fault.message or "Internal server error"))
            else:
                trim, echo = self.sglang_trim_stop, self.sglang_prompt_echo
                text = (sglang_chat_body(g, body, trim, echo, self.sglang_chat_token_ids) if kind == "chat"
                        else sglang_generate_body(g, body, self.tokenizer, trim, echo))
                if malformed:
                    text = text[: len(text) // 2]
                if failing:
                    text = sglang_aborted(text, kind)
            return pre + [("sleep", self._latency())] + self._send(200, text)
        gen_header = {"X-Generation-Id": g.id}
        if not stream:
            self._bill(g, 0.0 if failing else 1.0)
            if failing:
                text = self.profile.json_padding + dumps(error_body(502, fault.message or "Provider returned error", g.provider))
            else:
                text = json_body(g, self.profile.json_padding, usage_shown=not no_usage)
                if malformed:
                    text = text[: len(text) // 2]
            data = text.encode("utf-8")
            pad = len(self.profile.json_padding.encode("utf-8")) if text.startswith(self.profile.json_padding) else 0
            latency = self._latency()
            if latency <= 0:
                return pre + [("write", self._head(200, "application/json", len(data), gen_header) + data)]
            return pre + [("write", self._head(200, "application/json", len(data), gen_header) + data[:pad]),
                          ("sleep", latency), ("write", data[pad:])]
        self._bill(g, 0.5 if failing else 1.0)  # a stream cut mid-way was partly generated: partly billed
        first = self._head(200, "text/event-stream", None, {"Cache-Control": "no-cache", **gen_header})
        events = sse_stream(g, fail_midway=failing, malformed=malformed)
        if no_usage:
            events = events[:-2]  # cut after the finish chunk: no usage chunk, no [DONE]
        opening = [("write", first + self._chunk(PROCESSING_COMMENT + "\n\n"))]
        if not self.paced_streams:
            data = b"".join(self._chunk(f"data: {e}\n\n") for e, _ in events)
            return pre + opening + [("sleep", self._latency()), ("write", data + b"0\r\n\r\n")]
        return pre + opening + self._paced(events)

    def _paced(self, events: list[tuple[str, int]]) -> list[tuple]:
        """A paced stream's actions: the events spread over the response's latency
        (:func:`~eagledata.standin.responses.pace_events`), each group of events due at one time
        in one write, the stream's end with the last."""
        latency = self._latency()
        first = latency / 10 if self.first_token_ms is None else self.first_token_ms / 1000
        times = pace_events([n for _, n in events], latency, first, self.stream_write_ms / 1000)
        actions: list[tuple] = [("mark",)]  # times count from here (after a hang fault, if any)
        now, batch = 0.0, b""
        for (payload, _), at in zip(events, times):
            if at > now and batch:
                actions.append(("write", batch))
                batch = b""
            if at > now:
                actions.append(("until", at))  # from the mark: timer lag does not add up
                now = at
            batch += self._chunk(f"data: {payload}\n\n")
        return actions + [("write", batch + b"0\r\n\r\n")]

    @staticmethod
    def _chunk(text: str) -> bytes:
        data = text.encode("utf-8")
        return b"%x\r\n%s\r\n" % (len(data), data)


class _Connection(asyncio.Protocol):
    """One client connection of the stand-in: parses HTTP/1.1 requests and plays each answer's
    actions in order (timers for the latency, no task per request)."""

    def __init__(self, sim: SimulatorServer):
        self.sim = sim
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.queue: list[tuple[str, str, dict[str, str], bytes]] = []
        self.busy = False
        self.closed = False
        self.timer: asyncio.TimerHandle | None = None
        self.started = 0.0  # loop time of the current answer's last ("mark",)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self.sim._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        if self.busy:
            self.sim.in_flight -= 1
            self.busy = False
        self.sim._connections.discard(self)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buf[:end].decode("latin-1").split("\r\n")
            headers: dict[str, str] = {}
            for line in lines[1:]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            length = int(headers.get("content-length") or 0)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            try:
                method, target, _ = lines[0].split(" ", 2)
            except ValueError:
                self.transport.close()
                return
            self.queue.append((method, target, headers, body))
            self._next()

    def _next(self) -> None:
        if self.busy or not self.queue or self.closed:
            return
        method, target, headers, body = self.queue.pop(0)
        self.busy = True
        self.sim.in_flight += 1
        self.sim.max_in_flight = max(self.sim.max_in_flight, self.sim.in_flight)
        try:
            actions = self.sim.respond(method, target, headers, body)
        except Exception as exc:  # noqa: BLE001 - a bug in the stand-in answers 500, never hangs
            actions = self.sim._send(500, dumps(error_body(500, f"simulator error: {type(exc).__name__}: {exc}")))
        if headers.get("connection", "").lower() == "close":
            actions = actions + [("close",)]
        self._play(actions, 0)

    def _play(self, actions: list[tuple], i: int) -> None:
        self.timer = None
        while i < len(actions) and not self.closed:
            act = actions[i]
            i += 1
            if act[0] == "write":
                self.transport.write(act[1])
            elif act[0] == "mark":
                self.started = asyncio.get_running_loop().time()
            elif act[0] in ("sleep", "until"):
                loop = asyncio.get_running_loop()
                delay = act[1] if act[0] == "sleep" else self.started + act[1] - loop.time()
                if delay > 0:
                    self.timer = loop.call_later(delay, self._play, actions, i)
                    return
            elif act[0] == "close":
                self.transport.close()
                self.closed = True
            elif act[0] == "reset":
                sock = self.transport.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.transport.abort()
                self.closed = True
        if self.busy:
            self.busy = False
            self.sim.in_flight -= 1
        if not self.closed:
            self._next()


if __name__ == "__main__":  # ``python -m eagledata.standin.server``, as before the package split
    import runpy

    runpy.run_module("eagledata.standin", run_name="__main__", alter_sys=True)

"""HTTP for generation and reconciliation, through httpx: one :class:`httpx.AsyncClient` per worker.

Why one client per worker (a pool of one connection each): httpx's connection pool walks every
connection on each request, so one shared client at 1,024 in flight spends a full core on pool
bookkeeping and reaches a small fraction of the latency bound; a client per worker keeps each pool
trivial (about 2 ms of CPU per request measured here against the stand-in). All clients share one
SSL context (the system trust store, which honours ``SSL_CERT_FILE``/``SSL_CERT_DIR``), since loading
the CA store once per client would cost more than the requests. Proxies come from the environment
as httpx reads them (``trust_env``: ``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``, ``NO_PROXY``).
``sniffio`` is a dependency although nothing here imports it: httpcore imports it each time it takes a
lock (several times per request), and recent anyio no longer installs it, so without it each of those
imports fails after searching ``sys.path`` (about 0.5 ms of CPU per request, measured).

What this module adds to httpx, and why:

* **The exact bytes.** The request body is sent as given (``content=``); the response body is the
  bytes received after HTTP framing (``Accept-Encoding: identity`` is asked for and the raw stream is
  read, so nothing is decoded or re-encoded): the response cache stores exactly that.
* **Whether a failed request was sent.** :class:`TransportError` ``.sent`` is ``False`` only when the
  request certainly did not reach the server (the connection could not be made, or failed before the
  request head was written, seen through httpcore's ``trace`` extension), so the budget ledger may
  release its reservation; everything else may have been processed (and billed) and stays held
  until reconciled.
* **One deadline per attempt** (:func:`send` ``timeout``), covering connect, upload and the whole body:
  httpx's own timeouts are per read, so a server trickling a stream would never time out. Past it,
  :class:`AttemptTimeout` (a :class:`TransportError`) is raised; a cut or aborted body is never
  returned as an answer.
* **Streaming callbacks**: ``on_head`` sees the status and headers as soon as they arrive (e.g.
  ``X-Generation-Id``), ``on_data`` every body piece (e.g. an SSE stream's first event).
"""

from __future__ import annotations

import asyncio
import re
import ssl
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import httpx

from eagledata.errors import EagledataError

OnHead = Callable[[int, Mapping[str, str]], None]
OnData = Callable[[bytes], None]


class TransportError(EagledataError):
    """A request failed below HTTP (no complete response). ``sent``: the request may have reached
    the server; ``False`` means it certainly was not processed."""

    def __init__(self, message: str, sent: bool):
        super().__init__(message)
        self.sent = sent


class AttemptTimeout(TransportError):
    """The attempt's deadline passed before the whole response arrived."""


@dataclass
class Response:
    """A complete response: status, headers (lower-case names; repeated ones joined with ", ")
    and the body bytes as received."""

    status: int
    headers: dict[str, str]
    body: bytes = b""


_SSL_CONTEXT: ssl.SSLContext | None = None
_TIMEOUT = getattr(asyncio, "timeout", None)  # one timer, no task per request (3.11+)


def ssl_context() -> ssl.SSLContext:
    """The SSL context every client shares (created once per process, system trust store)."""
    global _SSL_CONTEXT
    if _SSL_CONTEXT is None:
        _SSL_CONTEXT = ssl.create_default_context()
    return _SSL_CONTEXT


def new_client(connect_timeout_s: float = 30.0, headers: Mapping[str, str] | None = None) -> httpx.AsyncClient:
    """A client holding at most one keep-alive connection, for one worker (not for concurrent
    requests: a second request would wait for the first). ``headers`` are sent with every request."""
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
        timeout=httpx.Timeout(None, connect=connect_timeout_s),  # the attempt deadline is send()'s
        verify=ssl_context(), trust_env=True, follow_redirects=False,
        headers={"Accept-Encoding": "identity", **(headers or {})})


class _Progress:
    """How far one request got, from httpcore's trace events."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = False

    async def trace(self, name: str, info: Mapping[str, Any]) -> None:
        if not self.sent and ".send_request_headers." in name:
            self.sent = True


async def send(client: httpx.AsyncClient, method: str, url: str, body: bytes = b"", *,
               headers: Mapping[str, str] | None = None, timeout: float | None = None,
               on_head: OnHead | None = None, on_data: OnData | None = None) -> Response:
    """Send one request and read the whole response (any status: HTTP errors are answers).
    Raises :class:`TransportError` (``sent`` as in the module docstring) on any failure below
    HTTP, :class:`AttemptTimeout` past ``timeout`` seconds; cancellation propagates (the
    connection is dropped)."""
    progress = _Progress()
    exchange = _exchange(client, method, url, body, headers, progress, on_head, on_data)
    try:
        if _TIMEOUT is None:  # Python 3.10
            return await asyncio.wait_for(exchange, timeout)
        async with _TIMEOUT(timeout):
            return await exchange
    except (TimeoutError, asyncio.TimeoutError):
        where = "" if progress.sent else " (before the request was sent)"
        raise AttemptTimeout(f"no complete answer within {timeout:g} s{where}", progress.sent) from None
    except httpx.TransportError as exc:
        raise TransportError(_describe(exc), progress.sent and not isinstance(exc, httpx.ConnectError)) from None


async def _exchange(client: httpx.AsyncClient, method: str, url: str, body: bytes, headers: Mapping[str, str] | None,
                    progress: _Progress, on_head: OnHead | None, on_data: OnData | None) -> Response:
    request = client.build_request(method, url, content=body, headers=headers,
                                   extensions={"trace": progress.trace})
    resp = await client.send(request, stream=True)
    try:
        head = dict(resp.headers.items())
        if on_head is not None:
            on_head(resp.status_code, head)
        parts: list[bytes] = []
        async for piece in resp.aiter_raw():
            parts.append(piece)
            if on_data is not None:
                on_data(piece)
    finally:
        await resp.aclose()
    await _drop_if_desynchronised(client)
    return Response(resp.status_code, head, b"".join(parts))


async def _drop_if_desynchronised(client: httpx.AsyncClient) -> None:
    """Bytes received beyond a response's framing (a server whose ``Content-Length`` understates its
    body) would be read by h11 as the answer to the NEXT request on that connection: close the
    connection instead (a stray CRLF is tolerated). httpx has no public hook for this; the check
    reads h11's public ``trailing_data`` through httpcore's pool and is skipped if that layout
    changes."""
    pool = getattr(getattr(client, "_transport", None), "_pool", None)
    for conn in list(getattr(pool, "connections", ())):
        h11_state = getattr(getattr(conn, "_connection", None), "_h11_state", None)
        trailing = getattr(h11_state, "trailing_data", None)
        if trailing is not None and bytes(trailing[0]).strip(b"\r\n\t "):
            await conn.aclose()


def _describe(exc: httpx.TransportError) -> str:
    """A transport error as text for logs and the ledger, with any credential it quotes (httpx
    quotes a refused header's value) replaced."""
    text = _CREDENTIAL.sub(r"\1[redacted]", str(exc) or type(exc).__name__)
    return text if type(exc).__name__ in text else f"{type(exc).__name__}: {text}"


_CREDENTIAL = re.compile(r"((?:Bearer|Basic)\s+)[^\s'\"]+", re.IGNORECASE)


async def get_json(client: httpx.AsyncClient, url: str, headers: Mapping[str, str], timeout: float) -> tuple[int, Any]:
    """``GET url``: the status and the body as JSON (``None`` when it is not JSON)."""
    import json

    resp = await send(client, "GET", url, headers=headers, timeout=timeout)
    try:
        return resp.status, json.loads(resp.body.decode("utf-8", "replace") or "null")
    except ValueError:
        return resp.status, None

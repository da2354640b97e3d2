"""A small HTTP/1.1 client on an asyncio protocol, one persistent connection per worker.

Why not httpx: its connection pool scans every connection for every request (quadratic in the pool
size); at 256 connections against a 50 ms endpoint it managed about 130 requests/s on one core
here. This client parses responses inside the protocol's ``data_received`` (no stream reader, one
future per request) and sustains concurrency/latency at 256 connections on well under one core
(benchmarks/generation_throughput.py).

Scope, deliberately small: ``http`` and ``https`` (system CA store), keep-alive, request bodies
with ``Content-Length``, response bodies delimited by ``Content-Length``, ``chunked`` encoding or
connection close, 1xx responses skipped. No redirects, cookies, compression or proxies. Every
failure below HTTP is a :class:`TransportError` naming what happened and whether the request may
have reached the server (``sent``).
"""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
from dataclasses import dataclass
from typing import Callable, Mapping
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 65536
MAX_CHUNK_LINE = 4096


class TransportError(Exception):
    """Connection-level failure. ``sent``: the request bytes were written (the server may have
    acted on it); ``False`` means it certainly was not processed (connect failed)."""

    def __init__(self, message: str, sent: bool):
        super().__init__(message)
        self.sent = sent


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    body: bytes = b""


@dataclass(frozen=True)
class Endpoint:
    scheme: str
    host: str
    port: int
    path: str  # path + query of the URL

    @classmethod
    def parse(cls, url: str) -> "Endpoint":
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"unsupported URL {url!r} (http:// or https:// with a host)")
        port = u.port or (443 if u.scheme == "https" else 80)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        return cls(u.scheme, u.hostname, port, path)

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


class RequestHead:
    """A request's start line and headers, serialised once (everything but ``Content-Length``)."""

    def __init__(self, method: str, ep: Endpoint, headers: Mapping[str, str]):
        lines = [f"{method} {ep.path} HTTP/1.1", f"Host: {ep.host_header}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        self.data = ("\r\n".join(lines) + "\r\n").encode("latin-1")


_SSL_CONTEXT: ssl.SSLContext | None = None


def _ssl_context() -> ssl.SSLContext:
    global _SSL_CONTEXT
    if _SSL_CONTEXT is None:
        _SSL_CONTEXT = ssl.create_default_context()
    return _SSL_CONTEXT


class _ProtocolError(Exception):
    """The server's bytes are not HTTP/1.1 as this client reads it."""


_CHUNK_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;.*)?")  # size, optional extensions

def _line_end(buf: bytearray, pos: int, sep: bytes, limit: int, too_long: str) -> int:
    """Where ``sep`` starts in ``buf`` from ``pos``; -1 while it has not arrived yet, as long as
    the bytes waiting for it stay within ``limit`` (else a protocol error, ``too_long``)."""
    end = buf.find(sep, pos)
    if end < 0 and len(buf) - pos > limit:
        raise _ProtocolError(too_long)
    return end


# parser states
_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _TRAILERS, _UNTIL_CLOSE, _IDLE = range(7)


class _ResponseReader(asyncio.Protocol):
    """Reads the responses of one connection, one at a time. :meth:`expect` arms it for the next
    response; its future gets ``(status, headers, body, keep_alive)`` or an exception."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.state = _IDLE
        self.waiter: asyncio.Future | None = None
        self.head_only = False
        self.on_head: Callable[[int, dict[str, str]], None] | None = None
        self.on_data: Callable[[bytes], None] | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.parts: list[bytes] = []
        self.remaining = 0
        self.closed = False
        self.aborted = False  # dropped by this side (Connection.abort): a body cut there is not complete
        self.http10 = False

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        if self.state == _IDLE:
            if data.strip():  # the connection is unusable: the next request connects anew
                self._fail(_ProtocolError(f"unexpected bytes between responses {bytes(data[:60])!r}"))
            return
        self.buf += data
        try:
            self._parse()
        except Exception as exc:  # noqa: BLE001 - a protocol error, or raised by on_head/on_data
            self._fail(exc)

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.state == _UNTIL_CLOSE and exc is None and not self.aborted:
            self._complete(keep_alive=False)  # the server's close ends the body
        elif self.waiter is not None and not self.waiter.done():
            if self.aborted:
                exc = ConnectionError("connection aborted by the client")
            elif exc is None:
                started = self.state != _HEAD or self.buf
                exc = ConnectionError("connection closed by the server" + (" mid-response" if started else ""))
            elif not isinstance(exc, OSError):
                exc = ConnectionError(f"{type(exc).__name__}: {exc}")
            self._fail(exc)

    # -- one response ------------------------------------------------------------------------------
    def expect(self, waiter: asyncio.Future, head_only: bool, on_head: Callable[[int, dict[str, str]], None] | None,
               on_data: Callable[[bytes], None] | None) -> None:
        self.waiter, self.head_only, self.on_head, self.on_data = waiter, head_only, on_head, on_data
        self.parts = []
        self.state = _HEAD
        if self.buf:
            try:
                self._parse()
            except Exception as exc:  # noqa: BLE001 - as in data_received
                self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.state = _IDLE
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    def _complete(self, keep_alive: bool) -> None:
        self.state = _IDLE
        body = b"".join(self.parts)
        self.parts = []
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.status, self.headers, body, keep_alive))

    def _take(self, piece: bytes) -> None:
        if piece:
            self.parts.append(piece)
            if self.on_data is not None:
                self.on_data(piece)

    def _parse(self) -> None:
        """Consume what the buffer holds of the current response (an offset walks the buffer; the
        consumed bytes are dropped once at the end)."""
        buf = self.buf
        pos = 0
        try:
            while True:
                state = self.state
                if state == _HEAD:
                    while buf[pos:pos + 2] == b"\r\n":  # empty lines before a status line are ignored
                        pos += 2
                    end = _line_end(buf, pos, b"\r\n\r\n", MAX_HEADER_BYTES, "response header too large")
                    if end < 0:
                        return
                    raw = bytes(buf[pos:end])
                    pos = end + 4
                    if self._head(raw):
                        continue
                    return
                if state == _LENGTH or (state == _CHUNK_DATA and self.remaining):
                    avail = len(buf) - pos
                    if not avail:
                        return
                    k = min(self.remaining, avail)
                    piece = bytes(buf[pos:pos + k])
                    pos += k
                    self.remaining -= k
                    self._take(piece)
                    if self.remaining:
                        return
                    if state == _LENGTH:
                        self._finish_body()
                        return
                    continue  # the chunk's CRLF
                if state == _CHUNK_DATA:  # chunk consumed: its CRLF
                    if len(buf) - pos < 2:
                        return
                    if buf[pos:pos + 2] != b"\r\n":
                        raise _ProtocolError("malformed chunked body (no CRLF after a chunk)")
                    pos += 2
                    self.state = _CHUNK_SIZE
                    continue
                if state == _CHUNK_SIZE:
                    end = _line_end(buf, pos, b"\r\n", MAX_CHUNK_LINE, "malformed chunked body (chunk size line too long)")
                    if end < 0:
                        return
                    line = bytes(buf[pos:end])
                    m = _CHUNK_SIZE_LINE.fullmatch(line)
                    if m is None:
                        raise _ProtocolError(f"malformed chunked body (chunk size line {line[:40]!r})")
                    size = int(m.group(1), 16)
                    pos = end + 2
                    if size and len(buf) >= pos + size + 2:  # the whole chunk is here: take it in one step
                        if buf[pos + size:pos + size + 2] != b"\r\n":
                            raise _ProtocolError("malformed chunked body (no CRLF after a chunk)")
                        piece = bytes(buf[pos:pos + size])
                        pos += size + 2
                        self._take(piece)
                        continue
                    self.remaining = size
                    self.state = _TRAILERS if size == 0 else _CHUNK_DATA
                    continue
                if state == _TRAILERS:
                    end = _line_end(buf, pos, b"\r\n", MAX_HEADER_BYTES, "chunked trailers too large")
                    if end < 0:
                        return
                    blank = end == pos
                    pos = end + 2
                    if blank:
                        self._finish_body()
                        return
                    continue
                if state == _UNTIL_CLOSE:
                    if len(buf) > pos:
                        piece = bytes(buf[pos:])
                        pos = len(buf)
                        self._take(piece)
                    return
                return  # _IDLE
        finally:
            if pos:
                del buf[:pos]

    def _head(self, raw: bytes) -> bool:
        """Parse one response head; ``True`` to go on parsing (a body or the next head follows)."""
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise _ProtocolError(f"malformed status line {lines[0][:100]!r}")
        status = int(parts[1])
        self.http10 = parts[0] == "HTTP/1.0"
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep:
                raise _ProtocolError(f"malformed header line {line[:100]!r}")
            name, value = name.strip().lower(), value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        if 100 <= status < 200 and status != 101:
            return True  # interim response (100 Continue, 103 Early Hints): the real head follows
        self.status, self.headers = status, headers
        if self.on_head is not None:
            self.on_head(status, headers)
        if self.head_only or status in (204, 304):
            self._finish_body()
            return False
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.state = _CHUNK_SIZE
        elif "content-length" in headers:
            value = headers["content-length"]
            if not (value.isascii() and value.isdigit()):
                raise _ProtocolError(f"malformed Content-Length {value[:40]!r}")
            self.remaining = int(value)
            if self.remaining == 0:
                self._finish_body()
                return False
            self.state = _LENGTH
        else:
            self.state = _UNTIL_CLOSE  # delimited by connection close
            return True
        return True

    def _finish_body(self) -> None:
        connection = self.headers.get("connection", "").lower()
        self._complete("keep-alive" in connection if self.http10 else "close" not in connection)


class Connection:
    """One keep-alive connection to one host; not shared between concurrent requests."""

    def __init__(self, scheme: str, host: str, port: int, connect_timeout: float = 30.0):
        self.scheme, self.host, self.port, self.connect_timeout = scheme, host, port, connect_timeout
        self.timed_out = False  # set by whoever calls abort() for a deadline
        self._aborted = False  # abort() was called during the current request
        self._reader: _ResponseReader | None = None

    @property
    def is_open(self) -> bool:
        r = self._reader
        return r is not None and not r.closed and r.transport is not None and not r.transport.is_closing()

    async def _connect(self) -> _ResponseReader:
        loop = asyncio.get_running_loop()
        tls = self.scheme == "https"
        try:
            _, reader = await asyncio.wait_for(
                loop.create_connection(_ResponseReader, self.host, self.port, ssl=_ssl_context() if tls else None,
                                       server_hostname=self.host if tls else None),
                self.connect_timeout)
        except asyncio.TimeoutError:
            raise TransportError(f"connect to {self.host}:{self.port} timed out after {self.connect_timeout:g} s", False) from None
        except (OSError, ssl.SSLError, UnicodeError) as exc:  # UnicodeError: a host name IDNA cannot encode
            raise TransportError(f"connect to {self.host}:{self.port} failed ({type(exc).__name__}: {exc})", False) from None
        self._reader = reader
        return reader

    def abort(self) -> None:
        """Drop the connection now: a pending :meth:`request` fails with :class:`TransportError`
        (``sent=False`` if it is still connecting)."""
        self._aborted = True
        if self._reader is not None and self._reader.transport is not None:
            self._reader.aborted = True
            self._reader.transport.abort()

    def close(self) -> None:
        r, self._reader = self._reader, None
        if r is not None and r.transport is not None:
            try:
                r.transport.close()
            except Exception:  # noqa: BLE001 - closing a broken transport
                pass

    async def request(self, method: str, ep: Endpoint, headers: "Mapping[str, str] | RequestHead", body: bytes,
                      on_head: Callable[[int, dict[str, str]], None] | None = None,
                      on_data: Callable[[bytes], None] | None = None) -> Response:
        """Send one request and read the whole response. ``on_head`` sees the status and headers as
        soon as they arrive, ``on_data`` every body piece (e.g. to read a stream's first event).
        ``headers``: a mapping, or a :class:`RequestHead` built once for many requests (``method``
        and ``ep`` must then be the ones it was built with). On any failure the connection is closed and :class:`TransportError` raised."""
        self._aborted = False
        reused = self.is_open
        reader = self._reader if reused else await self._connect()
        assert reader is not None and reader.transport is not None
        head = headers.data if isinstance(headers, RequestHead) else RequestHead(method, ep, headers).data
        waiter = asyncio.get_running_loop().create_future()
        reader.expect(waiter, method == "HEAD", on_head, on_data)
        if self._aborted or reader.closed or reader.transport.is_closing() or waiter.done():
            # aborted while connecting, closed by the server, or it answered before the request:
            # nothing was written, so the request certainly was not processed
            if not waiter.done():
                waiter.cancel()
            elif not waiter.cancelled():
                waiter.exception()  # retrieved: superseded by the error raised here
            self.close()
            what = "aborted while connecting" if self._aborted else "connection closed by the server before the request"
            raise TransportError(f"{what} ({'reused' if reused else 'new'} connection)", False)
        try:
            reader.transport.write(b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body))
        except (RuntimeError, OSError) as exc:  # uvloop raises RuntimeError on a transport closing meanwhile
            self.close()
            raise TransportError(f"write failed ({type(exc).__name__}: {exc})", False) from None
        try:
            status, resp_headers, data, keep_alive = await waiter
        except _ProtocolError as exc:
            self.close()
            raise TransportError(str(exc), True) from None
        except (OSError, ValueError, ssl.SSLError) as exc:
            self.close()
            what = str(exc) if type(exc) is ConnectionError else f"{type(exc).__name__}: {exc}"
            raise TransportError(f"{what} ({'reused' if reused else 'new'} connection)", True) from None
        except BaseException:  # cancelled mid-request: the connection state is unknown
            self.close()
            raise
        if keep_alive and reader.buf:
            # bytes beyond this response's framing: a stray CRLF is tolerated, anything else means the
            # server and this client disagree about where the response ended; never reuse that
            keep_alive = not bytes(reader.buf).strip(b"\r\n\t ")
            reader.buf.clear()
        if not keep_alive:
            self.close()
        return Response(status, resp_headers, data)

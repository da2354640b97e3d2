"""A small HTTP/1.1 client on asyncio streams, one persistent connection per worker.

Why not httpx: its connection pool scans every connection for every request (quadratic in the pool
size); at 256 connections against a 50 ms endpoint it managed about 130 requests/s on one core
here, where this client does about 4,800 at a third of a core (benchmarks/generation_throughput.py).

Scope, deliberately small: ``http`` and ``https`` (system CA store), keep-alive, request bodies
with ``Content-Length``, response bodies delimited by ``Content-Length``, ``chunked`` encoding or
connection close, 1xx responses skipped. No redirects, cookies, compression or proxies. Every
failure below HTTP is a :class:`TransportError` naming what happened and whether the request may
have reached the server (``sent``).
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass, field
from typing import Callable, Mapping
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 65536


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


_SSL_CONTEXT: ssl.SSLContext | None = None


def _ssl_context() -> ssl.SSLContext:
    global _SSL_CONTEXT
    if _SSL_CONTEXT is None:
        _SSL_CONTEXT = ssl.create_default_context()
    return _SSL_CONTEXT


@dataclass(eq=False)
class Connection:
    """One keep-alive connection to one host; not shared between concurrent requests."""

    scheme: str
    host: str
    port: int
    connect_timeout: float = 30.0
    _reader: asyncio.StreamReader | None = field(default=None, repr=False)
    _writer: asyncio.StreamWriter | None = field(default=None, repr=False)
    timed_out: bool = False  # set by whoever calls abort() for a deadline

    @property
    def is_open(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    async def _connect(self) -> None:
        try:
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=_ssl_context() if self.scheme == "https" else None,
                                        server_hostname=self.host if self.scheme == "https" else None,
                                        limit=1 << 20),
                self.connect_timeout)
        except asyncio.TimeoutError:
            raise TransportError(f"connect to {self.host}:{self.port} timed out after {self.connect_timeout:g} s", False) from None
        except (OSError, ssl.SSLError) as exc:
            raise TransportError(f"connect to {self.host}:{self.port} failed ({type(exc).__name__}: {exc})", False) from None

    def abort(self) -> None:
        """Drop the connection now (a pending :meth:`request` fails with :class:`TransportError`)."""
        if self._writer is not None:
            self._writer.transport.abort()

    def close(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:  # noqa: BLE001 - closing a broken transport
                pass
        self._reader = self._writer = None

    async def request(self, method: str, ep: Endpoint, headers: Mapping[str, str], body: bytes,
                      on_head: Callable[[int, dict[str, str]], None] | None = None,
                      on_data: Callable[[bytes], None] | None = None) -> Response:
        """Send one request and read the whole response. ``on_head`` sees the status and headers as
        soon as they arrive, ``on_data`` every body piece (e.g. to read a stream's first event).
        On any failure the connection is closed and :class:`TransportError` raised."""
        reused = self.is_open
        if not reused:
            await self._connect()
        assert self._reader is not None and self._writer is not None
        head = [f"{method} {ep.path} HTTP/1.1", f"Host: {ep.host_header}", f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        sent = False
        try:
            self._writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
            sent = True
            status, resp_headers = await self._read_head()
            if on_head is not None:
                on_head(status, resp_headers)
            data = await self._read_body(method, status, resp_headers, on_data)
        except TransportError:
            self.close()
            raise
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, ssl.SSLError) as exc:
            self.close()
            what = "connection closed by the server" if isinstance(exc, asyncio.IncompleteReadError) else f"{type(exc).__name__}: {exc}"
            raise TransportError(f"{what} ({'reused' if reused else 'new'} connection)", sent) from None
        except BaseException:  # cancelled mid-request: the connection state is unknown
            self.close()
            raise
        if resp_headers.get("connection", "").lower() == "close":
            self.close()
        return Response(status, resp_headers, data)

    async def _read_head(self) -> tuple[int, dict[str, str]]:
        assert self._reader is not None
        while True:
            raw = await self._reader.readuntil(b"\r\n\r\n")
            if len(raw) > MAX_HEADER_BYTES:
                raise TransportError("response header too large", True)
            lines = raw.decode("latin-1").split("\r\n")
            parts = lines[0].split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
                raise TransportError(f"malformed status line {lines[0][:100]!r}", True)
            status = int(parts[1])
            headers: dict[str, str] = {}
            for line in lines[1:]:
                if not line:
                    continue
                name, sep, value = line.partition(":")
                if not sep:
                    raise TransportError(f"malformed header line {line[:100]!r}", True)
                name, value = name.strip().lower(), value.strip()
                headers[name] = f"{headers[name]}, {value}" if name in headers else value
            if 100 <= status < 200 and status != 101:
                continue  # interim response (100 Continue, 103 Early Hints)
            return status, headers

    async def _read_body(self, method: str, status: int, headers: Mapping[str, str],
                         on_data: Callable[[bytes], None] | None) -> bytes:
        r = self._reader
        assert r is not None
        if method == "HEAD" or status in (204, 304):
            return b""
        parts: list[bytes] = []

        def take(piece: bytes) -> None:
            if piece:
                parts.append(piece)
                if on_data is not None:
                    on_data(piece)

        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await r.readuntil(b"\r\n")
                size = int(size_line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while (await r.readuntil(b"\r\n")) != b"\r\n":  # trailers
                        pass
                    break
                data = await r.readexactly(size + 2)  # the chunk and its CRLF in one read
                if data[-2:] != b"\r\n":
                    raise TransportError("malformed chunked body", True)
                take(data[:-2])
        elif "content-length" in headers:
            remaining = int(headers["content-length"])
            if remaining <= 1 << 22:  # the common case: one read
                take(await r.readexactly(remaining))
                remaining = 0
            while remaining > 0:
                piece = await r.read(min(remaining, 1 << 16))
                if not piece:
                    raise asyncio.IncompleteReadError(b"", remaining)
                remaining -= len(piece)
                take(piece)
        else:  # delimited by connection close
            while piece := await r.read(1 << 16):
                take(piece)
            self.close()
        return b"".join(parts)

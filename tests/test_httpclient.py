"""The HTTP/1.1 client against a scripted server on loopback: keep-alive, chunked bodies split at
every byte, 1xx, close-delimited bodies, and each way a connection can fail (with ``sent``)."""
from __future__ import annotations

import asyncio
import socket

import pytest

from eagledata.generate.httpclient import Connection, Endpoint, RequestHead, TransportError


async def _read_request(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


def run_loop(coro, loop: str = "asyncio"):
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.run(coro)
    return asyncio.run(coro)


def serve(script, loop: str = "asyncio", on_accept: bytes | None = None):
    """Run ``script(client_endpoint, requests, connections)`` against a server that answers the
    n-th request with ``answers[n]``: a list of byte strings (written with a pause between them),
    or ``"close"`` (drop the connection without answering). ``on_accept``: bytes written, and the
    connection closed, as soon as a connection is accepted (before any request)."""

    def decorator(answers):
        async def main():
            requests: list[bytes] = []
            connections = []
            it = iter(answers)

            async def handle(reader, writer):
                connections.append(writer)
                if on_accept is not None:
                    writer.write(on_accept)
                    writer.close()
                    return
                while (req := await _read_request(reader)) is not None:
                    requests.append(req)
                    answer = next(it)
                    if answer == "close":
                        writer.close()
                        return
                    for piece in answer:
                        if piece == "close":
                            writer.close()
                            return
                        writer.write(piece)
                        await writer.drain()
                        await asyncio.sleep(0.002)
                writer.close()

            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            try:
                return await script(Endpoint.parse(f"http://127.0.0.1:{port}/api/v1/x?y=1"), requests, connections)
            finally:
                server.close()

        return run_loop(main(), loop)

    return decorator


def ep_port(request: bytes) -> int:
    return int(request.split(b"\r\nHost: 127.0.0.1:", 1)[1].split(b"\r\n", 1)[0])


def _conn(ep: Endpoint) -> Connection:
    return Connection(ep.scheme, ep.host, ep.port, connect_timeout=5)


def test_keep_alive_content_length_and_request_head():
    async def script(ep, requests, connections):
        c = _conn(ep)
        head = RequestHead("POST", ep, {"Authorization": "Bearer k", "Content-Type": "application/json"})
        r1 = await c.request("POST", ep, head, b'{"a":1}')
        r2 = await c.request("POST", ep, {"X-Other": "v"}, b"")
        c.close()
        return r1, r2, requests, len(connections)

    r1, r2, requests, n_conn = serve(script)([
        [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Generation-Id: gen-1\r\nX-Rep: a\r\nX-Rep: b\r\n\r\n", b"hel", b"lo"],
        [b"HTTP/1.1 429 Too Many\r\ncontent-length: 2\r\nRetry-After: 3\r\n\r\nno"]])
    assert (r1.status, r1.body, r1.headers["x-generation-id"], r1.headers["x-rep"]) == (200, b"hello", "gen-1", "a, b")
    assert (r2.status, r2.body, r2.headers["retry-after"]) == (429, b"no", "3")
    assert n_conn == 1  # the second request reused the connection
    start, _, rest = requests[0].partition(b"\r\nAuthorization")
    assert start == b"POST /api/v1/x?y=1 HTTP/1.1\r\nHost: 127.0.0.1:%d" % ep_port(requests[0])
    assert rest == b": Bearer k\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{\"a\":1}"
    assert b"X-Other: v\r\n" in requests[1] and requests[1].endswith(b"Content-Length: 0\r\n\r\n")


def test_chunked_body_split_at_every_byte_with_extensions_trailers_and_1xx():
    body_chunks = [b"data: {\"id\":\"gen-7\"}\n\n", b"data: [DONE]\n\n"]
    wire = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    wire += b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in body_chunks) + b"0\r\nX-Trailer: t\r\n\r\n"
    seen: list = []

    async def script(ep, requests, connections):
        c = _conn(ep)
        r = await c.request("POST", ep, {}, b"{}", on_head=lambda s, h: seen.append(("head", s)),
                            on_data=lambda piece: seen.append(("data", piece)))
        again = await c.request("GET", ep, {}, b"")
        return r, again, len(connections)

    r, again, n_conn = serve(script)([[wire[i:i + 1] for i in range(len(wire))],
                                      [b"HTTP/1.1 204 No Content\r\n\r\n"]])
    assert r.status == 200 and r.body == b"".join(body_chunks)
    assert seen[0] == ("head", 200)  # the interim 100 is skipped
    assert b"".join(p for kind, p in seen if kind == "data") == r.body  # pieces delivered as they came
    assert again.status == 204 and again.body == b"" and n_conn == 1


def test_body_delimited_by_close_and_connection_close_header():
    async def script(ep, requests, connections):
        c = _conn(ep)
        r1 = await c.request("POST", ep, {}, b"")
        open_after_1 = c.is_open
        r2 = await c.request("POST", ep, {}, b"")
        return r1, open_after_1, r2, c.is_open, len(connections)

    r1, open1, r2, open2, n_conn = serve(script)([
        [b"HTTP/1.1 200 OK\r\n\r\n", b"until ", b"close", "close"],
        [b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"]])
    assert (r1.body, open1) == (b"until close", False)
    assert (r2.body, open2, n_conn) == (b"ok", False, 2)


@pytest.mark.parametrize("answer, message", [
    ("close", "connection closed by the server (new connection)"),
    ([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "close"], "connection closed by the server mid-response"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"], "malformed chunked body"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXY"], "no CRLF after a chunk"),
    ([b"SPDY/9 200\r\n\r\n"], "malformed status line"),
    ([b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"], "malformed header line"),
    ([b"HTTP/1.1 200 OK\r\nContent-Length: -4\r\n\r\n"], "malformed Content-Length '-4'"),
    ([b"HTTP/1.1 200 OK\r\nContent-Length: 1_0\r\n\r\n"], "malformed Content-Length '1_0'"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n+5\r\nhello\r\n"], "chunk size line b'+5'"),
])
def test_broken_answers_are_transport_errors_after_sending(answer, message):
    async def script(ep, requests, connections):
        c = _conn(ep)
        with pytest.raises(TransportError) as exc:
            await c.request("POST", ep, {}, b"{}")
        return exc.value, c.is_open

    err, still_open = serve(script)([answer])
    assert message in str(err) and err.sent is True and not still_open


def test_connect_failure_is_not_sent_and_abort_fails_the_pending_request():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ep = Endpoint.parse(f"http://127.0.0.1:{port}/")

    async def refused():
        with pytest.raises(TransportError) as exc:
            await _conn(ep).request("POST", ep, {}, b"")
        return exc.value

    err = asyncio.run(refused())
    assert err.sent is False and "connect to 127.0.0.1" in str(err)

    async def script(ep, requests, connections):
        c = _conn(ep)
        asyncio.get_running_loop().call_later(0.05, c.abort)
        with pytest.raises(TransportError) as exc:
            await c.request("POST", ep, {}, b"")  # the server never answers
        return exc.value

    err = serve(script)([[b"HTTP/1.1 200 OK\r\n"]])  # a head that never ends
    assert err.sent is True


def test_endpoint_parsing():
    assert Endpoint.parse("https://openrouter.ai/api/v1/chat/completions") == Endpoint("https", "openrouter.ai", 443,
                                                                                      "/api/v1/chat/completions")
    assert Endpoint.parse("http://[::1]:8080").host_header == "[::1]:8080"
    with pytest.raises(ValueError, match="unsupported URL"):
        Endpoint.parse("ftp://x/")


def test_https_verifies_the_server_certificate(tmp_path, monkeypatch):
    """TLS with the system trust store (here: a self-signed certificate made trusted through
    SSL_CERT_FILE, which OpenSSL reads for its default paths); an untrusted one fails to connect."""
    import shutil
    import ssl
    import subprocess

    import eagledata.generate.httpclient as hc

    if shutil.which("openssl") is None:
        pytest.skip("openssl command not available")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "2", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def main():
        async def handle(reader, writer):
            while await _read_request(reader) is not None:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecret")
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
        ep = Endpoint.parse(f"https://localhost:{server.sockets[0].getsockname()[1]}/v1")
        try:
            monkeypatch.setattr(hc, "_SSL_CONTEXT", None)
            monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "nothing-trusted.pem"))
            with pytest.raises(TransportError, match="connect to localhost") as exc:
                await _conn(ep).request("GET", ep, {}, b"")
            assert exc.value.sent is False
            monkeypatch.setattr(hc, "_SSL_CONTEXT", None)
            monkeypatch.setenv("SSL_CERT_FILE", str(cert))
            c = _conn(ep)
            answers = [await c.request("GET", ep, {}, b"") for _ in range(2)]
            c.close()
            return answers
        finally:
            server.close()

    answers = asyncio.run(main())
    assert [(r.status, r.body) for r in answers] == [(200, b"secret")] * 2


LOOPS = ["asyncio", "uvloop"]


@pytest.mark.parametrize("loop", LOOPS)
def test_a_body_delimited_by_close_is_incomplete_when_the_client_aborts(loop):
    """The watchdog aborts a request whose close-delimited body is still coming: an error, never
    the partial body as a complete answer."""
    async def script(ep, requests, connections):
        c = _conn(ep)
        asyncio.get_running_loop().call_later(0.1, c.abort)
        with pytest.raises(TransportError, match="aborted by the client") as exc:
            await c.request("POST", ep, {}, b"{}")
        return exc.value

    err = serve(script, loop)([[b"HTTP/1.1 200 OK\r\n\r\n", b'{"partial": ']])
    assert err.sent is True


@pytest.mark.parametrize("loop", LOOPS)
def test_bytes_beyond_a_response_never_answer_the_next_request(loop):
    """Content-Length understates the body: the extra bytes (even a whole fake response) are not
    taken as the next answer; the connection is dropped and the next request gets its own answer.
    A stray CRLF after a body is tolerated and the connection reused."""
    async def script(ep, requests, connections):
        c = _conn(ep)
        out = [await c.request("POST", ep, {}, b"") for _ in range(4)]
        return [r.body for r in out], len(connections)

    bodies, n_conn = serve(script, loop)([
        [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nA1HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nSTALE"],
        [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nFRESH\r\n"],
        [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nA3"],
        [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nA4"]])
    assert bodies == [b"A1", b"FRESH", b"A3", b"A4"]
    assert n_conn == 2  # a new connection after the stale bytes; the stray CRLF did not cost one


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("on_accept", [b"", b"HTTP/1.1 503 Busy\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"])
def test_a_server_that_closes_before_the_request_is_a_transport_error(loop, on_accept):
    """Answered (or closed) right after accept: a TransportError, never another exception; when the
    client saw the close before writing, ``sent`` is False."""
    async def script(ep, requests, connections):
        outcomes = []
        for _ in range(5):
            try:
                await _conn(ep).request("POST", ep, {}, b"{}")
                outcomes.append("answered")
            except TransportError as exc:
                outcomes.append(exc.sent)
        return outcomes, requests

    outcomes, requests = serve(script, loop, on_accept=on_accept)([])
    assert "answered" not in outcomes and requests == []


@pytest.mark.parametrize("loop", LOOPS)
def test_abort_while_connecting_means_not_sent(loop):
    async def script(ep, requests, connections):
        c = _conn(ep)
        task = asyncio.ensure_future(c.request("POST", ep, {}, b"{}"))
        await asyncio.sleep(0)  # the request is connecting
        c.abort()
        with pytest.raises(TransportError, match="aborted while connecting") as exc:
            await task
        await asyncio.sleep(0.05)
        return exc.value, requests

    err, requests = serve(script, loop)([[b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"]])
    assert err.sent is False and requests == []


@pytest.mark.parametrize("version, connection, reused", [("1.0", "", False), ("1.0", "keep-alive", True), ("1.1", "", True)])
def test_http_10_keeps_the_connection_only_when_asked(version, connection, reused):
    head = b"HTTP/%s 200 OK\r\nContent-Length: 1\r\n" % version.encode()
    if connection:
        head += b"Connection: %s\r\n" % connection.encode()

    async def script(ep, requests, connections):
        c = _conn(ep)
        await c.request("GET", ep, {}, b"")
        return c.is_open

    assert serve(script)([[head + b"\r\nx"]]) is reused

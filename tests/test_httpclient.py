"""The transport layer (eagledata.generate.transport, httpx with one client per worker): against the
real stand-in over loopback (exact bodies, streaming callbacks, Retry-After, keep-alive, faults),
and against a scripted server for what the stand-in cannot do on purpose (a body cut short, bytes
beyond a response, a close before answering), with ``sent`` for each failure; TLS verification
through the system trust store and proxies from the environment."""
from __future__ import annotations

import asyncio
import json
import socket

import pytest

from eagledata.generate import transport
from eagledata.generate.transport import AttemptTimeout, TransportError, new_client, send
from eagledata.standin.server import SimulatorServer

LOOPS = ["asyncio", "uvloop"]
BODY = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": "Hi \u00e9?"}], "max_tokens": 64,
        "usage": {"include": True}}


def run_loop(coro, loop: str = "asyncio"):
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.run(coro)
    return asyncio.run(coro)


@pytest.fixture
def stand_in(k25):
    servers: list[SimulatorServer] = []

    def make(**kw) -> SimulatorServer:
        tok, fam = k25
        sim = SimulatorServer(tok, fam, seed=3, **kw).start()
        servers.append(sim)
        return sim

    yield make
    for s in servers:
        s.stop()


# --------------------------------------------------------------------------------------------
# against the stand-in


@pytest.mark.parametrize("loop", LOOPS)
def test_answers_from_the_stand_in_with_keep_alive_and_exact_bodies(stand_in, loop):
    sim = stand_in()
    url = sim.base_url + "/chat/completions"
    body = json.dumps(BODY, ensure_ascii=False).encode("utf-8")
    events: list = []

    async def main():
        async with new_client(headers={"Content-Type": "application/json"}) as client:
            first = await send(client, "POST", url, body, timeout=10, on_head=lambda s, h: events.append(("head", s)),
                               on_data=lambda piece: events.append(("data", piece)))
            second = await send(client, "POST", url, body, timeout=10)
            return first, second

    first, second = run_loop(main(), loop)
    assert first.status == second.status == 200
    answer = json.loads(first.body)  # the exact body: it parses, and is what the stand-in counted
    assert json.loads(second.body)["choices"] == answer["choices"]  # same body and seed: the same answer
    assert answer["usage"]["completion_tokens"] > 0 and answer["usage"]["cost"] > 0
    assert first.headers["content-type"].startswith("application/json")
    assert events[0] == ("head", 200) and b"".join(p for k, p in events if k == "data") == first.body
    assert sim.requests_total == 2


def test_a_stream_arrives_piece_by_piece_and_whole(stand_in):
    sim = stand_in()
    pieces: list[bytes] = []

    async def main():
        async with new_client() as client:
            return await send(client, "POST", sim.base_url + "/chat/completions",
                              json.dumps({**BODY, "stream": True}).encode(), timeout=10, on_data=pieces.append)

    resp = asyncio.run(main())
    assert resp.status == 200 and b"\ndata: {" in resp.body and resp.body.rstrip().endswith(b"data: [DONE]")
    assert b"".join(pieces) == resp.body and len(pieces) >= 1


@pytest.mark.parametrize("fault, check", [
    ("429:2", lambda r: r.status == 429 and r.headers["retry-after"] == "2"),
    ("503", lambda r: r.status == 503 and b"error" in r.body),
])
def test_http_errors_are_answers_with_their_headers(stand_in, fault, check):
    sim = stand_in(faults={1: fault})

    async def main():
        async with new_client() as client:
            return await send(client, "POST", sim.base_url + "/chat/completions", json.dumps(BODY).encode(), timeout=10)

    assert check(asyncio.run(main()))


@pytest.mark.parametrize("fault", ["reset", "disconnect"])
def test_a_connection_dropped_by_the_stand_in_is_an_error_that_may_have_been_sent(stand_in, fault):
    sim = stand_in(faults={1: fault})

    async def main():
        async with new_client() as client:
            with pytest.raises(TransportError) as exc:
                await send(client, "POST", sim.base_url + "/chat/completions", json.dumps(BODY).encode(), timeout=10)
            again = await send(client, "POST", sim.base_url + "/chat/completions", json.dumps(BODY).encode(), timeout=10)
            return exc.value, again

    err, again = asyncio.run(main())
    assert err.sent is True and not isinstance(err, AttemptTimeout)
    assert again.status == 200  # the same client connects anew


def test_a_hanging_answer_times_out_at_the_attempt_deadline(stand_in):
    sim = stand_in(faults={1: "hang:5"})

    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with new_client() as client:
            with pytest.raises(AttemptTimeout) as exc:
                await send(client, "POST", sim.base_url + "/chat/completions", json.dumps(BODY).encode(), timeout=0.3)
        return exc.value, loop.time() - t0

    err, took = asyncio.run(main())
    assert err.sent is True and 0.3 <= took < 2


# --------------------------------------------------------------------------------------------
# against a scripted server


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


def serve(script, loop: str = "asyncio", on_accept: bytes | None = None):
    """Run ``script(url, requests, connections)`` against a server that answers the n-th request
    with ``answers[n]``: byte strings written with a pause between them, ``"close"`` (drop the
    connection) or ``"hold"`` (keep it open, silent). ``on_accept``: bytes written, and the
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
                    for piece in next(it):
                        if piece == "close":
                            writer.close()
                            return
                        if piece == "hold":
                            await asyncio.sleep(30)
                        writer.write(piece)
                        await writer.drain()
                        await asyncio.sleep(0.002)
                writer.close()

            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            try:
                return await script(f"http://127.0.0.1:{port}/api/v1/x?y=1", requests, connections)
            finally:
                server.close()

        return run_loop(main(), loop)

    return decorator


def test_the_request_is_sent_as_given():
    body = '{"a": "\u00e9", "b":1}'.encode("utf-8")

    async def script(url, requests, connections):
        async with new_client(headers={"Authorization": "Bearer k", "Content-Type": "application/json"}) as c:
            r1 = await send(c, "POST", url, body, timeout=5)
            r2 = await send(c, "POST", url, b"", headers={"X-Other": "v"}, timeout=5)
        return r1, r2, requests, len(connections)

    r1, r2, requests, n_conn = serve(script)([
        [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Generation-Id: gen-1\r\nX-Rep: a\r\nX-Rep: b\r\n\r\n", b"hel", b"lo"],
        [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]])
    assert (r1.status, r1.body, r1.headers["x-generation-id"], r1.headers["x-rep"]) == (200, b"hello", "gen-1", "a, b")
    assert r2.body == b"ok" and n_conn == 1  # the second request reused the connection
    head, _, sent_body = requests[0].partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    assert lines[0] == b"post /api/v1/x?y=1 http/1.1" and sent_body == body
    assert b"content-length: %d" % len(body) in lines and b"authorization: bearer k" in lines
    assert b"accept-encoding: identity" in lines  # the body is stored as received: nothing to decode
    assert b"x-other: v" in requests[1].lower() and b"content-length: 0" in requests[1].lower()


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("answer, message", [
    ([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "close"], "complete message body"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", "close"], "complete message body"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"], ""),
    ([b"SPDY/9 200\r\n\r\n"], ""),
    (["close"], "disconnected"),
])
def test_a_cut_or_broken_answer_is_an_error_after_sending(loop, answer, message):
    async def script(url, requests, connections):
        async with new_client() as c:
            with pytest.raises(TransportError) as exc:
                await send(c, "POST", url, b"{}", timeout=5)
        return exc.value

    err = serve(script, loop)([answer])
    assert err.sent is True and message in str(err).lower()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_body_delimited_by_close_is_incomplete_when_the_deadline_passes(loop):
    """The deadline passes while a close-delimited body is still coming: an error, never the
    partial body as a complete answer."""
    async def script(url, requests, connections):
        async with new_client() as c:
            with pytest.raises(AttemptTimeout) as exc:
                await send(c, "POST", url, b"{}", timeout=0.2)
        return exc.value

    err = serve(script, loop)([[b"HTTP/1.1 200 OK\r\n\r\n", b'{"partial": ', "hold"]])
    assert err.sent is True


@pytest.mark.parametrize("loop", LOOPS)
def test_bytes_beyond_a_response_never_answer_the_next_request(loop):
    """Content-Length understates the body: the extra bytes (even a whole fake response) are never
    taken as the next answer."""
    async def script(url, requests, connections):
        async with new_client() as c:
            out = []
            for _ in range(3):
                try:
                    out.append((await send(c, "POST", url, b"", timeout=5)).body)
                except TransportError:
                    out.append("error")
        return out

    bodies = serve(script, loop)([
        [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nA1HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nSTALE"],
        [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nFRESH"],
        [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nA3"]])
    assert bodies == [b"A1", b"FRESH", b"A3"]  # the connection with stale bytes was dropped


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("on_accept", [b"", b"HTTP/1.1 503 Busy\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"])
def test_a_server_that_closes_before_the_request_never_answers_it(loop, on_accept):
    """Closed (or answered) right after accept, before reading the request: a TransportError or the
    server's own error status, never a success."""
    async def script(url, requests, connections):
        outcomes = []
        for _ in range(3):
            async with new_client() as c:
                try:
                    outcomes.append((await send(c, "POST", url, b"{}", timeout=5)).status)
                except TransportError as exc:
                    outcomes.append(type(exc).__name__)
        return outcomes, requests

    outcomes, requests = serve(script, loop, on_accept=on_accept)([])
    assert requests == [] and set(outcomes) <= {"TransportError", 503}


def test_connect_failure_is_not_sent():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def refused():
        async with new_client() as c:
            with pytest.raises(TransportError) as exc:
                await send(c, "POST", f"http://127.0.0.1:{port}/", b"{}", timeout=5)
        return exc.value

    err = asyncio.run(refused())
    assert err.sent is False and "connect" in str(err).lower()


def test_cancelling_a_request_drops_its_connection_and_the_client_stays_usable():
    async def script(url, requests, connections):
        async with new_client() as c:
            task = asyncio.ensure_future(send(c, "POST", url, b"{}", timeout=5))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            again = await send(c, "POST", url, b"{}", timeout=5)
        return again, len(connections)

    again, n_conn = serve(script)([[b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", "hold"],
                                   [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]])
    assert again.body == b"ok" and n_conn == 2


def test_proxies_come_from_the_environment(monkeypatch):
    """HTTP_PROXY sends the request to the proxy (absolute-form target); NO_PROXY bypasses it."""
    async def script(url, requests, connections):
        monkeypatch.setenv("HTTP_PROXY", url.split("/api")[0])
        monkeypatch.setenv("NO_PROXY", "bypassed.invalid")
        async with new_client() as c:
            r = await send(c, "POST", "http://upstream.invalid/api/v1/chat/completions", b"{}", timeout=5)
        async with new_client() as c:
            with pytest.raises(TransportError) as exc:
                await send(c, "POST", "http://bypassed.invalid/x", b"{}", timeout=5)
        return r, requests, exc.value

    r, requests, err = serve(script)([[b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]])
    assert r.body == b"ok" and requests[0].startswith(b"POST http://upstream.invalid/api/v1/chat/completions HTTP/1.1")
    assert err.sent is False  # no proxy for it: the name does not resolve, nothing was sent


def test_https_verifies_the_server_certificate(tmp_path, monkeypatch):
    """TLS with the system trust store (here: a self-signed certificate made trusted through
    SSL_CERT_FILE, which OpenSSL reads for its default paths); an untrusted one fails to connect."""
    import shutil
    import ssl
    import subprocess

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
        url = f"https://localhost:{server.sockets[0].getsockname()[1]}/v1"
        try:
            monkeypatch.setattr(transport, "_SSL_CONTEXT", None)
            monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "nothing-trusted.pem"))
            async with new_client() as c:
                with pytest.raises(TransportError) as exc:
                    await send(c, "GET", url, timeout=5)
            assert exc.value.sent is False
            monkeypatch.setattr(transport, "_SSL_CONTEXT", None)
            monkeypatch.setenv("SSL_CERT_FILE", str(cert))
            async with new_client() as c:
                return [await send(c, "GET", url, timeout=5) for _ in range(2)]
        finally:
            server.close()

    answers = asyncio.run(main())
    assert [(r.status, r.body) for r in answers] == [(200, b"secret")] * 2

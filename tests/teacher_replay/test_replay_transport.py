"""AsyncioHTTP11Transport: keep-alive pool, framing, timeouts, errors, cancellation, TLS, proxy fallback.

Small asyncio HTTP servers on 127.0.0.1 (free port) script the server side: each test's handler gets
the parsed request and writes raw response bytes, so framing corner cases are exact.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import shutil
import socket
import ssl
import subprocess
from collections.abc import Awaitable, Callable

import httpx
import pytest
from replay_helpers import SECRET, teacher

from composer_replication.teacher_replay import TeacherReplayer
from composer_replication.teacher_replay.transport import AsyncioHTTP11Transport, proxy_env_set

Handler = Callable[[dict, dict, asyncio.StreamWriter], Awaitable[bool | None]]


async def _read_request(reader: asyncio.StreamReader) -> dict | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                break
            body += await reader.readexactly(size)
            await reader.readexactly(2)
    else:
        body = await reader.readexactly(int(headers.get("content-length", 0)))
    return {"method": method, "target": target, "headers": headers, "body": body}


class MiniServer:
    """An asyncio HTTP/1.1 server whose ``handler(request, conn, writer)`` writes raw responses.

    The handler returns ``False`` to close the connection after it. ``conn["n"]`` counts the requests
    on that connection. ``accepted`` / ``open`` / ``peak`` count connections.
    """

    def __init__(self, handler: Handler, *, ssl_context: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.ssl_context = ssl_context
        self.accepted = self.open = self.peak = 0
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> MiniServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.ssl_context)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/x"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open += 1
        self.peak = max(self.peak, self.open)
        conn = {"n": 0}
        try:
            while True:
                req = await _read_request(reader)
                if req is None:
                    break
                conn["n"] += 1
                if await self.handler(req, conn, writer) is False:
                    break
        except ConnectionError:
            pass
        finally:
            self.open -= 1
            writer.close()


def _response(body: bytes = b"ok", *, status: str = "200 OK", headers: dict | None = None) -> bytes:
    head = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def _ok(req: dict, conn: dict, writer: asyncio.StreamWriter) -> None:
    writer.write(_response(b"ok:" + req["body"]))


def _run(coro_fn: Callable[[], Awaitable]) -> object:
    return asyncio.run(asyncio.wait_for(coro_fn(), 20))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- keep-alive and framing


def test_keep_alive_reuses_one_connection_against_the_fake_server(fake_server):
    transport = AsyncioHTTP11Transport(4)

    async def go() -> list[int]:
        async with httpx.AsyncClient(transport=transport) as client:
            out = []
            for i in range(10):
                r = await client.post(
                    fake_server.base_url + "/chat/completions",
                    json={"model": "a/one", "messages": [{"role": "user", "content": str(i)}]},
                    headers={"Authorization": f"Bearer {SECRET}"},
                )
                assert r.json()["choices"][0]["message"]["role"] == "assistant"
                assert r.http_version == "HTTP/1.1" and r.reason_phrase == "OK"
                out.append(r.status_code)
            return out

    assert _run(go) == [200] * 10
    assert transport.connections_opened == 1 and transport.num_connections == 0  # closed by aclose


def test_keep_alive_counts_on_the_server_side_and_post_bodies_arrive():
    async def go() -> None:
        async with MiniServer(_ok) as srv, httpx.AsyncClient(transport=AsyncioHTTP11Transport(4)) as c:
            for i in range(5):
                r = await c.post(srv.url, content=f"n{i}".encode())
                assert r.content == f"ok:n{i}".encode()
            r = await c.get(srv.url)
            assert r.content == b"ok:"
            assert srv.accepted == 1

    _run(go)


def test_chunked_response_split_over_writes_then_reuse():
    async def handler(req: dict, conn: dict, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/plain\r\n\r\n")
        for part in (b"hello ", b"chunked ", b"world"):
            writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\nX-Trailer: yes\r\n\r\n")

    async def go() -> None:
        transport = AsyncioHTTP11Transport(4)
        async with MiniServer(handler) as srv, httpx.AsyncClient(transport=transport) as c:
            for _ in range(2):
                r = await c.get(srv.url)
                assert r.text == "hello chunked world"
            assert srv.accepted == 1 and transport.connections_opened == 1

    _run(go)


def test_close_delimited_response_then_a_new_connection():
    async def handler(req: dict, conn: dict, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil ")
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(b"the end")
        await writer.drain()
        return False  # the body ends when the connection closes

    async def go() -> None:
        transport = AsyncioHTTP11Transport(4)
        async with MiniServer(handler) as srv, httpx.AsyncClient(transport=transport) as c:
            for _ in range(2):
                assert (await c.get(srv.url)).text == "until the end"
            assert srv.accepted == 2 and transport.connections_opened == 2

    _run(go)


def test_connection_close_header_is_honoured():
    async def handler(req: dict, conn: dict, writer: asyncio.StreamWriter) -> None:
        writer.write(_response(b"bye", headers={"Connection": "close"}))  # server keeps the socket open

    async def go() -> None:
        transport = AsyncioHTTP11Transport(4)
        async with MiniServer(handler) as srv, httpx.AsyncClient(transport=transport) as c:
            for _ in range(3):
                assert (await c.get(srv.url)).text == "bye"
            assert transport.connections_opened == 3 and srv.accepted == 3
            await asyncio.sleep(0.05)
            assert srv.open == 0  # the client closed each one

    _run(go)


def test_server_closing_an_idle_connection_is_noticed():
    async def handler(req: dict, conn: dict, writer: asyncio.StreamWriter) -> bool:
        writer.write(_response(b"once"))
        await writer.drain()
        return False  # keep-alive response, then the server closes the idle connection

    async def go() -> None:
        transport = AsyncioHTTP11Transport(4)
        async with MiniServer(handler) as srv, httpx.AsyncClient(transport=transport) as c:
            assert (await c.get(srv.url)).text == "once"
            await asyncio.sleep(0.05)
            assert transport.num_connections == 0  # dropped from the pool when the server closed it
            assert (await c.get(srv.url)).text == "once"
            assert srv.accepted == 2

    _run(go)


def test_stale_reused_connection_is_retried_once_on_a_new_one():
    async def handler(req: dict, conn: dict, writer: asyncio.StreamWriter) -> bool | None:
        if conn["n"] > 1:  # the server dropped this keep-alive connection just as the request arrived
            return False
        writer.write(_response(b"fresh:" + req["body"]))
        return None

    async def go() -> None:
        transport = AsyncioHTTP11Transport(4)
        async with MiniServer(handler) as srv, httpx.AsyncClient(transport=transport) as c:
            assert (await c.post(srv.url, content=b"1")).text == "fresh:1"
            assert (await c.post(srv.url, content=b"2")).text == "fresh:2"  # resent on a new connection
            assert srv.accepted == 2 and transport.connections_opened == 2

    _run(go)


def test_a_new_connection_closed_before_the_response_is_an_error_not_a_retry():
    async def handler(req: dict, conn: dict, writer: asyncio.StreamWriter) -> bool:
        return False

    async def go() -> None:
        async with MiniServer(handler) as srv, httpx.AsyncClient(transport=AsyncioHTTP11Transport(4)) as c:
            with pytest.raises(httpx.RemoteProtocolError):
                await c.post(srv.url, content=b"x")
            assert srv.accepted == 1

    _run(go)


def test_truncated_content_length_body_is_a_protocol_error():
    async def handler(req: dict, conn: dict, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await writer.drain()
        return False

    async def go() -> None:
        transport = AsyncioHTTP11Transport(4)
        async with MiniServer(handler) as srv, httpx.AsyncClient(transport=transport) as c:
            with pytest.raises(httpx.RemoteProtocolError):
                await c.get(srv.url)
            assert transport.num_connections == 0

    _run(go)


def test_gzip_body_is_decoded_by_httpx_and_informational_responses_are_skipped():
    payload = json.dumps({"answer": 42}).encode()

    async def handler(req: dict, conn: dict, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = gzip.compress(payload)
        writer.write(
            _response(body, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
        )

    async def go() -> None:
        async with MiniServer(handler) as srv, httpx.AsyncClient(transport=AsyncioHTTP11Transport(4)) as c:
            r = await c.get(srv.url)
            assert r.status_code == 200 and r.json() == {"answer": 42}

    _run(go)


def test_no_body_responses_and_streamed_request_bodies():
    async def handler(req: dict, conn: dict, writer: asyncio.StreamWriter) -> None:
        if req["method"] == "HEAD":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")  # HEAD: no body follows
        elif req["target"].endswith("/empty"):
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        else:
            writer.write(_response(b"got:" + req["body"]))

    async def parts():
        for part in (b"a", b"bc", b"def"):
            yield part

    async def go() -> None:
        transport = AsyncioHTTP11Transport(4)
        async with MiniServer(handler) as srv, httpx.AsyncClient(transport=transport) as c:
            assert (await c.head(srv.url)).headers["content-length"] == "100"
            assert (await c.get(srv.url + "/empty")).status_code == 204
            assert (await c.post(srv.url, content=parts())).text == "got:abcdef"  # chunked upload
            assert srv.accepted == 1

    _run(go)


def test_head_split_byte_by_byte_chunk_extensions_and_folded_headers():
    raw = (
        b"HTTP/1.1 200 OK\r\nX-Folded: a\r\n  b\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3;name=value\r\nabc\r\n0\r\n\r\n"
    )

    async def handler(req: dict, conn: dict, writer: asyncio.StreamWriter) -> None:
        if req["target"].endswith("/plain"):
            for i in range(len(raw)):  # one byte per write: every parser state waits for more data
                writer.write(raw[i : i + 1])
                await writer.drain()
        else:
            writer.write(_response(b"x"))

    async def go() -> None:
        transport = AsyncioHTTP11Transport(2)
        async with MiniServer(handler) as srv, httpx.AsyncClient(transport=transport) as c:
            r = await c.get(srv.url + "/plain")
            assert r.content == b"abc" and r.headers["x-folded"] == "a b"
            assert (await c.get(srv.url)).text == "x"
            assert srv.accepted == 1

    _run(go)


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/2 200 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nBad Header: x\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 3, 4\r\n\r\nabcd",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n",
    ],
    ids=[
        "version",
        "status",
        "header-name",
        "conflicting-length",
        "negative-length",
        "chunk-size",
        "chunk-overrun",
    ],
)
def test_malformed_responses_are_protocol_errors(raw):
    async def handler(req: dict, conn: dict, writer: asyncio.StreamWriter) -> None:
        writer.write(raw)

    async def go() -> None:
        transport = AsyncioHTTP11Transport(2)
        async with MiniServer(handler) as srv, httpx.AsyncClient(transport=transport) as c:
            with pytest.raises(httpx.RemoteProtocolError):
                await c.get(srv.url)
            assert transport.num_connections == 0

    _run(go)


def test_http10_responses_are_not_reused_and_header_injection_is_refused():
    async def handler(req: dict, conn: dict, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")

    async def go() -> None:
        transport = AsyncioHTTP11Transport(2)
        async with MiniServer(handler) as srv, httpx.AsyncClient(transport=transport) as c:
            for _ in range(2):
                assert (await c.get(srv.url)).text == "ok"
            assert transport.connections_opened == 2
            with pytest.raises(httpx.LocalProtocolError):
                await c.get(srv.url, headers={"X-A": "a\r\nX-Injected: b"})

    _run(go)


# ---------------------------------------------------------------------- timeouts and errors


def test_read_timeout_raises_and_frees_the_connection():
    async def handler(req: dict, conn: dict, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    async def go() -> None:
        transport = AsyncioHTTP11Transport(4)
        async with MiniServer(handler) as srv, httpx.AsyncClient(transport=transport) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.get(srv.url, timeout=httpx.Timeout(5.0, read=0.2))
            assert transport.num_connections == 0

    _run(go)


def test_connect_refused_raises_connect_error():
    async def go() -> None:
        transport = AsyncioHTTP11Transport(4)
        async with httpx.AsyncClient(transport=transport) as c:
            with pytest.raises(httpx.ConnectError):
                await c.get(f"http://127.0.0.1:{_free_port()}/")
            assert transport.num_connections == 0

    _run(go)


def test_unsupported_scheme_and_bad_arguments():
    with pytest.raises(ValueError, match="max_connections"):
        AsyncioHTTP11Transport(0)
    with pytest.raises(ValueError, match="keepalive_expiry"):
        AsyncioHTTP11Transport(1, keepalive_expiry=-1)

    async def go() -> None:
        async with httpx.AsyncClient(transport=AsyncioHTTP11Transport(1)) as c:
            with pytest.raises(httpx.UnsupportedProtocol):
                await c.get("ftp://127.0.0.1/x")

    _run(go)


# ---------------------------------------------------------------------- pool limit, cancellation


def test_pool_limit_holds_under_50_concurrent_requests():
    async def handler(req: dict, conn: dict, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.02)
        writer.write(_response(req["body"]))

    async def go() -> None:
        transport = AsyncioHTTP11Transport(8)
        seen = []
        async with MiniServer(handler) as srv, httpx.AsyncClient(transport=transport) as c:

            async def one(i: int) -> bytes:
                r = await c.post(srv.url, content=str(i).encode())
                seen.append(transport.num_connections)
                return r.content

            out = await asyncio.gather(*[one(i) for i in range(50)])
            assert out == [str(i).encode() for i in range(50)]
            assert srv.peak <= 8 and srv.accepted == 8 and max(seen) <= 8
            assert transport.connections_opened == 8

    _run(go)


def test_pool_timeout_when_every_connection_is_busy():
    async def handler(req: dict, conn: dict, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.5)
        writer.write(_response(b"late"))

    async def go() -> None:
        async with MiniServer(handler) as srv, httpx.AsyncClient(transport=AsyncioHTTP11Transport(1)) as c:
            slow = asyncio.create_task(c.get(srv.url))
            await asyncio.sleep(0.05)
            with pytest.raises(httpx.PoolTimeout):
                await c.get(srv.url, timeout=httpx.Timeout(5.0, pool=0.1))
            assert (await slow).text == "late"

    _run(go)


def test_cancellation_closes_the_connection_and_frees_its_slot():
    async def handler(req: dict, conn: dict, writer: asyncio.StreamWriter) -> None:
        if req["body"] == b"hang":
            await asyncio.sleep(5)
        writer.write(_response(b"done"))

    async def go() -> None:
        transport = AsyncioHTTP11Transport(1)
        async with MiniServer(handler) as srv, httpx.AsyncClient(transport=transport) as c:
            hung = asyncio.create_task(c.post(srv.url, content=b"hang"))
            waiting = asyncio.create_task(c.post(srv.url, content=b"next"))  # queued for the one slot
            await asyncio.sleep(0.1)
            assert transport.num_connections == 1
            hung.cancel()
            with pytest.raises(asyncio.CancelledError):
                await hung
            assert (await waiting).text == "done"  # got the freed slot
            reused = asyncio.create_task(c.post(srv.url, content=b"hang"))  # takes the idle connection
            queued = asyncio.create_task(c.post(srv.url, content=b"never sent"))  # waits for the slot
            await asyncio.sleep(0.05)
            queued.cancel()  # cancelled while waiting in the pool's queue
            await asyncio.gather(queued, return_exceptions=True)
            assert not transport._waiters and transport.num_connections == 1
            reused.cancel()
            await asyncio.gather(reused, return_exceptions=True)
            assert transport.num_connections == 0
            assert (await c.post(srv.url, content=b"again")).text == "done"
            assert srv.accepted == 3  # the cancelled requests' connections were closed, not reused

    _run(go)


def test_aclose_closes_idle_connections():
    async def go() -> None:
        transport = AsyncioHTTP11Transport(4)
        async with MiniServer(_ok) as srv:
            async with httpx.AsyncClient(transport=transport) as c:
                await asyncio.gather(*[c.get(srv.url) for _ in range(3)])
                assert transport.num_connections == 3
            await asyncio.sleep(0.05)
            assert transport.num_connections == 0 and srv.open == 0

    _run(go)


# ---------------------------------------------------------------------- TLS


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command line tool")
def test_tls_with_a_trusted_self_signed_certificate(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    proc = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {proc.stderr[-300:]}")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(cert))

    async def go() -> None:
        async with MiniServer(_ok, ssl_context=server_ctx) as srv:
            url = f"https://localhost:{srv.port}/secure"
            transport = AsyncioHTTP11Transport(2, verify=trusting)
            async with httpx.AsyncClient(transport=transport) as c:
                for _ in range(2):
                    assert (await c.post(url, content=b"tls")).text == "ok:tls"
                assert transport.connections_opened == 1
            async with httpx.AsyncClient(transport=AsyncioHTTP11Transport(2)) as c:
                with pytest.raises(httpx.ConnectError):  # not in the default trust store
                    await c.get(url)

    _run(go)


# ---------------------------------------------------------------------- the replay's client


def test_proxy_env_detection():
    assert not proxy_env_set({})
    assert not proxy_env_set({"HTTPS_PROXY": "", "NO_PROXY": "*"})
    for name in ("HTTP_PROXY", "https_proxy", "All_Proxy"):
        assert proxy_env_set({name: "http://proxy:3128"})


def test_replay_uses_the_asyncio_transport_unless_a_proxy_or_client_is_given(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    rp = TeacherReplayer([teacher("a/one", "http://127.0.0.1:9/v1")], max_concurrency=7)
    client, owned = rp._make_http()
    assert owned and isinstance(client._transport, AsyncioHTTP11Transport)
    assert client._transport.max_connections == 7

    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:3128")
    client, owned = rp._make_http()
    assert owned and isinstance(client._transport, httpx.AsyncHTTPTransport)  # stock httpx

    mine = httpx.AsyncClient()
    rp = TeacherReplayer([teacher("a/one", "http://127.0.0.1:9/v1")], http_client=mine)
    assert rp._make_http() == (mine, False)

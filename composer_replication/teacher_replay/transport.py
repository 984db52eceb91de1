"""A lean HTTP/1.1 transport over asyncio for the replay's one ``httpx.AsyncClient``.

httpx's stock transport (httpcore on anyio) spent about 1.9 ms of CPU per request on this project's
benchmark machine (cancel scopes, ``sniffio`` look-ups, ``fail_after`` and connection-pool scans per
request), which capped one replay process at a few hundred calls per second whatever its concurrency.
:class:`AsyncioHTTP11Transport` is an ``httpx.AsyncBaseTransport`` (the documented way to swap what
sits under an ``httpx.AsyncClient``: the client, its ``Request`` / ``Response`` objects, content
decoding and exception types stay httpx's) that speaks HTTP/1.1 over an ``asyncio.Protocol``:

- one keep-alive pool per ``(scheme, host, port)`` under one cap on the total number of connections
  (a request beyond it waits for a free one); idle connections are reused newest first and dropped
  when the server closes them, after ``keepalive_expiry`` seconds idle, or after a response that
  said ``Connection: close`` (or came as HTTP/1.0, or was close-delimited); a request whose *reused*
  connection turns out to be dead before any byte of the response arrived is sent again, once, on
  a new connection (only when its body is in memory);
- TLS for ``https`` with SNI and hostname checks, by default with stock httpx's trust store;
- response framing by a small parser here: Content-Length, ``Transfer-Encoding: chunked`` (with
  extensions and trailers), close-delimited bodies, ``1xx`` responses skipped, no body for ``HEAD`` /
  204 / 304; malformed framing raises ``httpx.RemoteProtocolError``. (``h11`` does the same job, but
  it cost 0.15-0.2 ms of CPU per request here, a fifth of the whole client's, against ~0.01 ms.)
  The request head is written in one segment with its body; header names are checked to be tokens
  and a CR, LF or NUL in a header value is refused (``httpx.LocalProtocolError``);
- timeouts from the request's ``extensions["timeout"]`` (``connect`` / ``read`` per wait for data /
  ``write`` while the send buffer is full / ``pool``) raising ``httpx.ConnectTimeout`` /
  ``ReadTimeout`` / ``WriteTimeout`` / ``PoolTimeout``; failures raise ``httpx.ConnectError`` (refused,
  DNS, TLS), ``httpx.ReadError`` (reset) or ``httpx.RemoteProtocolError`` (closed early, bad framing),
  so callers classify them as they would httpx's own;
- a cancelled request closes its connection and frees its slot; :meth:`AsyncioHTTP11Transport.aclose`
  closes every connection.

No proxies and no HTTP/2: :func:`proxy_env_set` tells callers when to keep httpx's stock transport.
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx

__all__ = ["AsyncioHTTP11Transport", "proxy_env_set"]

_PROXY_VARS = frozenset({"http_proxy", "https_proxy", "all_proxy"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_NO_TIMEOUT: Mapping[str, float | None] = {}
_MAX_HEAD = 65536  # longest response head (and chunk-size line) accepted
_CHUNKED, _UNTIL_CLOSE = -1, -2  # body framings besides a Content-Length
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+").fullmatch  # a header name
_DIGITS = re.compile(rb"[0-9]{1,18}").fullmatch
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}").fullmatch


def proxy_env_set(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``HTTP_PROXY``, ``HTTPS_PROXY`` or ``ALL_PROXY`` (any case) is set and non-empty."""
    env = os.environ if environ is None else environ
    return any(value and name.lower() in _PROXY_VARS for name, value in env.items())


class _StaleConnection(Exception):
    """A reused connection died before any byte of the response arrived: the request is resent once."""


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(False)


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: an asyncio protocol with a receive buffer, and the framing rules."""

    def __init__(self, pool: AsyncioHTTP11Transport, key: tuple[str, str, int]) -> None:
        self.pool = pool
        self.key = key
        self.loop = pool._loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()  # received, not yet parsed
        self.eof = False  # the peer finished sending (or the connection is gone)
        self.closed = False  # closed by us or by the peer; never handed out again
        self.counted = True  # holds one of the pool's slots
        self.in_pool = False  # sitting idle in the pool
        self.requests = 0  # requests sent on this connection
        self.received = 0  # bytes received for the current request
        self.idle_since = 0.0
        self.lost = False
        self.lost_exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._paused = False
        self._drain: asyncio.Future | None = None

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # noqa: D102
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:  # noqa: D102
        if self.in_pool or self.closed:  # unsolicited bytes on an idle connection: unusable
            self.close()
            return
        self.received += len(data)
        self.buf += data
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    def eof_received(self) -> bool | None:  # noqa: D102
        self.eof = True
        if self.in_pool:
            self.close()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)
        return None  # let the transport close itself

    def connection_lost(self, exc: BaseException | None) -> None:  # noqa: D102
        self.lost = self.eof = self.closed = True
        self.lost_exc = exc
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(True)
        self.pool._forget(self)

    def pause_writing(self) -> None:  # noqa: D102
        self._paused = True

    def resume_writing(self) -> None:  # noqa: D102
        self._paused = False
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(True)

    # ------------------------------------------------------------------ helpers

    def close(self, *, abort: bool = False) -> None:
        """Close the socket (``abort``: drop unsent data) and give the pool slot back."""
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                if abort:
                    self.transport.abort()
                else:
                    self.transport.close()
        self.pool._forget(self)

    async def wait_data(self, timeout: float | None) -> None:
        """Wait for more bytes (or EOF); ``httpx.ReadTimeout`` after ``timeout`` seconds."""
        fut = self.loop.create_future()
        self._waiter = fut
        handle = None if timeout is None else self.loop.call_later(timeout, _expire, fut)
        try:
            ok = await fut
        finally:
            self._waiter = None
            if handle is not None:
                handle.cancel()
        if not ok:
            raise httpx.ReadTimeout(f"no data from the server within {timeout:g}s")

    def ended(self, what: str) -> Exception:
        """The error for a connection that ended in the middle of ``what``."""
        if self.received == 0 and self.requests > 1:
            return _StaleConnection(f"the server closed the connection before {what}")
        if self.lost_exc is not None:
            return httpx.ReadError(f"the connection was lost during {what}: {self.lost_exc!r}")
        return httpx.RemoteProtocolError(f"the server closed the connection during {what}")

    async def _drain_writes(self, timeout: float | None) -> None:
        """Wait while the write buffer is over its high-water mark (returns early if the peer left)."""
        while self._paused and not self.lost:
            fut = self.loop.create_future()
            self._drain = fut
            handle = None if timeout is None else self.loop.call_later(timeout, _expire, fut)
            try:
                ok = await fut
            finally:
                self._drain = None
                if handle is not None:
                    handle.cancel()
            if not ok:
                raise httpx.WriteTimeout(f"could not send the request within {timeout:g}s")

    # ------------------------------------------------------------------ one request

    async def send(self, request: httpx.Request, body: bytes | None, timeouts: Mapping[str, Any]) -> _Head:
        """Write ``request`` and read the response head (the body is read by :class:`_Body`)."""
        if self.closed or self.transport is None:
            raise _StaleConnection("the connection closed while idle")
        self.requests += 1
        self.received = 0
        head, chunked = _request_head(request)
        write = self.transport.write
        write_timeout = timeouts.get("write")
        if body is not None:
            write(head + body)  # one segment for the usual small request
            if self._paused:
                await self._drain_writes(write_timeout)
        else:
            write(head)
            async for chunk in request.stream:  # type: ignore[union-attr]
                if chunk and not self.lost:
                    write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
                    if self._paused:
                        await self._drain_writes(write_timeout)
            if chunked and not self.lost:
                write(b"0\r\n\r\n")
        # A peer that left while we were writing may still have sent a response (e.g. 413): read it.
        read_timeout = timeouts.get("read")
        buf = self.buf
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    raise httpx.RemoteProtocolError(f"the response head is longer than {_MAX_HEAD} bytes")
                if self.eof:
                    raise self.ended("the response head")
                await self.wait_data(read_timeout)
                continue
            raw = bytes(buf[:end])
            del buf[: end + 4]
            parsed = _parse_head(raw, request.method == "HEAD")
            if parsed is not None:  # None: a 1xx informational response, skipped
                return parsed


class _Head:
    """A parsed response head and how its body is framed."""

    __slots__ = ("status", "reason", "headers", "length", "keep_alive")

    def __init__(self, status: int, reason: bytes, headers: list, length: int, keep_alive: bool) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.length = length  # >= 0: Content-Length; _CHUNKED; _UNTIL_CLOSE
        self.keep_alive = keep_alive


def _request_head(request: httpx.Request) -> tuple[bytes, bool]:
    """The request line and headers (``httpx.LocalProtocolError`` for a header that would break them)."""
    raw = request.headers.raw
    parts = [request.method.encode("ascii"), b" ", request.url.raw_path, b" HTTP/1.1\r\n"]
    chunked = False
    for name, value in raw:
        if not _TOKEN(name):
            raise httpx.LocalProtocolError(f"invalid header name {name!r}")
        if name.lower() == b"transfer-encoding":
            chunked = value.lower().rstrip().endswith(b"chunked")
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    head = b"".join(parts)
    lines = len(raw) + 2
    if head.count(b"\n") != lines or head.count(b"\r") != lines or b"\0" in head:
        raise httpx.LocalProtocolError("a header value or the URL contains a line break or NUL byte")
    return head, chunked


def _parse_head(raw: bytes, head_request: bool) -> _Head | None:
    """Parse a response head (status line and headers, without the blank line); ``None`` for 1xx."""
    lines = raw.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code, _, reason = rest.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise httpx.RemoteProtocolError(f"malformed status line {lines[0][:100]!r}")
    status = int(code)
    headers: list[tuple[bytes, bytes]] = []
    length: int | None = None
    transfer: bytes | None = None
    close = version == b"HTTP/1.0"
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN(name):
            if line[:1] in (b" ", b"\t") and headers:  # obsolete line folding: continues the last value
                headers[-1] = (headers[-1][0], headers[-1][1] + b" " + line.strip(b" \t"))
                continue
            raise httpx.RemoteProtocolError(f"malformed header line {line[:100]!r}")
        value = value.strip(b" \t")
        headers.append((name, value))
        lowered = name.lower()
        if lowered == b"content-length":
            values = {v.strip() for v in value.split(b",")}
            if (
                len(values) != 1
                or not _DIGITS(v := values.pop())
                or (length is not None and int(v) != length)
            ):
                raise httpx.RemoteProtocolError(f"bad Content-Length {value[:40]!r}")
            length = int(v)
        elif lowered == b"transfer-encoding":
            transfer = value if transfer is None else transfer + b"," + value
        elif lowered == b"connection":
            close = close or b"close" in [t.strip(b" \t") for t in value.lower().split(b",")]
    if status < 200:
        if status == 101:
            raise httpx.RemoteProtocolError("the server switched protocols; only HTTP/1.1 is spoken here")
        return None
    if head_request or status in (204, 304):
        length = 0
    elif transfer is not None:  # wins over Content-Length; anything but a final "chunked" runs to the close
        chunked = transfer.rsplit(b",", 1)[-1].strip(b" \t").lower() == b"chunked"
        close = close or length is not None  # both framings sent: read this one, trust no more
        length = _CHUNKED if chunked else _UNTIL_CLOSE
    elif length is None:
        length = _UNTIL_CLOSE
    return _Head(status, reason, headers, length, not close and length != _UNTIL_CLOSE)


class _Body(httpx.AsyncByteStream):
    """A response body read from its connection; closing it pools (or closes) the connection."""

    def __init__(self, conn: _Connection, head: _Head, read_timeout: float | None) -> None:
        self._conn: _Connection | None = conn
        self._head = head
        self._read_timeout = read_timeout
        self._complete = head.length == 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None:
            raise httpx.StreamClosed()
        if self._complete:
            return
        length = self._head.length
        buf = conn.buf
        if 0 < length <= len(buf):  # the usual case: the whole body arrived with the head
            chunk = bytes(buf[:length])
            del buf[:length]
            self._complete = True
            yield chunk
            return
        if length > 0:
            async for chunk in self._fixed(conn, length):
                yield chunk
        elif length == _CHUNKED:
            async for chunk in self._chunked(conn):
                yield chunk
        else:
            while True:
                if buf:
                    chunk = bytes(buf)
                    buf.clear()
                    yield chunk
                elif conn.eof:
                    if conn.lost_exc is not None:
                        raise conn.ended("the response body")
                    break
                else:
                    await conn.wait_data(self._read_timeout)
        self._complete = True

    async def _fixed(self, conn: _Connection, remaining: int) -> AsyncIterator[bytes]:
        buf = conn.buf
        while remaining:
            if buf:
                if len(buf) <= remaining:
                    chunk = bytes(buf)
                    buf.clear()
                else:
                    chunk = bytes(buf[:remaining])
                    del buf[:remaining]
                remaining -= len(chunk)
                yield chunk
            elif conn.eof:
                raise conn.ended(f"the response body ({remaining} bytes missing)")
            else:
                await conn.wait_data(self._read_timeout)

    async def _line(self, conn: _Connection) -> bytes:
        buf = conn.buf
        while True:
            end = buf.find(b"\r\n")
            if end >= 0:
                line = bytes(buf[:end])
                del buf[: end + 2]
                return line
            if len(buf) > _MAX_HEAD:
                raise httpx.RemoteProtocolError("a chunked-body line is too long")
            if conn.eof:
                raise conn.ended("a chunked response body")
            await conn.wait_data(self._read_timeout)

    async def _chunked(self, conn: _Connection) -> AsyncIterator[bytes]:
        while True:
            size_text = (await self._line(conn)).split(b";", 1)[0].strip(b" \t")
            if not _HEX(size_text):
                raise httpx.RemoteProtocolError(f"bad chunk size {size_text[:20]!r}")
            size = int(size_text, 16)
            if size == 0:
                while await self._line(conn):  # trailer fields, ignored
                    pass
                return
            async for chunk in self._fixed(conn, size):
                yield chunk
            if await self._line(conn):
                raise httpx.RemoteProtocolError("a chunk is longer than its size")

    async def aclose(self) -> None:
        """Release the connection (to the pool when the body was read to the end)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._complete and self._head.keep_alive and not conn.closed and not conn.buf and not conn.eof:
            conn.pool._release(conn)
        else:
            conn.close(abort=not self._complete)


class AsyncioHTTP11Transport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over asyncio with a keep-alive pool; use as ``httpx.AsyncClient(transport=...)``.

    Args:
        max_connections: open connections over all hosts (>= 1); requests beyond it wait for a free
            connection (up to the request's ``pool`` timeout, then ``httpx.PoolTimeout``).
        verify: ``True`` (the default trust store of stock httpx: certifi, or ``$SSL_CERT_FILE`` /
            ``$SSL_CERT_DIR``), ``False`` (no certificate check), or an ``ssl.SSLContext`` to use as is.
        keepalive_expiry: seconds an idle connection may be reused after its last response.

    Attributes:
        connections_opened: connections opened so far (a count for tests and diagnostics).

    Raises:
        ValueError: ``max_connections`` < 1 or a negative ``keepalive_expiry``.

    Must be used from one event loop at a time (the loop of its first request; after :meth:`aclose`
    it may be used again, e.g. from a new loop).
    """

    def __init__(
        self,
        max_connections: int = 32,
        *,
        verify: ssl.SSLContext | bool = True,
        keepalive_expiry: float = 5.0,
    ) -> None:
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise ValueError(f"max_connections must be an integer >= 1; got {max_connections!r}.")
        if keepalive_expiry < 0:
            raise ValueError(f"keepalive_expiry must be >= 0 seconds; got {keepalive_expiry!r}.")
        self.max_connections = max_connections
        self.keepalive_expiry = float(keepalive_expiry)
        self._verify = verify
        self._ssl_context: ssl.SSLContext | None = verify if isinstance(verify, ssl.SSLContext) else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._conns: set[_Connection] = set()  # every connection holding a slot
        self._num = 0  # slots in use: open or opening connections
        self._waiters: collections.deque[tuple[tuple[str, str, int], asyncio.Future]] = collections.deque()
        self.connections_opened = 0

    def __repr__(self) -> str:
        return (
            f"AsyncioHTTP11Transport(max_connections={self.max_connections}, open={self._num}, "
            f"idle={sum(map(len, self._idle.values()))})"
        )

    @property
    def num_connections(self) -> int:
        """Connections open (or being opened) now."""
        return self._num

    # ------------------------------------------------------------------ pool

    def _ssl(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            ctx = httpx.create_ssl_context(verify=self._verify)
            ctx.set_alpn_protocols(["http/1.1"])
            self._ssl_context = ctx
        return self._ssl_context

    def _free_slot(self) -> None:
        """One slot fewer in use: hand it to the first live waiter (who opens a new connection)."""
        self._num -= 1
        while self._waiters and self._num < self.max_connections:
            _, fut = self._waiters.popleft()
            if not fut.done():
                self._num += 1
                fut.set_result(None)  # None: open a new connection on this slot

    def _forget(self, conn: _Connection) -> None:
        """``conn`` is closed: drop it from the pool and free its slot (once)."""
        if not conn.counted:
            return
        conn.counted = False
        self._conns.discard(conn)
        if conn.in_pool:
            conn.in_pool = False
            idle = self._idle.get(conn.key)
            if idle is not None and conn in idle:
                idle.remove(conn)
        self._free_slot()

    def _release(self, conn: _Connection) -> None:
        """``conn`` finished a response and can be reused: hand it to a waiter or pool it."""
        waiters = self._waiters
        while waiters:
            key, fut = waiters[0]
            if fut.done():
                waiters.popleft()
                continue
            if key == conn.key:
                waiters.popleft()
                fut.set_result(conn)
            else:  # the first waiter wants another host: its slot is worth more there
                conn.close()
            return
        conn.in_pool = True
        conn.idle_since = time.monotonic()
        idle = self._idle.get(conn.key)
        if idle is None:
            self._idle[conn.key] = [conn]
        else:
            idle.append(conn)

    def _take_idle(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        expiry = time.monotonic() - self.keepalive_expiry
        while idle:
            conn = idle.pop()  # newest first
            conn.in_pool = False
            if not conn.closed and conn.idle_since >= expiry:
                return conn
            conn.close()
        return None

    async def _acquire(self, key: tuple[str, str, int], timeout: float | None) -> _Connection | None:
        """An idle connection for ``key``, or ``None`` with a slot reserved for a new connection."""
        conn = self._take_idle(key)
        if conn is not None:
            return conn
        if self._num >= self.max_connections:  # full: close another host's idle connection, if any
            for other in self._idle.values():
                if other:
                    other[-1].close()
                    break
        if self._num < self.max_connections:
            self._num += 1
            return None
        loop = self._loop
        assert loop is not None
        fut = loop.create_future()
        entry = (key, fut)
        self._waiters.append(entry)
        handle = None if timeout is None else loop.call_later(timeout, _expire, fut)
        try:
            got = await fut
        except BaseException:  # cancelled: give back what may have been handed over meanwhile
            if fut.done() and not fut.cancelled():
                got = fut.result()
                if isinstance(got, _Connection):
                    self._release(got)
                elif got is None:
                    self._free_slot()
            elif entry in self._waiters:
                self._waiters.remove(entry)
            raise
        finally:
            if handle is not None:
                handle.cancel()
        if got is False:
            if entry in self._waiters:
                self._waiters.remove(entry)
            raise httpx.PoolTimeout(
                f"no connection became free within {timeout:g}s ({self.max_connections} in use)"
            )
        return got

    def _bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve requests from ``loop``; idle connections of a previous (finished) loop are dropped."""
        if any(not conn.in_pool for conn in self._conns):
            raise RuntimeError(
                "AsyncioHTTP11Transport has requests in flight on another event loop; "
                "use one transport per event loop."
            )
        self._waiters.clear()
        for conn in list(self._conns):
            conn.closed = True
            self._forget(conn)
            try:
                if conn.transport is not None:
                    conn.transport.abort()
            except RuntimeError:  # that loop is closed; its sockets went with it
                pass
        self._loop = loop

    async def _connect(
        self, request: httpx.Request, key: tuple[str, str, int], timeout: float | None
    ) -> _Connection:
        """Open a connection on a slot already reserved by :meth:`_acquire`."""
        scheme, host, port = key
        conn = _Connection(self, key)
        self._conns.add(conn)
        ssl_ctx = server_hostname = None
        if scheme == "https":
            ssl_ctx = self._ssl()
            sni = request.extensions.get("sni_hostname")
            server_hostname = sni.decode("ascii") if isinstance(sni, bytes) else (sni or host)
        try:
            coro = self._loop.create_connection(  # type: ignore[union-attr]
                lambda: conn, host, port, ssl=ssl_ctx, server_hostname=server_hostname
            )
            await asyncio.wait_for(coro, timeout)
        except asyncio.TimeoutError:
            conn.close(abort=True)
            raise httpx.ConnectTimeout(f"could not connect to {host}:{port} within {timeout:g}s") from None
        except OSError as exc:  # refused, unreachable, DNS failure, TLS handshake or certificate failure
            conn.close(abort=True)
            raise httpx.ConnectError(f"could not connect to {host}:{port}: {exc}") from None
        except BaseException:
            conn.close(abort=True)
            raise
        self.connections_opened += 1
        return conn

    # ------------------------------------------------------------------ httpx.AsyncBaseTransport

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` on a pooled (or new) connection; the response body streams from it."""
        url = request.url
        scheme = url.scheme
        port = url.port or _DEFAULT_PORTS.get(scheme)
        if port is None:
            raise httpx.UnsupportedProtocol(f"unsupported URL scheme {scheme!r}; use http:// or https://")
        if not url.raw_host:
            raise httpx.UnsupportedProtocol(f"the URL {url!r} has no host")
        key = (scheme, url.raw_host.decode("ascii"), port)
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._bind_loop(loop)
        timeouts = request.extensions.get("timeout", _NO_TIMEOUT)
        try:
            body: bytes | None = request.content
        except httpx.RequestNotRead:
            body = None  # a streaming body: sent once, never resent
        for attempt in (0, 1):
            conn = await self._acquire(key, timeouts.get("pool"))
            if conn is None:
                conn = await self._connect(request, key, timeouts.get("connect"))
            try:
                head = await conn.send(request, body, timeouts)
            except _StaleConnection as exc:
                conn.close(abort=True)
                if attempt == 0 and body is not None:
                    continue
                raise httpx.RemoteProtocolError(f"the server closed the connection: {exc}") from None
            except BaseException:
                conn.close(abort=True)
                raise
            return httpx.Response(
                status_code=head.status,
                headers=head.headers,
                stream=_Body(conn, head, timeouts.get("read")),
                extensions={"http_version": b"HTTP/1.1", "reason_phrase": head.reason},
            )
        raise AssertionError("unreachable")  # pragma: no cover

    async def aclose(self) -> None:
        """Close every connection (idle or in use) and fail the requests waiting for one."""
        for conn in list(self._conns):
            conn.close(abort=True)
        self._idle.clear()
        while self._waiters:
            _, fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(False)
        self._loop = None

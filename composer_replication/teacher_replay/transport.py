"""A sharded connection pool for the replay's one ``httpx.AsyncClient``.

httpcore's connection pool does work proportional to its size on every request (it scans every
connection, polling idle sockets for expiry), so a single pool of 32+ connections spends several
milliseconds of CPU per call and caps throughput well below ``concurrency / latency``. This transport
keeps the same total connection limit but splits it into shards of ``shard_size`` connections (each
an ``httpx.AsyncHTTPTransport``) and sends each request to the shard with the fewest requests in
flight. A shard's slot is held until the response body is closed.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable

import httpx

__all__ = ["ShardedTransport"]


class _ReleasingStream(httpx.AsyncByteStream):
    """Wraps a response stream; calls ``release`` once when it is closed."""

    def __init__(self, stream: httpx.AsyncByteStream, release: Callable[[], None]) -> None:
        self._stream = stream
        self._release: Callable[[], None] | None = release

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            if self._release is not None:
                self._release()
                self._release = None


class ShardedTransport(httpx.AsyncBaseTransport):
    """``max_connections`` split over pools of ``shard_size`` connections.

    Args:
        max_connections: total connections (>= 1).
        shard_size: connections per pool (>= 1).
        **transport_kw: forwarded to each ``httpx.AsyncHTTPTransport`` (e.g. ``retries``, ``verify``).
    """

    def __init__(self, max_connections: int, *, shard_size: int = 4, **transport_kw: object) -> None:
        if max_connections < 1 or shard_size < 1:
            raise ValueError(
                f"max_connections and shard_size must be >= 1; got {max_connections} and {shard_size}."
            )
        n = math.ceil(max_connections / shard_size)
        per = math.ceil(max_connections / n)
        limits = httpx.Limits(max_connections=per, max_keepalive_connections=per)
        transport_kw.setdefault("verify", httpx.create_ssl_context())  # one CA load, shared by every shard
        self._shards = [httpx.AsyncHTTPTransport(limits=limits, **transport_kw) for _ in range(n)]  # type: ignore[arg-type]
        self._busy = [0] * n

    @property
    def num_shards(self) -> int:
        """How many pools the connections are split over."""
        return len(self._shards)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` on the least busy shard."""
        i = min(range(len(self._shards)), key=self._busy.__getitem__)
        self._busy[i] += 1

        def release() -> None:
            self._busy[i] -= 1

        try:
            resp = await self._shards[i].handle_async_request(request)
        except BaseException:
            release()
            raise
        assert isinstance(resp.stream, httpx.AsyncByteStream)
        return httpx.Response(
            status_code=resp.status_code,
            headers=resp.headers,
            stream=_ReleasingStream(resp.stream, release),
            extensions=resp.extensions,
        )

    async def aclose(self) -> None:
        """Close every shard."""
        for shard in self._shards:
            await shard.aclose()

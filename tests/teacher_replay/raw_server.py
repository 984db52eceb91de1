"""A loopback HTTP/1.1 server on raw sockets, for faults that a well-behaved server never shows.

Each request (head + ``Content-Length`` body) is handed to ``handler(conn, n, body)``, where ``n`` is
the request's index on its connection (0 for the first); the handler writes whatever bytes it
likes to ``conn`` and returns True to keep the connection open for another request. Every request
that arrived complete is counted in ``posts``.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable

Handler = Callable[[socket.socket, int, bytes], bool]


def ok_response(content: str = "ok", usage: dict | None = None, *, close: bool = False) -> bytes:
    """A complete 200 chat-completions reply."""
    body = {
        "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}
        ],
        "usage": usage or {"prompt_tokens": 10, "completion_tokens": 2},
    }
    return http_response(200, json.dumps(body).encode(), close=close)


def http_response(status: int, payload: bytes, *, close: bool = False, headers: dict | None = None) -> bytes:
    """Raw bytes of an HTTP/1.1 response with a Content-Length body."""
    lines = [f"HTTP/1.1 {status} X", "Content-Type: application/json", f"Content-Length: {len(payload)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


class RawServer:
    """Serve ``handler`` on 127.0.0.1 (free port) in daemon threads; use as a context manager."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.posts = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._closed = False

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>/v1``."""
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}/v1"

    def __enter__(self) -> RawServer:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed = True
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf, n = b"", 0
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                while len(buf) < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                body, buf = buf[:length], buf[length:]
                with self._lock:
                    self.posts += 1
                if not self.handler(conn, n, body):
                    return
                n += 1
        except OSError:
            return
        finally:
            conn.close()

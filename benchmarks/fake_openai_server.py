"""A fake OpenAI-compatible (OpenRouter-style) chat-completions server for tests and benchmarks.

Stdlib only: a ``ThreadingHTTPServer`` on ``127.0.0.1`` (free port) in a daemon thread, HTTP/1.1
keep-alive. ``POST <base>/chat/completions`` answers like OpenRouter (``id``, ``provider``, ``model``,
``choices[0].message``, ``usage`` with or without ``cost``), records every request, and can inject
latency and faults: an HTTP status with an ``{"error": ...}`` body (optionally ``Retry-After``), a
malformed body, an error inside a 200 body, ``finish_reason: "error"``, a dropped connection, or a hang.

    with FakeOpenAIServer(latency_s=0.05, api_key="sk-test") as srv:
        srv.add_fault("status", status=429, retry_after=1, times=2)
        ...  # point a client at srv.base_url
        print(srv.count(status=200))

Run standalone (prints ``PORT <n>`` then serves until killed)::

    python -m benchmarks.fake_openai_server --latency 0.05
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Fault", "RecordedRequest", "FakeOpenAIServer", "default_reply"]

FAULT_KINDS = ("status", "malformed", "error_in_200", "finish_error", "drop", "hang")


@dataclass
class Fault:
    """One scripted fault, consumed FIFO by matching requests (``times=-1``: forever).

    kind: one of ``status``, ``malformed``, ``error_in_200``, ``finish_error``, ``drop``, ``hang``.
    model: only requests for this model match (``None``: any). status/code/message: the error
    (``{auth}`` in a ``status`` fault's message is replaced by the request's Authorization header).
    retry_after: ``Retry-After`` header value (``status`` faults). latency_s: extra delay (``hang``).
    """

    kind: str
    model: str | None = None
    times: int = 1
    status: int = 500
    code: int | None = None
    message: str = "injected fault"
    retry_after: float | str | None = None
    latency_s: float = 30.0


@dataclass
class RecordedRequest:
    """A request as the server saw it (``status``: what it answered; -1 for drop/hang; ``cost_usd``: what it
    billed: the priced tokens of a completion, 0 for every error)."""

    path: str
    model: str | None
    body: dict[str, Any] | None
    authorization: str | None
    time: float
    status: int = 0
    fault: str | None = None
    cost_usd: float = 0.0


def default_reply(body: dict[str, Any]) -> str:
    """A deterministic action derived from the last user message: every model agrees."""
    msgs = body.get("messages") or [{}]
    last = str(msgs[-1].get("content", ""))
    digest = hashlib.sha256(last.encode()).hexdigest()[:8]
    return "[TOOL_USE] name=Read input=" + json.dumps({"file_path": f"/repo/{digest}.py"})


@dataclass
class _Config:
    latency_s: float
    api_key: str | None
    reply: Callable[[dict[str, Any]], str | dict[str, Any]]
    prices: dict[str, tuple[float, float]]
    report_cost: bool
    faults: list[Fault] = field(default_factory=list)
    requests: list[RecordedRequest] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # no 40 ms Nagle / delayed-ACK stalls on keep-alive connections
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence access logs
        return

    def _send(self, status: int, payload: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self._headers_buffer.append(b"\r\n" + payload)  # headers and body leave in one write
        self.flush_headers()

    def do_POST(self) -> None:  # noqa: N802 - http.server API
        cfg = self.server.cfg
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        model = body.get("model") if isinstance(body, dict) else None
        rec = RecordedRequest(self.path, model, body, self.headers.get("Authorization"), time.monotonic())
        with cfg.lock:
            cfg.requests.append(rec)
            fault = self._take_fault(cfg, model)
        rec.fault = kind = fault.kind if fault else None
        if not self.path.rstrip("/").endswith("/chat/completions") or body is None:
            rec.status = 404 if body is not None else 400
            return self._send(rec.status, _err(rec.status, "unknown path or bad JSON"))
        if cfg.api_key is not None and rec.authorization != f"Bearer {cfg.api_key}":
            rec.status = 401
            return self._send(401, _err(401, "No auth credentials found"))
        if kind in ("drop", "hang"):
            rec.status = -1
            if kind == "hang":
                time.sleep(fault.latency_s)
            self.close_connection = True
            return
        if cfg.latency_s:
            time.sleep(cfg.latency_s)
        if kind == "status":
            rec.status = fault.status
            headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else None
            message = fault.message.replace("{auth}", rec.authorization or "")  # echo tests for key leaks
            return self._send(fault.status, _err(fault.status, message), headers)
        rec.status = 200
        if kind == "malformed":
            return self._send(200, b'{"choices": [ this is not json')
        if kind == "error_in_200":
            return self._send(200, _err(fault.code or 502, fault.message))
        self._send(200, json.dumps(self._completion(cfg, body, fault, rec)).encode())

    @staticmethod
    def _take_fault(cfg: _Config, model: str | None) -> Fault | None:
        for i, f in enumerate(cfg.faults):
            if f.model is None or f.model == model:
                if f.times > 0:
                    f.times -= 1
                    if f.times == 0:
                        cfg.faults.pop(i)
                return f
        return None

    @staticmethod
    def _completion(cfg: _Config, body: dict[str, Any], fault: Fault | None, rec: RecordedRequest) -> dict[str, Any]:
        out = cfg.reply(body)
        message = {"role": "assistant", "content": out} if isinstance(out, str) else out
        text = json.dumps(message.get("content")) + json.dumps(message.get("tool_calls") or "")
        pt = sum(len(str(m.get("content", ""))) for m in body.get("messages", [])) // 4 + 1
        ct = min(len(text) // 4 + 1, int(body.get("max_tokens") or 10**9))
        usage: dict[str, Any] = {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}
        model = str(body.get("model"))
        if model in cfg.prices:
            p_in, p_out = cfg.prices[model]
            rec.cost_usd = (pt * p_in + ct * p_out) / 1e6
            if cfg.report_cost:
                usage["cost"] = rec.cost_usd
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "message": message}
        if fault is not None and fault.kind == "finish_error":
            choice |= {"finish_reason": "error", "error": {"code": fault.code or 502, "message": fault.message}}
        return {"id": "gen-fake", "provider": "Fake", "model": model, "choices": [choice], "usage": usage}


def _err(code: int, message: str) -> bytes:
    return json.dumps({"error": {"code": code, "message": message, "metadata": {}}}).encode()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256
    cfg: _Config


class FakeOpenAIServer:
    """The fake server (see module docstring). Thread-safe recording; start/stop or use as a context.

    Args:
        latency_s: delay before every answer.
        api_key: when set, requests without ``Authorization: Bearer <api_key>`` get 401.
        reply: ``body -> content string | message dict`` (default :func:`default_reply`).
        prices: ``model -> (input, output)`` USD per million tokens, for ``usage.cost``.
        report_cost: include ``usage.cost`` for models in ``prices``.
    """

    def __init__(self, *, latency_s: float = 0.0, api_key: str | None = None,
                 reply: Callable[[dict[str, Any]], str | dict[str, Any]] = default_reply,
                 prices: dict[str, tuple[float, float]] | None = None, report_cost: bool = True) -> None:
        self.cfg = _Config(latency_s, api_key, reply, dict(prices or {}), report_cost)
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        assert self._httpd is not None, "call start() first"
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>/api/v1`` (OpenRouter-style prefix)."""
        return f"http://127.0.0.1:{self.port}/api/v1"

    def start(self) -> FakeOpenAIServer:
        """Bind a free loopback port and serve in a daemon thread."""
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.cfg = self.cfg
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True, name="fake-openai")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = self._thread = None

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_fault(self, kind: str, **kw: Any) -> None:
        """Script a :class:`Fault` (``kind`` in ``FAULT_KINDS``; ``kw`` its fields)."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}; got {kind!r}.")
        with self.cfg.lock:
            self.cfg.faults.append(Fault(kind, **kw))

    @property
    def requests(self) -> list[RecordedRequest]:
        """A snapshot of the recorded requests."""
        with self.cfg.lock:
            return list(self.cfg.requests)

    @property
    def billed_usd(self) -> float:
        """What the server billed so far (the sum of its completions' priced tokens)."""
        return sum(r.cost_usd for r in self.requests)

    def count(self, *, model: str | None = None, status: int | None = None) -> int:
        """Requests seen (optionally for one model / answered with one status)."""
        return sum((model is None or r.model == model) and (status is None or r.status == status)
                   for r in self.requests)


def main() -> None:
    """Serve until killed; print ``PORT <n>`` once listening."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latency", type=float, default=0.0, help="seconds of delay before every answer")
    ap.add_argument("--api-key", default=None, help="require this bearer key (else any key is accepted)")
    args = ap.parse_args()
    srv = FakeOpenAIServer(latency_s=args.latency, api_key=args.api_key).start()
    print(f"PORT {srv.port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        srv.stop()


if __name__ == "__main__":
    main()

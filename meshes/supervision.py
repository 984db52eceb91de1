"""Supervision: every actor failure reaches the controller as one clear error, and nothing hangs.

Three pieces (see ``docs/recipes.md``):

- :func:`names_rank`: a decorator for actor endpoints that re-raises any exception as
  ``RuntimeError("<actor> rank <r>: <Type>: <message>")``. Monarch's ``ActorError`` carries the
  remote traceback but not the rank of the actor that raised, so the actor adds it itself.
- :func:`wait`: ``future.get(timeout=...)`` that turns ``ActorError`` (an endpoint raised),
  ``SupervisionError`` (an actor process died: Monarch names ``{'replica': r/N}``) and
  ``TimeoutError`` into :class:`ActorFailure`, naming the actor, the rank and the configured timeout.
- :func:`install_fault_hook`: replaces ``monarch.actor.unhandled_fault_hook``, whose default
  ``sys.exit(1)`` kills the controller even after it caught the error, with one that records the
  failure (the controller then reports it and shuts down in ``finally:``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["ActorFailure", "names_rank", "rank_endpoint", "wait", "stream", "to_failure", "install_fault_hook",
           "FaultLog", "FaultSpec"]

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

_RANK_IN_SUPERVISION = re.compile(r"\{'(\w+)': (\d+)/(\d+)\}")
_RANK_IN_ACTOR = re.compile(r"(\w+) rank (\d+): ")


class ActorFailure(RuntimeError):
    """An actor call failed: the actor raised, its process died, or the call timed out.

    Attributes:
        actor: the actor mesh name (``"trainer"``, ``"teacher"``, ``"reducer"``).
        rank: the failed rank, or ``None`` when Monarch did not say.
        kind: ``"raised"``, ``"died"`` or ``"timeout"``.
        detail: the remote error text (first lines).
        what: the call that failed (``train_step(3)``; ``""`` when not known).
    """

    def __init__(self, *, actor: str, rank: int | None, kind: str, detail: str, what: str = "") -> None:
        self.actor, self.rank, self.kind, self.detail, self.what = actor, rank, kind, detail, what
        where = f"actor '{actor}' rank {rank}" if rank is not None else f"actor '{actor}'"
        verb = {"raised": "raised an error", "died": "died (its process exited)", "timeout": "timed out"}[kind]
        super().__init__(f"{where} {verb}{f' during {what}' if what else ''}: {detail}")


def names_rank(actor: str) -> Callable[[F], F]:
    """Decorate an endpoint (sync or async) so any exception is re-raised naming ``actor`` and ``self.rank``.

    The decorated method's instance must have an integer ``rank`` attribute (set in ``__init__``).
    """

    def deco(fn: F) -> F:
        def wrap_exc(self: Any, exc: BaseException) -> RuntimeError:
            first = (str(exc).strip().splitlines() or [""])[0]
            return RuntimeError(f"{actor} rank {getattr(self, 'rank', '?')}: {type(exc).__name__}: {first}")

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def awrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
                try:
                    return await fn(self, *args, **kwargs)
                except Exception as exc:
                    raise wrap_exc(self, exc) from exc

            return awrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:
                raise wrap_exc(self, exc) from exc

        return wrapper  # type: ignore[return-value]

    return deco


def rank_endpoint(actor: str) -> Callable[[F], F]:
    """``@endpoint`` over :func:`names_rank`: a Monarch actor endpoint whose errors name ``actor`` and its rank."""

    def deco(fn: F) -> F:
        from monarch.actor import endpoint

        return endpoint(names_rank(actor)(fn))

    return deco


def _short(text: str, limit: int = 600) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + " ..."


def to_failure(exc: BaseException, *, actor: str, what: str = "", timeout_s: float | None = None) -> ActorFailure:
    """Classify an exception raised by ``future.get`` into an :class:`ActorFailure`."""
    from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
    from monarch.actor import ActorError

    if isinstance(exc, ActorFailure):
        return exc
    if isinstance(exc, TimeoutError):
        return ActorFailure(actor=actor, rank=None, kind="timeout", what=what,
                            detail=f"no answer within {timeout_s} s (raise mesh.call_timeout_s if the step is slow)")
    text = str(exc)
    if isinstance(exc, SupervisionError):
        m = _RANK_IN_SUPERVISION.search(text)
        reason = text.split("failed:")[-1] if "failed:" in text else text
        return ActorFailure(actor=actor, rank=int(m.group(2)) if m else None, kind="died", what=what,
                            detail=_short(reason))
    if isinstance(exc, ActorError):
        inner = getattr(exc, "exception", None)
        inner_text = str(inner) if inner is not None else text
        m = _RANK_IN_ACTOR.search(inner_text)
        detail = inner_text[m.end():] if m else (inner_text.strip().splitlines() or [""])[-1]
        return ActorFailure(actor=actor, rank=int(m.group(2)) if m else None, kind="raised", what=what,
                            detail=_short(detail))
    return ActorFailure(actor=actor, rank=None, kind="raised", what=what, detail=f"{type(exc).__name__}: {text}")


def wait(future: Any, *, actor: str, timeout_s: float, what: str = "") -> Any:
    """``future.get(timeout=timeout_s)``; any failure becomes an :class:`ActorFailure` naming actor and rank.

    Raises:
        ActorFailure: the endpoint raised, the actor's process died, or no answer came in ``timeout_s``.
    """
    try:
        return future.get(timeout=timeout_s)
    except Exception as exc:
        raise to_failure(exc, actor=actor, what=what, timeout_s=timeout_s) from exc


class FaultLog:
    """Records the mesh failures Monarch reports outside any call (``unhandled_fault_hook``)."""

    def __init__(self) -> None:
        self.failures: list[Any] = []

    def __call__(self, failure: Any) -> None:
        self.failures.append(failure)
        log.error("actor mesh failure: %s", _short(str(failure), 300))


def install_fault_hook() -> tuple[FaultLog, Callable[[], None]]:
    """Replace ``monarch.actor.unhandled_fault_hook`` (default: ``sys.exit(1)``) with a :class:`FaultLog`.

    Returns ``(fault_log, restore)``; call ``restore()`` to put the previous hook back.
    """
    import monarch.actor as ma

    previous, faults = ma.unhandled_fault_hook, FaultLog()
    ma.unhandled_fault_hook = faults
    return faults, lambda: setattr(ma, "unhandled_fault_hook", previous)


def stream(
    receiver: Any,
    future: Any,
    *,
    actor: str,
    timeout_s: float,
    what: str = "",
    on_item: Callable[[Any], bool],
    poll_s: float = 0.5,
) -> Any:
    """Read items from a ``PortReceiver`` while the call ``future`` runs; return the call's result.

    ``on_item(item)`` returns ``True`` for the last item of the stream. Between items the call itself is
    polled, so an actor that raises or dies mid-stream is reported at once (not after ``timeout_s``).
    One pending ``recv()`` is kept across polls (a timed-out ``get`` does not consume it), so no item is lost.

    Raises:
        ActorFailure: the call failed, or the stream did not finish within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    pending = receiver.recv()
    while True:
        try:
            item = pending.get(timeout=poll_s)
        except TimeoutError:
            if time.monotonic() > deadline:
                raise to_failure(TimeoutError(), actor=actor, what=what, timeout_s=timeout_s) from None
            try:
                future.get(timeout=0.01)  # finished: its last item is already queued; keep reading
            except TimeoutError:
                pass
            except Exception as exc:
                raise to_failure(exc, actor=actor, what=what, timeout_s=timeout_s) from exc
            continue
        except Exception as exc:
            raise to_failure(exc, actor=actor, what=what, timeout_s=timeout_s) from exc
        if on_item(item):
            break
        pending = receiver.recv()
    return wait(future, actor=actor, timeout_s=max(1.0, deadline - time.monotonic()), what=what)


class FaultSpec:
    """A deliberate failure for supervision tests: ``"ACTOR:RANK:STEP:MODE"`` (MODE ``raise`` or ``exit``).

    ``trainer:0:1:exit`` makes trainer rank 0 call ``os._exit(3)`` at step 1; ``teacher:0:0:raise`` makes
    the teacher raise when it replays. Parsed by the recipe config (``mesh.inject_fault``).
    """

    def __init__(self, text: str) -> None:
        parts = text.split(":")
        if len(parts) != 4 or parts[0] not in ("trainer", "teacher") or parts[3] not in ("raise", "exit") \
                or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(
                f"'mesh.inject_fault' must look like 'ACTOR:RANK:STEP:MODE' with ACTOR trainer|teacher and "
                f"MODE raise|exit (e.g. 'trainer:0:1:exit'), got {text!r}"
            )
        self.actor, self.rank, self.step, self.mode = parts[0], int(parts[1]), int(parts[2]), parts[3]

    def maybe_fire(self, actor: str, rank: int, step: int) -> None:
        """Raise or exit when ``(actor, rank, step)`` matches."""
        if (actor, rank, step) != (self.actor, self.rank, self.step):
            return
        if self.mode == "exit":
            os._exit(3)
        raise RuntimeError(f"injected fault ({self.actor}:{self.rank}:{self.step}:{self.mode})")

"""Reading trace files safely: encodings (:func:`open_utf8`: UTF-8 with or without a BOM, UTF-16, bad bytes as
U+FFFD), nesting past the recursion limit (:class:`NestingTooDeep`: one hostile file is skipped, not fatal), JSON
streamed with ``ijson`` and checked for depth before anything is built (:func:`iter_events`, :func:`take_value`,
:func:`prune`), and tolerant JSONL (:func:`iter_jsonl`).
"""

from __future__ import annotations

import codecs
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import ijson

_STARTS, _ENDS = ("start_map", "start_array"), ("end_map", "end_array")
_DECODER = json.JSONDecoder()
_BAD = object()


class NestingTooDeep(ValueError):
    """The file holds JSON nested deeper than Python's recursion limit: it is skipped whole."""

    def __init__(self, path: str | Path, where: str = "") -> None:
        super().__init__(f"{path}: JSON nested deeper than Python's recursion limit ({sys.getrecursionlimit()} levels)"
                         f"{where}; no trace format nests this deep, so the file is damaged or hostile and is skipped")


class MalformedJSON(ValueError):
    """The streamed document is not valid JSON (truncated, bad syntax)."""


class _Utf8:
    """The UTF-8 bytes of a text stream: ``read`` (for ``ijson``) and lines (for JSONL); a context manager."""

    def __init__(self, text: IO[str]) -> None:
        self.text = text

    def read(self, n: int = -1) -> bytes:
        return self.text.read(n).encode("utf-8", errors="replace")

    def __iter__(self) -> Iterator[bytes]:
        return (line.encode("utf-8", errors="replace") for line in self.text)

    def __enter__(self) -> _Utf8:
        return self

    def __exit__(self, *exc: object) -> None:
        self.text.close()


def open_utf8(path: str | Path, *, clean: bool = False) -> IO[bytes]:
    """Open ``path`` as a binary stream of UTF-8 (use it in a ``with`` block); see the module docstring."""
    raw = open(path, "rb")  # noqa: SIM115 - returned to the caller, who closes it
    head = raw.read(4)
    nul = [b == 0 for b in head]
    encoding = ("utf-16" if head[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)  # the codec reads the BOM
                else "utf-16-le" if nul == [False, True, False, True] else "utf-16-be" if nul == [True, False, True, False]
                else "utf-8")  # fmt: skip
    raw.seek(3 if head.startswith(codecs.BOM_UTF8) else 0)
    if encoding == "utf-8" and not clean:
        return raw
    return _Utf8(io.TextIOWrapper(raw, encoding=encoding, errors="replace", newline=""))  # type: ignore[return-value]


def has_content(path: str | Path) -> bool:
    """Whether ``path`` holds anything but whitespace and NUL bytes."""
    with open_utf8(path, clean=True) as f:
        return any(chunk.strip(b" \t\r\n\x00") for chunk in iter(lambda: f.read(1 << 16), b""))


def loads(text: str | bytes, path: str | Path, where: str = "") -> Any:
    """``json.loads`` that raises :class:`NestingTooDeep` (not ``RecursionError``) on deep nesting."""
    try:
        return json.loads(text)
    except RecursionError:
        raise NestingTooDeep(path, where) from None


def iter_events(f: IO[bytes], path: str | Path) -> Iterator[tuple[str, Any]]:
    """``ijson`` basic events ``(event, value)`` of every JSON value in ``f``, numbers as int/float;
    ``NestingTooDeep`` when a value nests deeper than the recursion limit (checked before it is built),
    ``MalformedJSON`` when the text is not JSON (truncated, bad syntax)."""
    limit, depth = sys.getrecursionlimit(), 0
    try:
        for event, value in ijson.basic_parse(f, multiple_values=True, use_float=True):
            if event in _STARTS:
                depth += 1
                if depth > limit:
                    raise NestingTooDeep(path)
            elif event in _ENDS:
                depth -= 1
            yield event, value
    except ijson.JSONError as e:
        raise MalformedJSON(f"{path}: not valid JSON ({str(e).splitlines()[0]})") from None


def take_value(event: str, value: Any, events: Iterator[tuple[str, Any]], *, build: bool = True) -> Any:
    """The JSON value that starts with ``(event, value)``, consumed from ``events`` and built iteratively (its
    depth is only bounded by :func:`iter_events`); ``build=False`` skips it and returns None."""
    builder, depth = ijson.ObjectBuilder(), 0
    while True:
        if build:
            builder.event(event, value)
        depth += (event in _STARTS) - (event in _ENDS)
        if not depth:
            return builder.value if build else None
        event, value = next(events)  # a document that ends inside a value raises MalformedJSON


def prune(event: str, value: Any, events: Iterator[tuple[str, Any]], depth: int = 0) -> Any:
    """The JSON value starting with ``(event, value)``, pruned as it streams (containers to depth 3, 20 items
    per list, strings up to 200 characters): a record of any size costs no more than its pruned form."""
    if event not in _STARTS:
        return "" if isinstance(value, str) and len(value) > 200 else value
    out: Any = {} if event == "start_map" else []
    if depth >= 3:
        take_value(event, value, events, build=False)
        return out
    key = None
    for event, value in events:
        if event in _ENDS:
            return out
        if event == "map_key":
            key = value
        elif isinstance(out, dict):
            out[key] = prune(event, value, events, depth + 1)
        elif len(out) < 20:
            out.append(prune(event, value, events, depth + 1))
        else:
            take_value(event, value, events, build=False)
    return out


def iter_jsonl(path: Path, stats: Any) -> Iterator[Any]:
    """The decoded lines of a JSONL file (any JSON type), streamed, never raising on bad content: blank lines
    are ignored, a line that does not decode (truncated, NUL garbage) and a 0-byte file count in
    ``stats.skipped_truncated_lines`` (and ``n_records_total``); ``NestingTooDeep`` when a line nests deeper
    than the recursion limit (the file is unusable)."""
    empty = True
    with open_utf8(path) as f:
        for n, raw in enumerate(f, 1):
            empty = False
            raw = raw.removesuffix(b"\n")
            if not raw:
                continue
            try:  # fast path: strict UTF-8 and raw_decode; anything unusual takes the slow path
                text = raw.decode()
                value, stop = _DECODER.raw_decode(text)
                if stop == len(text) or not text[stop:].strip():
                    yield value
                    continue
            except ValueError:  # includes UnicodeDecodeError
                pass
            except RecursionError:
                raise NestingTooDeep(path, f" at line {n}") from None
            line = raw.decode("utf-8", errors="replace")
            stripped = line.strip(" \t\r\n\x00")
            try:
                value = loads(stripped, path, f" at line {n}") if stripped else _BAD
            except NestingTooDeep:
                raise
            except ValueError:
                value = _BAD
            if value is not _BAD:
                yield value
            elif stripped or "\x00" in line:
                stats.n_records_total += 1
                stats.skipped_truncated_lines += 1
    if empty:
        stats.skipped_truncated_lines += 1

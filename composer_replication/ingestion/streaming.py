"""Reading trace files safely: text encodings, bounded nesting and streamed JSON documents.

- :func:`open_utf8` gives any trace file as UTF-8 bytes: a UTF-8 byte-order mark is skipped, UTF-16
  (with a BOM, or recognised by its NUL bytes) is transcoded as it streams, and with ``clean=True``
  invalid bytes become U+FFFD.
- JSON nested deeper than Python's recursion limit cannot be decoded by ``json`` (nor rendered back):
  such a file raises :class:`NestingTooDeep`, a ``ValueError`` naming the file, so one hostile or
  damaged file is skipped with a reason instead of aborting a batch.
- :func:`iter_events` streams a JSON document (or several, as in JSONL) with ``ijson`` without
  building it, checking the depth as it goes; :func:`build_value` builds one value from those events.
"""

from __future__ import annotations

import codecs
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import ijson

if TYPE_CHECKING:
    from composer_replication.ingestion.history import IngestionStats

__all__ = [
    "NestingTooDeep",
    "MalformedJSON",
    "sniff_encoding",
    "open_utf8",
    "read_text",
    "has_content",
    "loads",
    "max_depth",
    "iter_events",
    "build_value",
    "skip_value",
    "iter_jsonl",
    "read_jsonl",
]

_CHUNK = 1 << 16
_STARTS = ("start_map", "start_array")
_ENDS = ("end_map", "end_array")


class NestingTooDeep(ValueError):
    """The file holds JSON nested deeper than Python's recursion limit: it is skipped whole."""

    def __init__(self, path: str | Path, where: str = "") -> None:
        super().__init__(
            f"{path}: JSON nested deeper than Python's recursion limit ({max_depth()} levels){where}; "
            "no trace format nests this deep, so the file is damaged or hostile and is skipped"
        )


class MalformedJSON(ValueError):
    """The streamed document is not valid JSON (truncated, bad syntax)."""


def max_depth() -> int:
    """The deepest nesting accepted: Python's recursion limit, the depth ``json.loads`` can decode."""
    return sys.getrecursionlimit()


def sniff_encoding(head: bytes) -> tuple[str, int]:
    """``(encoding, bom_length)`` of a file from its first bytes: ``utf-8`` (with or without a BOM),
    ``utf-16`` (a BOM), ``utf-16-le`` / ``utf-16-be`` (no BOM, recognised by ASCII text with NULs)."""
    if head.startswith(codecs.BOM_UTF8):
        return "utf-8", 3
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "utf-16", 0  # the utf-16 codec reads the BOM itself
    if len(head) >= 4 and head[0] and not head[1] and head[2] and not head[3]:
        return "utf-16-le", 0
    if len(head) >= 4 and not head[0] and head[1] and not head[2] and head[3]:
        return "utf-16-be", 0
    return "utf-8", 0


class _Transcoder(io.RawIOBase):
    """A raw byte stream of UTF-8 re-encoded from a text stream (for :func:`open_utf8`)."""

    def __init__(self, text: IO[str]) -> None:
        self._text, self._buf = text, b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf:
            chunk = self._text.read(_CHUNK)
            if not chunk:
                return 0
            self._buf = chunk.encode("utf-8", errors="replace")
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def close(self) -> None:
        self._text.close()
        super().close()


def open_utf8(path: str | Path, *, clean: bool = False) -> IO[bytes]:
    """Open ``path`` as a binary stream of UTF-8 (use it in a ``with`` block).

    A UTF-8 BOM is skipped; UTF-16 files are transcoded as they are read. With ``clean=True`` every
    file is transcoded and invalid bytes become U+FFFD (for parsers that reject them, such as
    ``ijson``); otherwise plain UTF-8 files are returned as they are (the fast path).
    """
    raw = open(path, "rb")  # noqa: SIM115 - returned to the caller, who closes it
    encoding, bom = sniff_encoding(raw.read(4))
    raw.seek(bom)
    if encoding == "utf-8" and not clean:
        return raw
    text = io.TextIOWrapper(raw, encoding=encoding, errors="replace", newline="")
    return io.BufferedReader(_Transcoder(text), buffer_size=_CHUNK)


def read_text(path: str | Path) -> str:
    """The whole file as text (BOM skipped, UTF-16 decoded, invalid bytes replaced)."""
    with open_utf8(path, clean=True) as f:
        return f.read().decode("utf-8", errors="replace")


def has_content(path: str | Path) -> bool:
    """Whether ``path`` holds anything but whitespace and NUL bytes (read up to the first such byte)."""
    with open_utf8(path, clean=True) as f:
        while chunk := f.read(_CHUNK):
            if chunk.strip(b" \t\r\n\x00"):
                return True
    return False


def loads(text: str | bytes, path: str | Path, where: str = "") -> Any:
    """``json.loads`` that raises :class:`NestingTooDeep` (not ``RecursionError``) on deep nesting."""
    try:
        return json.loads(text)
    except RecursionError:
        raise NestingTooDeep(path, where) from None


def iter_events(f: IO[bytes], path: str | Path) -> Iterator[tuple[str, Any]]:
    """``ijson`` basic events ``(event, value)`` of every JSON value in ``f`` (JSONL included),
    numbers as ``int``/``float``.

    Raises:
        NestingTooDeep: a value nests deeper than :func:`max_depth` (checked before it is built).
        MalformedJSON: the text is not JSON (truncated, bad syntax).
    """
    limit, depth = max_depth(), 0
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


def build_value(event: str, value: Any, events: Iterator[tuple[str, Any]]) -> Any:
    """The JSON value that starts with ``(event, value)``, built from ``events`` (iteratively: the
    depth is only bounded by :func:`iter_events`)."""
    if event not in _STARTS:
        return value
    root: Any = {} if event == "start_map" else []
    stack: list[Any] = [root]
    keys: list[Any] = [None]
    for event, value in events:
        if event == "map_key":
            keys[-1] = value
            continue
        if event in _ENDS:
            stack.pop()
            keys.pop()
            if not stack:
                return root
            continue
        item: Any = {} if event == "start_map" else [] if event == "start_array" else value
        top = stack[-1]
        if type(top) is list:
            top.append(item)
        else:
            top[keys[-1]] = item
        if event in _STARTS:
            stack.append(item)
            keys.append(None)
    raise MalformedJSON("the document ended inside a value")


def skip_value(event: str, events: Iterator[tuple[str, Any]]) -> None:
    """Consume the rest of the value that starts with ``event`` without building it."""
    if event not in _STARTS:
        return
    depth = 1
    for event, _ in events:
        if event in _STARTS:
            depth += 1
        elif event in _ENDS:
            depth -= 1
            if not depth:
                return


# ---------------------------------------------------------------------------- JSONL
_DECODER = json.JSONDecoder()


def iter_jsonl(path: Path, stats: IngestionStats) -> Iterator[Any]:
    """Decode a JSONL file line by line, never raising on bad content.

    The file is streamed (one line in memory at a time). A UTF-8 BOM is skipped and UTF-16 is
    transcoded (:func:`~composer_replication.ingestion.streaming.open_utf8`); invalid UTF-8 bytes are
    replaced (U+FFFD). Blank lines are ignored; lines that do not decode (truncated, NUL garbage) are
    counted in ``stats.skipped_truncated_lines`` (and in ``n_records_total``); a 0-byte file counts as
    one truncated line. Yields the decoded values (any JSON type) in file order.

    Raises:
        NestingTooDeep: a line nests deeper than Python's recursion limit (the file is unusable).
    """
    # fast path: strict UTF-8 decode + the decoder's raw_decode (json.loads on bytes re-detects the
    # encoding and runs two whitespace regexes per line); anything unusual takes the slow path
    raw_decode = _DECODER.raw_decode
    empty = True
    with open_utf8(path) as f:
        for n, raw in enumerate(f, 1):
            empty = False
            if raw.endswith(b"\n"):
                raw = raw[:-1]
            if not raw:
                continue
            try:
                text = raw.decode()
                value, stop = raw_decode(text)
                if stop == len(text) or not text[stop:].strip():
                    yield value
                    continue
            except ValueError:  # includes UnicodeDecodeError
                pass
            except RecursionError:
                raise NestingTooDeep(path, f" at line {n}") from None
            value = _slow_line(raw, stats, path, n)
            if value is not _BAD:
                yield value
    if empty:
        stats.skipped_truncated_lines += 1


_BAD = object()


def _slow_line(raw: bytes, stats: IngestionStats, path: Path, n: int) -> Any:
    """Decode one unusual line (bad bytes, NUL padding, leading blanks) or count it as truncated."""
    line = raw.decode("utf-8", errors="replace")
    stripped = line.strip(" \t\r\n\x00")
    if not stripped:
        if "\x00" in line:
            stats.n_records_total += 1
            stats.skipped_truncated_lines += 1
        return _BAD
    try:
        return loads(stripped, path, f" at line {n}")
    except NestingTooDeep:
        raise
    except ValueError:
        stats.n_records_total += 1
        stats.skipped_truncated_lines += 1
        return _BAD


def read_jsonl(path: Path, stats: IngestionStats) -> list[Any]:
    """:func:`iter_jsonl` as a list."""
    return list(iter_jsonl(path, stats))

"""API keys for teacher endpoints: lookup (argument, environment, dotenv file) and redaction.

The key is wrapped in :class:`SecretKey` as soon as it is found, so that it never reaches a log
line, a ledger, a result, an exception or a ``repr``: the wrapper prints as ``SecretKey(<redacted>)``,
refuses to be pickled, and :func:`scrub` removes from any text (error bodies, replies, exception
messages) every run of :data:`MIN_LEAK_CHARS` (8) or more consecutive characters of the key, so a key
that an endpoint echoes back cut, or that a text is cut across, leaves no usable fragment. Texts are
scrubbed *before* they are cut to length (:func:`scrub_clip`). A key holding a line break, another
control character or a non-ASCII character is refused once, when it is read (:class:`InvalidAPIKeyError`),
instead of failing every request with an error that might carry it.

Lookup order (first hit wins): the ``api_key`` argument, the ``OPENROUTER_API_KEY`` environment
variable, then an explicit dotenv file (``KEY=VALUE`` lines, parsed here; no default file is read).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "API_KEY_ENV",
    "MIN_LEAK_CHARS",
    "SecretKey",
    "MissingAPIKeyError",
    "InvalidAPIKeyError",
    "parse_dotenv",
    "resolve_api_key",
    "scrub",
    "scrub_clip",
]

API_KEY_ENV = "OPENROUTER_API_KEY"
MIN_LEAK_CHARS = 8
"""A run of this many consecutive characters of the key, anywhere in a text, is redacted."""
_REDACTED = "[REDACTED]"


class MissingAPIKeyError(RuntimeError):
    """No API key was found for a teacher that needs one; the message says where we looked."""


class InvalidAPIKeyError(ValueError):
    """The API key holds characters that cannot go into an HTTP header (the message never shows it)."""


def _check_key_text(value: str, source: str) -> None:
    for i, ch in enumerate(value):
        if ch in "\r\n":
            what = "a line break (CR or LF)"
        elif not ch.isascii():
            what = "a non-ASCII character"
        elif not ch.isprintable():
            what = "a control character"
        else:
            continue
        raise InvalidAPIKeyError(
            f"the API key from {source} contains {what} at position {i + 1} of {len(value)}; an API key is "
            "one line of printable ASCII. Fix: copy the key again (without quotes, spaces or line breaks) "
            f"into {source}."
        )


class SecretKey:
    """An API key whose ``repr``/``str`` never show the value. Use :meth:`reveal` to send it."""

    __slots__ = ("_value",)

    def __init__(self, value: str, *, source: str = "the api_key argument") -> None:
        if not isinstance(value, str) or not value.strip():
            raise ValueError("SecretKey needs a non-empty string; got an empty or non-string value.")
        _check_key_text(value.strip(), source)
        self._value = value.strip()

    def reveal(self) -> str:
        """The raw key, for the ``Authorization`` header only."""
        return self._value

    def __repr__(self) -> str:
        return "SecretKey(<redacted>)"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SecretKey) and other._value == self._value

    def __hash__(self) -> int:
        return hash(("SecretKey", self._value))

    def __reduce__(self):  # noqa: D105 - pickling would write the key to disk
        raise TypeError("SecretKey cannot be pickled (it would write the API key out); pass it explicitly.")


def scrub(text: str, key: SecretKey | str | None) -> str:
    """``text`` with every run of >= :data:`MIN_LEAK_CHARS` consecutive key characters as ``[REDACTED]``.

    A run is any substring of the key at least 8 characters long (the whole key, a cut key, a middle
    piece); each maximal stretch of ``text`` covered by such runs becomes one ``[REDACTED]``. Keys
    shorter than 8 characters are replaced where they occur whole.
    """
    if key is None or not text:
        return text
    raw = key.reveal() if isinstance(key, SecretKey) else key
    if not raw:
        return text
    n = MIN_LEAK_CHARS
    if len(raw) < n:
        return text.replace(raw, _REDACTED)
    starts: list[int] = []  # where some n-gram of the key occurs (str.find: C speed on long texts)
    for gram in {raw[i : i + n] for i in range(len(raw) - n + 1)}:
        at = text.find(gram)
        while at >= 0:
            starts.append(at)
            at = text.find(gram, at + 1)
    if not starts:
        return text
    spans: list[list[int]] = []  # [start, end) stretches covered by key n-grams
    for i in sorted(starts):
        if spans and i <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], i + n)
        else:
            spans.append([i, i + n])
    out, last = [], 0
    for start, end in spans:
        out.append(text[last:start])
        out.append(_REDACTED)
        last = end
    out.append(text[last:])
    return "".join(out)


def scrub_clip(text: str, key: SecretKey | str | None, limit: int) -> str:
    """Scrub ``text`` of the key first, then cut it to ``limit`` characters (never the other way round).

    Only a prefix long enough to fill ``limit`` characters is scrubbed (long bodies stay cheap).
    """
    raw = key.reveal() if isinstance(key, SecretKey) else (key or "")
    return scrub(text[: 2 * limit + 2 * len(raw)], key)[:limit]


def parse_dotenv(path: str | os.PathLike[str]) -> dict[str, str]:
    """Parse a dotenv file: ``KEY=VALUE`` lines, optional ``export``, quotes, ``#`` comments.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
    """
    out: dict[str, str] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        name, _, value = line.partition("=")
        name = name.strip()
        if name.startswith("export "):
            name = name[len("export ") :].strip()
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        elif " #" in value:
            value = value.split(" #", 1)[0].rstrip()
        out[name] = value
    return out


def resolve_api_key(
    api_key: str | SecretKey | None = None,
    *,
    dotenv_path: str | os.PathLike[str] | None = None,
    required: bool = True,
    env_var: str = API_KEY_ENV,
) -> SecretKey | None:
    """Find the API key: ``api_key``, else ``$OPENROUTER_API_KEY``, else ``dotenv_path``.

    Args:
        api_key: an explicit key (string or :class:`SecretKey`).
        dotenv_path: a dotenv file to read ``OPENROUTER_API_KEY`` from (read only when given).
        required: raise when nothing is found (else return ``None``).
        env_var: the variable name looked up in the environment and the dotenv file.

    Raises:
        MissingAPIKeyError: ``required`` and no key was found; the message lists every place checked.
        InvalidAPIKeyError: the key found holds a line break, a control or a non-ASCII character.
    """
    if isinstance(api_key, SecretKey):
        return api_key
    if isinstance(api_key, str) and api_key.strip():
        return SecretKey(api_key)
    env = os.environ.get(env_var, "")
    if env.strip():
        return SecretKey(env, source=f"the environment variable {env_var}")
    looked = ["the api_key argument (not given)", f"the environment variable {env_var} (unset or empty)"]
    if dotenv_path is not None:
        path = Path(dotenv_path).expanduser()
        if path.is_file():
            value = parse_dotenv(path).get(env_var, "")
            if value.strip():
                return SecretKey(value, source=f"the dotenv file {path} ({env_var}=...)")
            looked.append(f"the dotenv file {path} (no {env_var}=... line)")
        else:
            looked.append(f"the dotenv file {path} (does not exist)")
    else:
        looked.append("a dotenv file (none given; pass dotenv_path=... or --dotenv PATH)")
    if not required:
        return None
    raise MissingAPIKeyError(
        "No API key found for the remote teachers. Looked in: " + "; ".join(looked) + ". "
        f"Fix: export {env_var}=sk-or-..., pass api_key=..., or point dotenv_path at a file with "
        f"{env_var}=... (teachers 'local:...' and loopback base_urls need no key)."
    )

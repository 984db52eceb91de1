"""API keys: lookup (argument, ``$OPENROUTER_API_KEY``, a dotenv file) and redaction.

A key lives in a :class:`SecretKey` (it prints as ``SecretKey(<redacted>)``, refuses to be pickled) and every
text that leaves the client is :func:`scrub`-bed of any 8 consecutive characters of it, before it is cut.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["MissingAPIKeyError", "InvalidAPIKeyError"]

API_KEY_ENV, MIN_LEAK_CHARS, _REDACTED = "OPENROUTER_API_KEY", 8, "[REDACTED]"


class MissingAPIKeyError(RuntimeError):
    """No API key was found for a teacher that needs one; the message says where we looked."""


class InvalidAPIKeyError(ValueError):
    """The API key holds characters that cannot go into an HTTP header (the message never shows it)."""


class SecretKey:
    """An API key that never shows in a ``repr``/``str`` or a pickle; :meth:`reveal` gives it to the header.
    ``InvalidAPIKeyError`` (naming ``source``) for a line break, a control or a non-ASCII character."""

    __slots__ = ("_value",)

    def __init__(self, value: str, *, source: str = "the api_key argument") -> None:
        if not isinstance(value, str) or not value.strip():
            raise ValueError("SecretKey needs a non-empty string; got an empty or non-string value.")
        value = value.strip()
        for i, ch in enumerate(value):
            if what := ("a line break (CR or LF)" if ch in "\r\n" else "a non-ASCII character" if not ch.isascii()
                        else "a control character" if not ch.isprintable() else None):
                raise InvalidAPIKeyError(
                    f"the API key from {source} contains {what} at position {i + 1} of {len(value)}; an API key is "
                    f"one line of printable ASCII. Fix: copy the key again (without quotes, spaces or line breaks) "
                    f"into {source}.")
        self._value = value

    def reveal(self) -> str:
        """The raw key, for the ``Authorization`` header only."""
        return self._value

    def __repr__(self) -> str:
        return "SecretKey(<redacted>)"

    def __reduce__(self):  # noqa: D105 - pickling would write the key to disk
        raise TypeError("SecretKey cannot be pickled (it would write the API key out); pass it explicitly.")


def scrub(text: str, key: SecretKey | str | None) -> str:
    """``text`` with each stretch covered by 8-character pieces of the key as one ``[REDACTED]`` (a key
    shorter than 8 characters is replaced where it occurs whole)."""
    raw = key.reveal() if isinstance(key, SecretKey) else key
    if not raw or not text or len(raw) < MIN_LEAK_CHARS:
        return text.replace(raw, _REDACTED) if raw and text else text
    n, covered = MIN_LEAK_CHARS, bytearray(len(text))
    for gram in {raw[i : i + n] for i in range(len(raw) - n + 1)}:
        at = text.find(gram)  # str.find: C speed on long texts
        while at >= 0:
            covered[at : at + n] = b"\1" * n
            at = text.find(gram, at + 1)
    out, last = [], 0
    for m in re.finditer(rb"\x01+", covered):
        out += [text[last : m.start()], _REDACTED]
        last = m.end()
    return "".join(out) + text[last:]


def scrub_clip(text: str, key: SecretKey | str | None, limit: int) -> str:
    """Scrub ``text`` of the key first, then cut it to ``limit`` characters (only a long enough prefix is read)."""
    raw = key.reveal() if isinstance(key, SecretKey) else (key or "")
    return scrub(text[: 2 * limit + 2 * len(raw)], key)[:limit]


def parse_dotenv(path: str | os.PathLike[str]) -> dict[str, str]:
    """``KEY=VALUE`` lines of a dotenv file (optional ``export``, quotes, ``#`` comments)."""
    out: dict[str, str] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        name, sep, value = line.strip().partition("=")
        if not sep or name.startswith("#"):
            continue
        value = value.strip()
        quoted = len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'"
        out[name.strip().removeprefix("export ").strip()] = value[1:-1] if quoted else value.split(" #", 1)[0].rstrip()
    return out


def resolve_api_key(api_key: str | SecretKey | None = None, *, dotenv_path: str | os.PathLike[str] | None = None,
                    required: bool = True, env_var: str = API_KEY_ENV) -> SecretKey | None:
    """The key from ``api_key``, else ``$OPENROUTER_API_KEY``, else ``dotenv_path`` (read only when given);
    ``MissingAPIKeyError`` (when ``required``) lists every place checked; ``InvalidAPIKeyError`` for a bad key."""
    if isinstance(api_key, SecretKey):
        return api_key
    if isinstance(api_key, str) and api_key.strip():
        return SecretKey(api_key)
    if os.environ.get(env_var, "").strip():
        return SecretKey(os.environ[env_var], source=f"the environment variable {env_var}")
    looked = ["the api_key argument (not given)", f"the environment variable {env_var} (unset or empty)"]
    if dotenv_path is None:
        looked.append("a dotenv file (none given; pass dotenv_path=... or --dotenv PATH)")
    elif not (path := Path(dotenv_path).expanduser()).is_file():
        looked.append(f"the dotenv file {path} (does not exist)")
    elif (value := parse_dotenv(path).get(env_var, "")).strip():
        return SecretKey(value, source=f"the dotenv file {path} ({env_var}=...)")
    else:
        looked.append(f"the dotenv file {path} (no {env_var}=... line)")
    if not required:
        return None
    raise MissingAPIKeyError(
        "No API key found for the remote teachers. Looked in: " + "; ".join(looked) + ". "
        f"Fix: export {env_var}=sk-or-..., pass api_key=..., or point dotenv_path at a file with {env_var}=... "
        "(teachers 'local:...', 'recorded' and loopback base_urls need no key).")

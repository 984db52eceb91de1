"""API keys for teacher endpoints: lookup (argument, environment, dotenv file) and redaction.

The key is wrapped in :class:`SecretKey` as soon as it is found, so that it never reaches a log
line, a ledger, a result, an exception or a ``repr``: the wrapper prints as ``SecretKey(<redacted>)``,
refuses to be pickled, and :func:`scrub` removes the raw value from any text (error bodies, exception
messages) before that text leaves the client.

Lookup order (first hit wins): the ``api_key`` argument, the ``OPENROUTER_API_KEY`` environment
variable, then an explicit dotenv file (``KEY=VALUE`` lines, parsed here; no default file is read).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["API_KEY_ENV", "SecretKey", "MissingAPIKeyError", "parse_dotenv", "resolve_api_key", "scrub"]

API_KEY_ENV = "OPENROUTER_API_KEY"
_REDACTED = "[REDACTED]"


class MissingAPIKeyError(RuntimeError):
    """No API key was found for a teacher that needs one; the message says where we looked."""


class SecretKey:
    """An API key whose ``repr``/``str`` never show the value. Use :meth:`reveal` to send it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        if not isinstance(value, str) or not value.strip():
            raise ValueError("SecretKey needs a non-empty string; got an empty or non-string value.")
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
    """Return ``text`` with every occurrence of the key replaced by ``[REDACTED]``."""
    if key is None:
        return text
    raw = key.reveal() if isinstance(key, SecretKey) else key
    if not raw:
        return text
    return text.replace(raw, _REDACTED)


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
    """
    if isinstance(api_key, SecretKey):
        return api_key
    if isinstance(api_key, str) and api_key.strip():
        return SecretKey(api_key)
    env = os.environ.get(env_var, "")
    if env.strip():
        return SecretKey(env)
    looked = ["the api_key argument (not given)", f"the environment variable {env_var} (unset or empty)"]
    if dotenv_path is not None:
        path = Path(dotenv_path).expanduser()
        if path.is_file():
            value = parse_dotenv(path).get(env_var, "")
            if value.strip():
                return SecretKey(value)
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

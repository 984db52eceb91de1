"""Secret redaction at ingestion: secrets in a user's agent history never leave the machine by accident.

Every ingester (``redact=True`` by default; ``redact=False`` / ``--no-redact`` opt out) replaces each secret in
every message, tool-call argument, tool result, recorded action and error site with ``[REDACTED:<kind>:<6 hex>]``:
an HMAC of the secret under a per-user key (:func:`redaction_key`), so the same secret gets the same placeholder
in every run on this machine (nothing is paid twice) and a placeholder neither reveals its secret nor confirms a
guess without the key. What is and is not caught: docs/ingestion.md, "Secrets".
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import math
import os
import re
from collections import Counter
from pathlib import Path

logger = logging.getLogger(__name__)

_SEP = r"\\?[\"']?\s*(?::|=>|=)\s*\\?[\"']?"  # NAME=v, NAME: v, "name": "v", name => v, \"name\": \"v\"
_VALUE = r"(?P<v>[^\s\"'`\\,;()\[\]{}<>]{8,})"  # never a placeholder "[..." (redaction is idempotent)
_KEYWORDS = [("e|y", "", "kK"), ("EY", "", "K"), ("o|ken", "", "tT"), ("OKEN", "", "T"), ("e|cret", "", "sS"),
             ("ECRET", "", "S"), ("ass|w", "(?:or)?d", "pP"), ("ASSW", "(?:OR)?D", "P"), ("re|dential", "s?", "cC"),
             ("REDENTIAL", "S?", "C")]  # the names a secret is assigned to: (literal, more of the name, before)
# (kind, opening literal, rest, the characters allowed just before the literal (None: any but a word character),
# must look random). Each pattern opens with a literal, which ``re`` scans for at C speed (an alternation or a
# (?i) would be ~30x slower): the case variants of a name are rules of their own. The scan starts after a "|" in
# the literal (at a rarer character: ~2x faster than at an "e"), a lookbehind checking what comes before it.
_RULES = [
    ("private_key", "-----BEGIN ", r"[A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----[^\x00]*?-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----",
     "", False),
    ("openai_key", "s|k-", r"[\w-]{20,}", None, True),  # sk-ant- and sk-or- are named by their prefix
    ("github_token", "gh", r"(?:[pousr]_[A-Za-z0-9]{30,}|ithub_pat_\w{22,})", None, False),
    ("aws_access_key", "A", r"(?:KIA|SIA|BIA|CCA)[A-Z0-9]{16}(?![A-Za-z0-9])", None, False),
    ("slack_token", "xox", r"[abposre]-[\w-]{10,}", None, False),
    ("google_api_key", "AIza", r"[\w-]{35}", None, False),
    ("huggingface_token", "hf_", r"[A-Za-z0-9]{30,}", None, True),
    ("stripe_key", "k_", r"(?:live|test)_[A-Za-z0-9]{16,}", "sr", False),
    ("jwt", "ey|J", r"[\w-]{8,}\.eyJ[\w-]{8,}\.[\w-]{8,}", None, False),
    ("bearer_token", "ea|rer", r"\s+(?P<v>[\w.~+/-]{16,}=*)", "Bb", True),
    ("bearer_token", "EARER", r"\s+(?P<v>[\w.~+/-]{16,}=*)", "B", True),
    ("url_credentials", "://", r"[^\s:/@\"'\\]+:(?P<v>[^\s@/\"'\\]+)@", "", False),
    *(("secret_assignment", stem, more + _SEP + _VALUE, before, True) for stem, more, before in _KEYWORDS),
]
_FREQ = "etaoinshrdlcumwfgypbvkjxqz"  # English letters, the most frequent first


def _compile(literal: str, rest: str) -> tuple[re.Pattern[bytes], int, bytes]:
    """A rule's pattern on UTF-8 bytes (2x faster than on a str holding a non-ASCII character), the characters of its
    literal before the scan starts, and its rarest byte (a text without it is skipped at ``memchr`` speed)."""
    head, _, tail = literal.rpartition("|")
    lookbehind = f"(?<={re.escape(head + tail)})" if head else ""
    rarest = max(head + tail, key=lambda c: (c.isupper(), _FREQ.find(c.lower())))
    return re.compile((re.escape(tail) + lookbehind + rest).encode()), len(head), rarest.encode()


_COMPILED = [(kind, *_compile(literal, rest), before if before is None else before.encode(), random)
             for kind, literal, rest, before, random in _RULES]
_AWS_SECRET = re.compile(r"[A-Za-z0-9/+]{40}")


def _name(kind: str, secret: str, before: str) -> str:
    """The kind a placeholder names: an ``sk-`` key by its prefix, a 40-character value assigned to a name
    holding "secret" as an AWS secret key."""
    if kind == "openai_key":
        return "anthropic_key" if secret.startswith("sk-ant-") else "openrouter_key" if secret.startswith("sk-or-") else kind
    if kind == "secret_assignment" and "secret" in before.lower() and _AWS_SECRET.fullmatch(secret):
        return "aws_secret_key"
    return kind


def _looks_random(v: str, *, mixed: bool = False) -> bool:
    """High entropy enough to be a secret: >= 8 characters of >= 2.5 bits (Shannon) each, letters mixed
    with digits (or, unless ``mixed``, >= 20 characters), and not a template (``$VAR``, ``%s``, ``x...``)."""
    if len(v) < 8 or v[0] in "$%*" or "..." in v:
        return False
    entropy = -sum(c / len(v) * math.log2(c / len(v)) for c in Counter(v).values())
    has_both = any(c.isdigit() for c in v) and any(c.isalpha() for c in v)
    return entropy >= 2.5 and (has_both or (not mixed and len(v) >= 20))


@functools.cache
def redaction_key() -> bytes:
    """The placeholders' HMAC key: ``$COMPOSER_REDACT_KEY``; else a random key kept in
    ``$XDG_CACHE_HOME/composer_replication/redact.key`` (``~/.cache``; created once, mode 0600); else, when
    that cannot be written, a per-process key (placeholders then differ between runs; logged once)."""
    if env := os.environ.get("COMPOSER_REDACT_KEY"):
        return env.encode()
    path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "composer_replication" / "redact.key"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(os.urandom(32))
        return path.read_bytes()
    except FileExistsError:  # another process created it first
        return path.read_bytes()
    except OSError as e:
        logger.warning("cannot keep a redaction key at %s (%s): placeholders will differ between runs", path, e)
        return os.urandom(32)


class Redactor:
    """Replaces secrets in texts (:meth:`text`) with placeholders; ``counts`` receives the distinct secrets
    replaced, per kind. The ingesters call it once per text, as they read it."""

    def __init__(self, counts: dict[str, int] | None = None, key: bytes | None = None) -> None:
        self.counts = {} if counts is None else counts
        self.key = redaction_key() if key is None else key
        self._seen: set[str] = set()

    def _placeholder(self, kind: str, secret: str) -> str:
        canonical = secret.replace("\\n", "\n").encode("utf-8", "surrogatepass")  # a PEM inside a JSON string
        placeholder = f"[REDACTED:{kind}:{hmac.new(self.key, canonical, hashlib.sha256).hexdigest()[:6]}]"
        if placeholder not in self._seen:
            self._seen.add(placeholder)
            self.counts[kind] = self.counts.get(kind, 0) + 1
        return placeholder

    def text(self, text: str) -> str:
        """``text`` with every secret replaced (matched on its UTF-8 bytes: every match starts and ends at ASCII)."""
        data = text.encode("utf-8", "surrogatepass")
        changed = False
        for kind, rx, skip, rarest, before, random in _COMPILED if text else ():
            m = rx.search(data) if rarest in data else None
            while m is not None:
                p = m.start() - skip  # where the literal starts
                prev = data[p - 1 : p] if p else b""
                s, e = m.span("v") if "v" in rx.groupindex else (p, m.end())
                s -= kind == "stripe_key"  # its "s" / "r" comes just before the match
                secret = data[s:e].decode("utf-8", "surrogatepass")
                if before is None:  # the secret starts a word (a non-ASCII byte counts as a letter)
                    allowed = not prev or not (prev.isalnum() or prev in b"_-" or prev[0] > 127)
                else:
                    allowed = not before or bool(prev) and prev in before
                if allowed and (not random or _looks_random(secret, mixed=kind in ("openai_key", "huggingface_token"))):
                    name = _name(kind, secret, data[max(0, s - 40) : s].decode("utf-8", "ignore"))
                    placeholder = self._placeholder(name, secret).encode()
                    data, changed = data[:s] + placeholder + data[e:], True
                    m = rx.search(data, s + len(placeholder))
                else:
                    m = rx.search(data, m.start() + 1)
        return data.decode("utf-8", "surrogatepass") if changed else text

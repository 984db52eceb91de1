"""Issue #24 at ingestion: secrets never leave the machine by accident, and formats we do not read are named.

Secrets of every kind are planted (tests/synthetic/planted_secrets.py) in a session of every format; none may
survive ingestion unless redaction is turned off. Gemini CLI, OpenHands and aider files get "unsupported
format" with the supported list (never a format guess that yields nothing), and an input that yields no state
makes the CLI exit non-zero unless ``--allow-empty``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest

from composer_replication.ingestion import ingest_any
from composer_replication.ingestion.__main__ import main
from composer_replication.ingestion.redact import Redactor, redaction_key
from composer_replication.ingestion.registry import FORMATS, detect_format, make_ingester

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "synthetic"))
import planted_secrets  # noqa: E402  (tests/synthetic/planted_secrets.py)

FIX = Path(__file__).parent / "fixtures"


@pytest.fixture()
def planted(tmp_path: Path) -> dict[str, Path]:
    return planted_secrets.write_sessions(tmp_path / "planted")


# ---------------------------------------------------------------------------- secrets
@pytest.mark.parametrize("fmt", FORMATS)
def test_no_planted_secret_survives_ingestion_in_any_format(planted: dict[str, Path], fmt: str) -> None:
    assert detect_format(planted[fmt]) == fmt
    ing = make_ingester(fmt)
    states = list(ing.ingest(planted[fmt]))
    dump = json.dumps(states)
    assert states and planted_secrets.leaks(dump) == []
    assert set(ing.last_stats.redactions) == set(planted_secrets.SECRETS)  # every kind found, counted per kind
    assert all(n == 1 for n in ing.last_stats.redactions.values())  # one distinct secret each, however often seen
    for s in states:  # the recorded action, every message, tool call and result, the error site
        assert "[REDACTED:" in s["student_action"] or "Done" in s["student_action"]
    raw = json.dumps(list(make_ingester(fmt, redact=False).ingest(planted[fmt])))  # the opt-out keeps them
    assert set(planted_secrets.leaks(raw)) == set(planted_secrets.SECRETS)


def test_the_cli_redacts_by_default_and_keeps_secrets_with_no_redact(planted: dict[str, Path], tmp_path: Path,
                                                                      capsys) -> None:  # fmt: skip
    out = tmp_path / "states.jsonl"
    assert main([str(planted["claude_code"].parent), "--out", str(out)]) == 0
    assert planted_secrets.leaks(out.read_text()) == [] and "[REDACTED:openai_key:" in out.read_text()
    assert "redacted " in capsys.readouterr().out
    assert main([str(planted["claude_code"].parent), "--out", str(out), "--no-redact"]) == 0
    assert set(planted_secrets.leaks(out.read_text())) == set(planted_secrets.SECRETS)


def test_placeholders_are_stable_keyed_and_never_the_secret() -> None:
    key, secret = b"k" * 32, planted_secrets.SECRETS["openai_key"]
    a, b = Redactor(key=key), Redactor(key=key)
    one = a.text(f"OPENAI_API_KEY={secret}")
    assert one == b.text(f"OPENAI_API_KEY={secret}") == a.text(f"OPENAI_API_KEY={secret}")  # same secret, same name
    placeholder = one.split("=", 1)[1]
    assert placeholder.startswith("[REDACTED:openai_key:") and len(placeholder) == len("[REDACTED:openai_key:123456]")
    assert not any(secret[i : i + 6] in placeholder for i in range(len(secret) - 6))
    assert a.text(secret).startswith("[REDACTED:openai_key:")  # a secret that opens the text too
    assert Redactor(key=b"other").text(secret) != a.text(secret)  # keyed: a guess cannot be confirmed
    assert a.text(secret.replace("Ab3", "Zz9")) != a.text(secret)  # another secret, another placeholder
    assert a.counts == {"openai_key": 2} and a.text(one) == one  # idempotent on its own output


def test_the_key_comes_from_the_environment_or_a_private_file(tmp_path: Path, monkeypatch) -> None:
    redaction_key.cache_clear()
    try:
        monkeypatch.setenv("COMPOSER_REDACT_KEY", "from-env")
        assert redaction_key() == b"from-env"
        redaction_key.cache_clear()
        monkeypatch.delenv("COMPOSER_REDACT_KEY")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        key = redaction_key()
        path = tmp_path / "composer_replication" / "redact.key"
        assert len(key) == 32 and path.read_bytes() == key and os.stat(path).st_mode & 0o777 == 0o600
        redaction_key.cache_clear()
        assert redaction_key() == key  # the next run finds the same key: the same placeholders
    finally:
        redaction_key.cache_clear()


@pytest.mark.parametrize("text", [
    "max_tokens=4096", "n_tokens: 123456789", "token = tokens[0]", "password = getpass.getpass()",
    "from sklearn import svm  # sk-learn-compatible-estimator", 'cache_key = f"{user}:{item}"',
    "key: some_config_value", "Use a bearer token in the header.", "PWD=/home/dev/projects/app/src/module",
    "https://example.com/a:b@c", "secret_key_base: ${SECRET_KEY_BASE}", "api_key=<your-api-key-here>",
    '"input_tokens": 1200, "cache_read_input_tokens": 45000', "AKIAIOSFODNN7EXAMPLEXYZ1234",
])  # fmt: skip
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert Redactor(key=b"k").text(text) == text


# ---------------------------------------------------------------------------- formats we do not read
_GEMINI_LEGACY = {"sessionId": "6f1c", "projectHash": "ab12", "startTime": "2025-07-01T10:00:00Z",
                  "messages": [{"id": "1", "type": "user", "content": "fix the bug"},
                               {"id": "2", "type": "gemini", "content": "Reading main.py", "toolCalls": []}]}  # fmt: skip
_UNSUPPORTED = {
    "gemini.json": (json.dumps(_GEMINI_LEGACY), "Gemini CLI"),
    "gemini.jsonl": ('{"sessionId": "6f1c", "projectHash": "ab12", "startTime": "2025-07-01T10:00:00Z", "kind": "main"}\n'
                     '{"id": "1", "type": "user", "content": "fix it"}\n{"id": "2", "type": "gemini", "content": "ok"}\n',
                     "Gemini CLI"),
    "openhands.json": (json.dumps([{"id": 0, "source": "user", "action": "message", "args": {"content": "fix"}},
                                   {"id": 1, "source": "agent", "observation": "run", "content": "ok", "cause": 0}]),
                       "OpenHands"),
    "openhands_state.json": (json.dumps({"history": [{"id": 0, "source": "agent", "action": "run", "args": {}}]}),
                             "OpenHands"),
    ".aider.chat.history.md": ("# aider chat started at 2025-07-01 10:00:00\n\n#### fix the bug\n\nSure.\n", "aider"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_UNSUPPORTED))
def test_formats_we_do_not_read_are_named_with_the_supported_list(tmp_path: Path, name: str, capsys) -> None:
    text, label = _UNSUPPORTED[name]
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ValueError, match=rf"unsupported format \({label}.*supported formats: {', '.join(FORMATS)}"):
        detect_format(f)  # a legacy Gemini JSON file is never taken for the OpenAI format
    assert main([str(f), "--out", str(tmp_path.parent / f"{tmp_path.name}.jsonl")]) == 1
    printed = capsys.readouterr()
    assert "unsupported format" in printed.out.replace("\n", "") and "--format" not in printed.out + printed.err


def test_a_forced_format_that_yields_no_state_warns_and_fails_unless_allowed(tmp_path: Path, capsys, caplog) -> None:
    f = tmp_path / "gemini.json"
    f.write_text(json.dumps(_GEMINI_LEGACY))
    out = tmp_path.parent / f"{tmp_path.name}-out.jsonl"
    with caplog.at_level(logging.WARNING, logger="composer_replication.ingestion"):
        assert list(ingest_any(f, format="openai")) == []
    assert "no states" in caplog.text
    assert main([str(f), "--format", "openai", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "no states" in err and "--allow-empty" in err and not out.exists()
    assert main([str(f), "--format", "openai", "--out", str(out), "--allow-empty"]) == 0
    assert out.read_text() == ""


def test_an_empty_file_in_a_folder_is_named_but_the_folder_counts_as_a_whole(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "s.jsonl").write_text((FIX / "errors.jsonl").read_text())
    (folder / "titles.jsonl").write_text('{"type": "summary", "summary": "a title", "leafUuid": "x"}\n')
    out = tmp_path / "states.jsonl"
    assert main([str(folder), "--out", str(out)]) == 0
    assert "titles.jsonl: no states" in capsys.readouterr().out.replace("\n", "")
    assert len(out.read_text().splitlines()) == 8

"""Attacks: what a careless user or a hostile endpoint does to the budget, the key and the files.

Each test reproduces one case of issue 9 (section 1) through the command line or the API.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from replay_helpers import make_states, teacher

from benchmarks.fake_openai_server import FakeOpenAIServer
from composer_replication.teacher_replay import Ledger, TeacherReplayer, replay_trace
from composer_replication.teacher_replay.__main__ import main
from composer_replication.teacher_replay.ledger import LedgerLockedError, ledger_spend

KEY71 = "sk-or-v1-" + "0123456789abcdef" * 3 + "fedcba9876543a"  # 71 characters, like a real key
assert len(KEY71) == 71


def _leaks(text: str, key: str = KEY71) -> list[str]:
    """Every run of 8 consecutive key characters found in ``text``."""
    return [key[i : i + 8] for i in range(len(key) - 7) if key[i : i + 8] in text]


def _states_file(tmp_path, n: int = 20):
    path = tmp_path / "states.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in make_states(n)))
    return path


def _cli(tmp_path, url: str, *extra: str, ledger=None, out=None) -> list[str]:
    return [
        str(_states_file(tmp_path)),
        "--teachers", "x/model",
        "--base-url", url,
        "--ledger", str(ledger or tmp_path / "ledger.jsonl"),
        "--out", str(out or tmp_path / "pairs.jsonl"),
        "--no-progress",
        *extra,
    ]  # fmt: skip


# ---------------------------------------------------------------------------- the cap, whatever the prices


@pytest.mark.parametrize("prices", [("0", "0"), ("0.01", "0.01")], ids=["zero", "far-too-low"])
def test_prices_given_by_the_user_cannot_lift_the_cap(tmp_path, monkeypatch, prices):
    """The endpoint bills ~$0.30 a call (usage.cost); 8 calls in flight once spent $2.40 of a $0.50 cap."""
    monkeypatch.setenv("OPENROUTER_API_KEY", KEY71)
    with FakeOpenAIServer(latency_s=0.2, prices={"x/model": (2000.0, 2000.0)}) as srv:
        args = _cli(
            tmp_path, srv.base_url, "--budget", "0.5", "--price-in", prices[0], "--price-out", prices[1]
        )
        rc = main(
            [
                *args,
                "--per-teacher-concurrency",
                "8",
                "--max-concurrency",
                "8",
                "--results",
                str(tmp_path / "r"),
            ]
        )
        posts = srv.count()
    spent = ledger_spend(tmp_path / "ledger.jsonl")
    results = [json.loads(line) for line in (tmp_path / "r").read_text().splitlines()]
    assert rc == 0 and 0.2 < spent <= 0.5
    assert sum(r["cost_usd"] for r in results) == pytest.approx(spent)
    assert posts == sum(r["error"] is None for r in results)  # every POST was paid for and counted
    assert {r["error"] for r in results if r["error"]} == {"skipped: budget"}


# ---------------------------------------------------------------------------- the key


def test_an_echoed_key_leaves_no_8_characters_anywhere(tmp_path, monkeypatch, capsys):
    """A 401 body echoing the key, cut at 500 characters, once kept 70 of its 71 characters; a reply
    quoting a piece of it went into the pairs."""
    monkeypatch.setenv("OPENROUTER_API_KEY", KEY71)
    fragment = KEY71[20:45]
    with FakeOpenAIServer(reply=lambda body: f'[TOOL_USE] name=Read input={{"p": "{fragment}"}}') as srv:
        srv.add_fault("status", status=401, model="a/one", times=-1, message="y" * 423 + "{auth}")
        args = _cli(tmp_path, srv.base_url, "--budget", "1", "--price-in", "1", "--price-out", "1")
        args[args.index("x/model")] = "a/one,b/two,c/three"
        rc = main([*args, "--results", str(tmp_path / "results.jsonl"), "--agreement", "2"])
    captured = capsys.readouterr()
    assert rc == 0
    results = (tmp_path / "results.jsonl").read_text()
    assert "HTTP 401" in results and "[REDACTED]" in results
    for text in (results, (tmp_path / "ledger.jsonl").read_text(), (tmp_path / "pairs.jsonl").read_text()):
        assert not _leaks(text), _leaks(text)
    assert not _leaks(captured.out + captured.err)


@pytest.mark.parametrize(
    ("bad_key", "what"),
    [
        ("sk-or-v1-abcdef\r\nX-Injected: yes", "line break"),
        ("sk-or-v1-abc\ndef0123456789", "line break"),
        ("sk-or-v1-abcdéf0123456789", "non-ASCII"),
    ],
)
def test_a_key_that_cannot_be_a_header_is_refused_once(tmp_path, monkeypatch, capsys, bad_key, what):
    monkeypatch.setenv("OPENROUTER_API_KEY", bad_key)
    with FakeOpenAIServer() as srv:
        args = _cli(tmp_path, srv.base_url, "--budget", "1")
        rc = main([*args, "--price-in", "1", "--price-out", "1"])
        assert srv.count() == 0
    err = capsys.readouterr().err
    assert rc == 2 and "API key" in err and what in err and "OPENROUTER_API_KEY" in err
    assert err.count("error:") == 1 and not _leaks(err, bad_key)


# ---------------------------------------------------------------------------- the files


def test_a_second_replay_on_a_ledger_in_use_stops(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OPENROUTER_API_KEY", KEY71)
    ledger = tmp_path / "ledger.jsonl"
    with FakeOpenAIServer() as srv, Ledger(ledger):  # the first replay holds it
        rc = main(_cli(tmp_path, srv.base_url, "--budget", "1", "--price-in", "1", "--price-out", "1"))
        with pytest.raises(LedgerLockedError, match="in use by another replay"):
            asyncio.run(
                replay_trace(make_states(2), [teacher("x/model", srv.base_url)], 1.0, ledger_path=ledger)
            )
        assert srv.count() == 0
    assert rc == 2 and "in use by another replay" in capsys.readouterr().err
    assert ledger.read_text() == ""


@pytest.mark.parametrize(
    ("flag", "target"),
    [
        ("--out", "ledger"),
        ("--results", "ledger"),
        ("--out", "states"),
        ("--results", "out"),
        ("--out", "link-to-ledger"),
    ],
)
def test_out_ledger_results_and_input_must_be_different_files(tmp_path, monkeypatch, capsys, flag, target):
    monkeypatch.setenv("OPENROUTER_API_KEY", KEY71)
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("")
    (tmp_path / "link-to-ledger").symlink_to(ledger)
    paths = {"ledger": ledger, "states": tmp_path / "states.jsonl", "out": tmp_path / "pairs.jsonl"}
    paths["link-to-ledger"] = tmp_path / "link-to-ledger"
    with FakeOpenAIServer() as srv:
        args = _cli(tmp_path, srv.base_url, "--budget", "1", "--price-in", "1", "--price-out", "1")
        if flag == "--out":
            args[args.index("--out") + 1] = str(paths[target])
        else:
            args += ["--results", str(paths[target])]
        states_before = paths["states"].read_text()
        rc = main(args)
        assert srv.count() == 0
    assert rc == 2 and "are the same file" in capsys.readouterr().err
    assert ledger.read_text() == "" and paths["states"].read_text() == states_before


@pytest.mark.parametrize(
    "extra", [["--budget", "nan"], ["--budget", "inf"], ["--budget", "1", "--timeout", "nan"]]
)
def test_nan_budget_and_timeout_are_refused(tmp_path, monkeypatch, capsys, extra):
    monkeypatch.setenv("OPENROUTER_API_KEY", KEY71)
    with FakeOpenAIServer() as srv:
        with pytest.raises(SystemExit) as info:
            main(_cli(tmp_path, srv.base_url, *extra, "--price-in", "1", "--price-out", "1"))
        assert srv.count() == 0
    assert info.value.code == 2 and "must be a finite number" in capsys.readouterr().err
    assert not (tmp_path / "ledger.jsonl").exists()


def test_nan_budget_and_timeout_are_refused_by_the_api():
    spec = teacher("x/model", "http://127.0.0.1:9/v1")
    with pytest.raises(ValueError, match="max_total_usd must be a finite number"):
        asyncio.run(replay_trace(make_states(1), [spec], float("nan"), "k"))
    with pytest.raises(ValueError, match="timeout_s must be a finite number"):
        TeacherReplayer([spec], timeout_s=float("nan"))

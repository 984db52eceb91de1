"""Secrets planted in a session of every trace format, for tests that check none survives ingestion.

Every value is fake but has the shape of the real thing. ``write_sessions(folder)`` writes one session per format
(Claude Code, Codex, OpenAI messages, SWE-agent) with the secrets in the user's request, the assistant's text and
thinking, tool-call arguments, tool results and the recorded actions; :func:`leaks` names the secrets a text still
holds. Import it with ``sys.path.insert(0, "tests/synthetic")`` then ``import planted_secrets``; the Claude Code
session is written by ``claude_records.SessionWriter``.
"""

from __future__ import annotations

import json
import random
import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from claude_records import SessionWriter, session_bytes, text_block  # noqa: E402

_PEM_BODY = ("b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n"
             "QyNTUxOQAAACBq7Zk2W9xV4mN8pR3tY6uI1oP5aS0dF7gH2jK4lQ9zXwAAAJg1cV8m3nBv")  # fmt: skip
SECRETS: dict[str, str] = {
    "openai_key": "sk-proj-Ab3dE5fG7hI9jK1lM3nO5pQ7rS9tU1vW3xY5zA7bC9dE1fG3",
    "anthropic_key": "sk-ant-api03-Zx8Yw6Vu4Ts2Rq0Po8Nm6Lk4Ji2Hg0Fe8Dc6Ba4Zy2Xw0Vu8Ts6Rq4Po2-Nm0Lk8AA",
    "openrouter_key": "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",
    "github_token": "ghp_Rk7Tm2Wq9Zx4Lp6Nv3Bc8Hs5Jd1Fg0Ya2Ue7I",
    "aws_access_key": "AKIAZ7Q3R5T8W2Y4U6I9",
    "aws_secret_key": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzQ8mK4tR2v",
    "slack_token": "xoxb-2048576301-4096153202-Qm8Zt4Wc6Yp2Lr9Hx3Nv7Bk5",
    "google_api_key": "AIzaSyD8f3K9m2Q7x4T1v6B0n5R8c3W7y2L9p4H",
    "huggingface_token": "hf_Qx7Lm3Pz9Wc5Rt1Yv8Nb4Kd6Hs2Gf0JaUeZ",
    "stripe_key": "sk_live_51Hq8ZtK4mW9pR2xY7vN3bL6cD",
    "jwt": "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkphbmUifQ.dBjftJeZ4CVPmB92K27uhbUJU1p1rwW1gFWFOEjXk",
    "bearer_token": "9f8e7d6c5b4a3f2e1d0c9b8a7f6e5d4c",
    "url_credentials": "Tr0ub4dor-x9Zq",
    "secret_assignment": "Hq7vN2pX9kL4mZ8t",
    "private_key": _PEM_BODY,
}
"""kind -> a fake secret of that kind (for ``private_key``, the PEM body)."""

ENV_FILE = f"""# .env
OPENAI_API_KEY={SECRETS["openai_key"]}
export ANTHROPIC_API_KEY="{SECRETS["anthropic_key"]}"
OPENROUTER_API_KEY={SECRETS["openrouter_key"]}
GITHUB_TOKEN={SECRETS["github_token"]}
AWS_ACCESS_KEY_ID={SECRETS["aws_access_key"]}
aws_secret_access_key = {SECRETS["aws_secret_key"]}
SLACK_BOT_TOKEN={SECRETS["slack_token"]}
GOOGLE_API_KEY={SECRETS["google_api_key"]}
HF_TOKEN={SECRETS["huggingface_token"]}
STRIPE_SECRET_KEY={SECRETS["stripe_key"]}
SESSION_JWT={SECRETS["jwt"]}
DATABASE_PASSWORD={SECRETS["secret_assignment"]}
"""
"""A ``.env`` file holding most of the secrets (shell and env forms)."""

CONFIG = (f'{{"db": {{"password": "{SECRETS["secret_assignment"]}"}}, '
          f'"remote": "https://deploy:{SECRETS["url_credentials"]}@git.example.com/app.git"}}\n'
          f"curl -H 'Authorization: Bearer {SECRETS['bearer_token']}' https://api.example.com\n"
          f"-----BEGIN OPENSSH PRIVATE KEY-----\n{_PEM_BODY}\n-----END OPENSSH PRIVATE KEY-----\n")  # fmt: skip
"""JSON, a URL with credentials, a bearer header and a PEM private key."""

TEXT = ENV_FILE + CONFIG
"""Every planted secret, as a tool would print it."""


def leaks(text: str) -> list[str]:
    """The kinds whose planted secret (or a 12-character piece of it) is still in ``text``."""
    return [k for k, v in SECRETS.items() if v in text or any(v[i : i + 12] in text for i in range(0, len(v) - 12, 6))]


def _claude(path: Path) -> None:
    w = SessionWriter(random.Random(0), key="planted", cwd="/repo", start=datetime(2026, 3, 1), model="claude-sonnet-4-5",
                      version="2.1.42")  # fmt: skip
    w.user(f"Deploy with these settings:\n{TEXT}")
    bash = w.tool_block("Bash", {"command": f"cat .env; echo '{CONFIG}'"})
    w.assistant([w.thinking_block(f"The key is {SECRETS['openai_key']}"),
                 text_block(f"Using {SECRETS['github_token']} to push."), bash], [(TEXT, False, None)])  # fmt: skip
    w.assistant([w.tool_block("Write", {"file_path": ".env", "content": TEXT})], [("ok", False, None)])
    w.assistant([text_block("Done.")])
    path.write_bytes(session_bytes(w.records))


def _codex(path: Path) -> None:
    def item(payload: dict) -> dict:
        return {"timestamp": "2026-03-01T10:00:00.000Z", "type": "response_item", "payload": payload}

    lines = [
        {"timestamp": "2026-03-01T10:00:00.000Z", "type": "session_meta", "payload": {"id": "s", "cwd": "/repo"}},
        item({"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"Settings:\n{TEXT}"}]}),
        item({"type": "reasoning", "summary": [{"type": "summary_text", "text": f"key {SECRETS['openai_key']}"}]}),
        item({"type": "function_call", "name": "shell", "call_id": "c1",
              "arguments": json.dumps({"command": ["bash", "-lc", f"cat .env; echo '{CONFIG}'"]})}),
        item({"type": "function_call_output", "call_id": "c1", "output": TEXT}),
        item({"type": "custom_tool_call", "name": "apply_patch", "call_id": "c2", "input": f"*** Add File: .env\n{TEXT}"}),
        item({"type": "custom_tool_call_output", "call_id": "c2", "output": "Done"}),
        item({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]}),
    ]  # fmt: skip
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _messages() -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"cmd": f"echo '{TEXT}'"})}}
    return [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": f"Settings:\n{TEXT}"},
            {"role": "assistant", "content": f"Using {SECRETS['github_token']}.", "tool_calls": [call],
             "reasoning_content": f"key {SECRETS['openai_key']}"},
            {"role": "tool", "tool_call_id": "c1", "content": TEXT},
            {"role": "assistant", "content": "Done."}]  # fmt: skip


def write_sessions(folder: str | Path) -> dict[str, Path]:
    """One session per trace format under ``folder``, each holding every planted secret: ``{format: path}``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"claude_code": folder / "claude.jsonl", "codex": folder / "codex.jsonl",
             "openai": folder / "openai.json", "swe_agent": folder / "run.traj"}  # fmt: skip
    _claude(paths["claude_code"])
    _codex(paths["codex"])
    paths["openai"].write_text(json.dumps({"messages": _messages()}))
    step = {"response": f"Use {SECRETS['github_token']}", "action": f"echo '{TEXT}'", "observation": TEXT}
    paths["swe_agent"].write_text(json.dumps({"history": _messages(), "trajectory": [{}, {}, step]}))
    return paths

"""No degenerate teacher output ever trains the student: the rules, the normalizer's drops, the reward reference."""

from __future__ import annotations

import json

import pytest

from composer_replication.data import bundled_path
from composer_replication.ingestion import ingest_any
from composer_replication.replaysim import DJNormalizer
from composer_replication.replaysim.normalize import RULES, degeneracy
from composer_replication.rollout import NextActionEnvironment
from composer_replication.teacher_replay import extract_dpo_pairs
from composer_replication.teacher_replay.teachers import FAILED_CALL_KINDS, recorded_result

READ = '[TOOL_USE] name=Read input={"file_path": "/app/config.py"}'
EDIT = (
    '[TOOL_USE] name=Edit input={"file_path": "a.py", "old_string": "x = 1\\nx = 1\\nx = 1\\nx = 1",'
    ' "new_string": "y y y y y y y y y y y y y y y y y y y y y y y y y y y y"}'
)
# what a 135M greedy teacher wrote in the default run before this guard (issue #10)
LOOP = "The config file is loaded with a `retries` key. The config file is loaded with a `retries` key. The"

WELL_FORMED = [
    READ,
    EDIT,  # repetitive code inside a well-formed call is never read for repetition
    '[TOOL_USE] name=Bash input={"command": "pytest -q tests/test_config.py"}',
    "[THINKING] The tests fail on retries. [/THINKING]\nLet me read the config.\n" + READ,
    READ + '\n[TOOL_USE] name=Grep input={"pattern": "retries", "path": "app"}',  # two different calls
    "[TOOL_USE] name=mcp__server.tool-1 input={}",
]


def _rule(action: str, recorded: str | None = None) -> str | None:
    found = degeneracy(action, recorded_action=recorded)
    return found.rule if found else None


@pytest.mark.parametrize("action", WELL_FORMED)
def test_a_well_formed_tool_call_is_never_dropped(action):
    assert degeneracy(action, recorded_action=READ) is None
    assert degeneracy(action, recorded_action="All done.") is None
    assert degeneracy(action) is None


@pytest.mark.parametrize(
    "action",
    ["", "   \n ", "[THINKING] I should read the file first [/THINKING]", "[THINKING] cut off mid-thought"],
)
def test_empty(action):
    assert _rule(action) == "empty"


@pytest.mark.parametrize(
    "action",
    [
        READ[:-8],  # cut off inside the JSON
        "[TOOL_USE] name=Read",  # no input=
        '[TOOL_USE] name=Read input=["/app/config.py"]',  # arguments not an object
        '[TOOL_USE] name=Re ad! input={"a": 1}',  # not a tool name
        "Let me read the config. [TOOL_",  # cut before name=
        "Let me read it.\n[TO",
        'I will call [TOOL_USE] name=Read input={"file_path": "a"} now',  # a marker inside text
    ],
)
def test_truncated_call(action):
    assert _rule(action) == "truncated_call"


def test_text_that_only_looks_like_a_marker_prefix_is_kept():
    assert _rule("See section [T") is None and _rule("Done [") is None


@pytest.mark.parametrize(
    "action",
    [
        LOOP,
        "Fix the call. Fix the call.",
        "the the the the the the the the",
        "-" * 25,
        "ab" * 30,
        READ + "\n" + READ,  # the same call twice
        '[TOOL_USE] name=Read input={"file_path": "/app/config.py"}\n'
        '[TOOL_USE] name=Read input={"file_path":"/app/config.py"}',  # same call, other spacing
    ],
)
def test_repetition(action):
    assert _rule(action) == "repetition"


@pytest.mark.parametrize(
    "action",
    [
        "I will fix the bug in the config and then fix the bug in the tests.",
        "Run the tests. Then run the linter. Then commit.",
        "The retries key was missing from the config; I added it with a default of 3 and the tests pass.",
        "---\nDone.",
    ],
)
def test_natural_text_is_not_repetition(action):
    assert _rule(action, recorded="All done.") is None


def test_text_for_call_needs_the_recorded_action():
    assert _rule("The tests pass now.", recorded=READ) == "text_for_call"
    assert _rule("The tests pass now.", recorded="Done, the fix is in.") is None
    assert _rule("The tests pass now.") is None
    assert _rule(LOOP, recorded=READ) == "repetition"  # the first rule broken names the drop
    assert RULES == ("empty", "truncated_call", "repetition", "text_for_call")


def test_limits_are_checked_and_used():
    assert degeneracy("a b c a b c d", max_ngram_repeat_ratio=0.1) is not None
    assert degeneracy("a b c a b c d") is None
    for bad in ({"max_ngram_repeat_ratio": 1.0}, {"ngram_size": 1}, {"ngram_sizes": 3}):
        with pytest.raises(ValueError, match=r"max_ngram_repeat_ratio must be in \[0, 1\)"):
            degeneracy("ok", **bad)
    with pytest.raises(ValueError, match="an action must be text"):
        degeneracy(None)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# The normalizer drops them, counted by reason
# ------------------------------------------------------------------------------------------------
def _pair(sid: str, chosen: str, *, recorded: str = READ, **meta):
    """A recorded-teacher pair: its rejected side comes from the rollouts (not stored)."""
    metadata = {"recorded_action": recorded, "rejected_source": "rollout", **meta}
    return {
        "state_id": sid,
        "state_messages": [{"role": "user", "content": f"task {sid}"}],
        "chosen": chosen,
        "rejected_messages": [],
        "n_teachers_agreeing": 1,
        "metadata": metadata,
    }


def test_default_normalizer_drops_each_degenerate_reason_and_counts_it():
    n = DJNormalizer()
    pairs = [
        _pair("ok", READ),
        _pair("loop", LOOP),
        _pair("cut", READ[:-8]),
        _pair("text", "The tests pass now."),
        _pair("empty", "[THINKING] hmm [/THINKING]"),
        _pair("edit", EDIT),
        _pair("answer", "The tests pass now, the fix is in.", recorded="All done."),
    ]
    out = n.normalize(pairs)
    assert [p.state_id for p in out] == ["ok", "edit", "answer"]
    report = n.last_report
    assert {d.state_id: d.kind for d in report.dropped} == {
        "loop": "repetition",
        "cut": "truncated_call",
        "text": "text_for_call",
        "empty": "empty",
    }
    assert report.drop_counts("replay/dropped/") == {
        "replay/dropped/document_deduplicator": 0,
        "replay/dropped/empty": 1,
        "replay/dropped/repetition": 1,
        "replay/dropped/text_for_call": 1,
        "replay/dropped/text_length_filter": 0,
        "replay/dropped/truncated_call": 1,
    }
    assert all(
        d.op == "degenerate_action_filter" and d.reason.startswith("degenerate_action_filter on chosen: ")
        for d in report.dropped
    )


def test_recorded_action_falls_back_to_the_rejected_side_of_frontier_pairs():
    """A frontier pair's rejected side is the recorded action; a rollout-rejected pair has none stored."""
    frontier = {"state_id": "f", "state_messages": [], "chosen": "Done.", "rejected": READ}
    rollout = {"state_id": "s", "state_messages": [], "chosen": "Done.", "rejected_messages": [],
               "metadata": {"rejected_source": "rollout"}}
    out = DJNormalizer().normalize([frontier, rollout])
    assert [p.state_id for p in out] == ["s"]  # unknown recorded action: text_for_call cannot apply


def test_rollout_rejected_pairs_are_kept_counted_and_deduplicated_by_state_and_chosen():
    """Their empty rejected side is no reason to drop; their chosen side is still filtered; two of them are
    duplicates only at the same state (the same chosen at two states trains twice)."""
    pairs = [_pair("a", READ), _pair("b", READ), {**_pair("c", READ), "state_messages": _pair("a", READ)["state_messages"]},
             _pair("d", "The tests pass now.")]
    n = DJNormalizer()
    out = n.normalize(pairs)
    assert [p.state_id for p in out] == ["a", "b"] and all(p.rejected_messages == [] for p in out)
    assert {d.state_id: d.kind for d in n.last_report.dropped} == {"c": "document_deduplicator", "d": "text_for_call"}
    assert n.last_report.drop_counts()["text_length_filter"] == 0  # the rejected-side length rule skipped them


def test_recipe_can_turn_off_text_for_call(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({"process": [{"degenerate_action_filter": {"check_text_for_call": False}}]}))
    out = DJNormalizer(recipe).normalize([_pair("text", "The tests pass now."), _pair("loop", LOOP)])
    assert [p.state_id for p in out] == ["text"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({"process": [{"degenerate_action_filter": {"max_ngram_repeat_ratio": 2.0}}]}))
    with pytest.raises(ValueError, match="max_ngram_repeat_ratio must be in"):
        DJNormalizer(bad)


# ------------------------------------------------------------------------------------------------
# The next-action reward never takes a degenerate action as its reference
# ------------------------------------------------------------------------------------------------
STATE = {
    "state_id": "s",
    "messages": [{"role": "user", "content": "fix it"}],
    "student_action": READ,
    "tools": ["Read", "Grep"],
}


def test_reward_reference_skips_degenerate_consensus():
    degenerate = {**_pair("s", LOOP), "n_teachers_agreeing": 3}
    good = {**_pair("s", '[TOOL_USE] name=Grep input={"pattern": "retries"}'), "n_teachers_agreeing": 2}
    env = NextActionEnvironment([STATE], [degenerate])
    (prompt,) = env.prompts()
    assert prompt.reference == READ and prompt.metadata["reference_source"] == "recorded"
    assert prompt.metadata["reference_skipped"] == "repetition"
    assert env.score(prompt, LOOP).reward < env.score(prompt, READ).reward == pytest.approx(1.0)
    (prompt,) = NextActionEnvironment([STATE], [degenerate, good]).prompts()
    assert prompt.reference == good["chosen"] and prompt.metadata["n_teachers_agreeing"] == 2
    assert "reference_skipped" not in prompt.metadata
    (prompt,) = NextActionEnvironment([STATE], [good]).prompts()
    assert prompt.reference == good["chosen"] and prompt.metadata["reference_source"] == "consensus"


# ------------------------------------------------------------------------------------------------
# The default run's data: recorded-teacher pairs of the bundled sessions are all well formed
# ------------------------------------------------------------------------------------------------
def test_bundled_sessions_make_well_formed_recorded_pairs():
    files = sorted(bundled_path("sessions").rglob("*.jsonl"))
    states = [dict(s) for f in files for s in ingest_any(f)]
    assert len(states) >= 40
    results = [recorded_result(s) for s in states]
    pairs = extract_dpo_pairs(states, results, agreement_threshold=1, rejected_from_rollout=True)
    failed = [s for s in states if s.get("error_kind") in FAILED_CALL_KINDS]  # the agent's own mistakes
    assert failed and not {p.state_id for p in pairs} & {s["state_id"] for s in failed}
    assert len(pairs) == sum(1 for s in states if s["student_action"].strip()) - len(failed)
    normalizer = DJNormalizer()
    kept = normalizer.normalize(pairs)
    degenerate = [d for d in normalizer.last_report.dropped if d.op == "degenerate_action_filter"]
    assert degenerate == [], degenerate[:3]
    assert len(kept) >= 0.9 * len(pairs)  # only exact duplicates may go
    assert all(degeneracy(p.chosen, recorded_action=p.metadata["recorded_action"]) is None for p in kept)

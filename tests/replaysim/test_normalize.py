"""DJNormalizer (native backend, default recipe, report) and the replay -> normalise pipeline."""

from __future__ import annotations

import asyncio
import gc
import importlib
import importlib.machinery
import json
import sys
import types
from pathlib import Path

import pytest
import yaml

from composer_replication import replaysim
from composer_replication.replaysim import DJNormalizer, NormalizedDPOPair
from composer_replication.replaysim import normalize as norm_mod
from composer_replication.replaysim.normalize import RecipeError


def _pair(sid: str, chosen: str, rejected: str = "[TOOL_USE] name=Bash input={\"cmd\": \"ls\"}", n: int = 2):
    return {"state_id": sid, "state_messages": [{"role": "user", "content": f"task {sid}"}],
            "chosen": chosen, "rejected": rejected, "n_teachers_agreeing": n}


# 20000 characters of plain, non-repeating text (words "w0 w1 ..." cut to length)
LONG = " ".join(f"w{i}" for i in range(4000))[:20000]


def _recipe(tmp_path: Path, body) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(body if isinstance(body, str) else yaml.safe_dump(body), encoding="utf-8")
    return p


# ------------------------------------------------------------------------------------------------
# Default recipe
# ------------------------------------------------------------------------------------------------
def test_default_recipe_is_in_the_repo_and_loads():
    repo = Path(norm_mod.__file__).resolve().parents[2]
    assert DJNormalizer.DEFAULT_RECIPE == repo / "composer_replication" / "replaysim" / "default.yaml"
    assert DJNormalizer.DEFAULT_RECIPE.is_file()
    n = DJNormalizer()
    assert [(name, key) for name, key, _ in n.ops] == [("degenerate_action_filter", "chosen"), (
        "text_length_filter", "chosen"), ("text_length_filter", "rejected"), ("document_deduplicator", "text")]


def test_default_recipe_drops_empty_long_and_duplicate_pairs():
    n = DJNormalizer()
    pairs = [
        _pair("s0", "[TOOL_USE] name=Read input={\"path\": \"a.py\"}"),
        _pair("s1", ""),                                   # empty chosen
        _pair("s2", "ok", rejected="x" * 20001),           # rejected too long
        _pair("s3", "[TOOL_USE] name=Read input={\"path\": \"a.py\"}"),  # duplicate of s0
        _pair("s4", "[TOOL_USE] name=Read input={\"path\": \"A.py\"}"),  # differs by case: kept
        _pair("s5", LONG, rejected="No."),                 # exactly at the bound: kept
    ]
    out = n.normalize(pairs)
    assert [p.state_id for p in out] == ["s0", "s4", "s5"]
    assert all(isinstance(p, NormalizedDPOPair) for p in out)
    assert out[0].chosen_messages == [{"role": "assistant", "content": pairs[0]["chosen"]}]
    assert out[0].rejected_messages == [{"role": "assistant", "content": pairs[0]["rejected"]}]
    assert out[0].state_messages == pairs[0]["state_messages"] and out[0].n_teachers_agreeing == 2
    meta = out[1].metadata
    assert meta["backend"] == "native" and meta["source_index"] == 4
    assert [(o["op"], o["text_key"], o["backend"]) for o in meta["ops"]] == [
        ("degenerate_action_filter", "chosen", "native"), ("text_length_filter", "chosen", "native"), ("text_length_filter", "rejected", "native"),
        ("document_deduplicator", "text", "native")]
    rep = n.last_report
    assert (rep.n_in, rep.n_out) == (6, 3)
    why = {d.state_id: (d.op, d.reason) for d in rep.dropped}
    assert why["s1"] == ("degenerate_action_filter", "degenerate_action_filter on chosen: empty: no text and no tool call")
    assert why["s2"] == ("text_length_filter", "text_length_filter on rejected: len=20001 outside [1, 20000]")
    assert why["s3"][0] == "document_deduplicator" and "duplicate of pair #0 (s0)" in why["s3"][1]
    assert [d.index for d in rep.dropped] == [1, 2, 3]
    assert rep.drop_counts("replay/dropped/") == {
        "replay/dropped/document_deduplicator": 1, "replay/dropped/empty": 1, "replay/dropped/repetition": 0,
        "replay/dropped/text_for_call": 0, "replay/dropped/text_length_filter": 1, "replay/dropped/truncated_call": 0}


def test_empty_input_and_skip():
    assert DJNormalizer().normalize([]) == []
    n = DJNormalizer("/nonexistent/recipe.yaml", skip_dj=True)  # skip reads no recipe
    out = n.normalize([_pair("a", ""), _pair("a", "")])
    assert len(out) == 2 and all(p.metadata == {"skipped": True} for p in out)
    assert n.last_report.backend == "skipped" and n.last_report.dropped == []


# ------------------------------------------------------------------------------------------------
# Operator semantics (data-juicer's)
# ------------------------------------------------------------------------------------------------
def _run(tmp_path, op: str, args: dict, texts: list[str], text_keys="chosen") -> list[str]:
    n = DJNormalizer(_recipe(tmp_path, {"text_keys": text_keys, "process": [{op: args}]}))
    return [p.chosen_messages[0]["content"] for p in n.normalize([_pair(str(i), t) for i, t in enumerate(texts)])]


def test_text_length_filter_bounds_inclusive_and_defaults(tmp_path):
    assert _run(tmp_path, "text_length_filter", {"min_len": 2, "max_len": 3}, ["a", "ab", "abc", "abcd"]) == ["ab", "abc"]
    assert _run(tmp_path, "text_length_filter", {}, ["123456789", "1234567890"]) == ["1234567890"]  # min_len=10


def test_document_deduplicator_normalisation(tmp_path):
    texts = ["Hello, World 1", "hello world", "hello world ", "HELLO WORLD"]
    assert _run(tmp_path, "document_deduplicator", {}, texts) == ["Hello, World 1", "hello world", "HELLO WORLD"]
    assert _run(tmp_path, "document_deduplicator", {"lowercase": True}, texts) == ["Hello, World 1", "hello world"]
    assert _run(tmp_path, "document_deduplicator", {"lowercase": True, "ignore_non_character": True}, texts) == [
        "Hello, World 1"]


def test_text_keys_list_first_wins_and_text_key_override(tmp_path):
    # text_keys list -> first ("rejected"); the op override reads "chosen".
    r = {"text_keys": ["rejected", "chosen"],
         "process": [{"text_length_filter": {"min_len": 3}}, {"text_length_filter": {"min_len": 2, "text_key": "chosen"}}]}
    n = DJNormalizer(_recipe(tmp_path, r))
    out = n.normalize([_pair("a", "ok", "no"), _pair("b", "ok", "nope"), _pair("c", "k", "nope")])
    assert [p.state_id for p in out] == ["b"]
    assert [(d.state_id, d.reason.split(":")[0]) for d in n.last_report.dropped] == [
        ("a", "text_length_filter on rejected"), ("c", "text_length_filter on chosen")]


def test_text_key_defaults_to_text_as_in_data_juicer(tmp_path):
    n = DJNormalizer(_recipe(tmp_path, {"process": [{"text_length_filter": {"min_len": 6}}]}))
    assert n.ops[0][1] == "text"
    out = n.normalize([_pair("a", "ab", "cd"), _pair("b", "abc", "de")])  # text = "ab\ncd" (5), "abc\nde" (6)
    assert [p.state_id for p in out] == ["b"]


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------
def test_missing_recipe_names_the_path(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        DJNormalizer(missing)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("- just\n- a list\n", "must be a YAML mapping with a 'process' list"),
        ("text_keys: chosen\n", "must be a YAML mapping with a 'process' list"),
        ("process: {text_length_filter: {}}\n", "must be a YAML mapping with a 'process' list"),
        ("process:\n  - text_length_filter: {}\n    document_deduplicator: {}\n", r"process\[0\] must be '- op_name"),
        ("process:\n  - text_length_filter\n", r"process\[0\] must be '- op_name"),
        ("process:\n  - text_length_filter: [1, 2]\n", r"process\[0\] must be '- op_name: \{arguments\}'"),
        ("process:\n  - text_length_filter: {min_lenght: 3}\n", r"\(text_length_filter\): unknown argument\(s\) \['min_lenght'\]"),
        ("process:\n  - text_length_filter: {min_len: '3'}\n", "argument min_len must be int >= 0, got '3'"),
        ("process:\n  - text_length_filter: {min_len: true}\n", "argument min_len must be int"),
        ("process:\n  - text_length_filter: {min_len: 5, max_len: 2}\n", "min_len=5 is greater than max_len=2"),
        ("process:\n  - text_length_filter: {max_len: -1}\n", "argument max_len must be int >= 0"),
        ("process:\n  - document_deduplicator: {lowercase: 'yes'}\n", "argument lowercase must be bool, got 'yes'"),
        ("process:\n  - degenerate_action_filter: {max_ngram_repeat_ratio: 2.0}\n", r"must be in \[0, 1\)"),
        ("text_keys: 3\nprocess: []\n", "text_keys a string"),
        ("process: [\n", "not valid YAML"),
    ],
)
def test_malformed_recipes(tmp_path, body, match):
    with pytest.raises(RecipeError, match=match):
        DJNormalizer(_recipe(tmp_path, body))
    assert issubclass(RecipeError, ValueError)


def test_an_operator_that_is_not_native_needs_data_juicer(tmp_path, monkeypatch):
    """Without data-juicer, a recipe naming another operator fails at once, naming it and the fix."""
    monkeypatch.setattr(norm_mod.importlib.util, "find_spec", lambda name: None)
    recipe = _recipe(tmp_path, {"process": [{"text_length_filter": {}}, {"words_num_filter": {"min_num": 3}}]})
    with pytest.raises(RecipeError, match=r"process\[1\] uses 'words_num_filter', which is not a native operator "
                                          r".* data-juicer is not installed: install it \(pip install py-data-juicer\)"):
        DJNormalizer(recipe)


def test_text_key_must_be_a_record_field(tmp_path):
    with pytest.raises(RecipeError, match=r"process\[0\] \(text_length_filter\) reads text_key 'prompt'"):
        DJNormalizer(_recipe(tmp_path, {"process": [{"text_length_filter": {"text_key": "prompt"}}]}))


@pytest.mark.parametrize(
    ("pair", "exc", "match"),
    [
        ({"state_id": "a", "chosen": "x"}, ValueError, r"pairs\[0\]: 'rejected' must be the action text"),
        ({**_pair("a", "x"), "chosen": None}, ValueError, r"pairs\[0\]: 'chosen' must be the action text"),
        ("not a pair", ValueError, r"pairs\[0\]: a pair must be a mapping"),
    ],
)
def test_bad_pairs(pair, exc, match):
    with pytest.raises(exc, match=match):
        DJNormalizer().normalize([pair])


# ------------------------------------------------------------------------------------------------
# data-juicer backend plumbing (a stand-in data_juicer module: the real one is not installed here)
# ------------------------------------------------------------------------------------------------
def test_data_juicer_backend_plumbing(monkeypatch, tmp_path):
    seen = {}

    def init_configs(args):
        cfg = yaml.safe_load(Path(args[1]).read_text())
        seen["cfg"] = cfg
        return cfg

    class DefaultExecutor:
        def __init__(self, cfg):
            self.cfg = cfg

        def run(self):
            rows = [json.loads(line) for line in Path(self.cfg["dataset_path"]).read_text().splitlines()]
            out = Path(self.cfg["export_path"])
            out.parent.mkdir(parents=True)
            out.write_text("".join(json.dumps(r) + "\n" for r in rows if len(r["chosen"]) >= 3))

    dj = types.ModuleType("data_juicer")
    dj.__spec__ = importlib.machinery.ModuleSpec("data_juicer", None)
    dj.config = types.SimpleNamespace(init_configs=init_configs)
    dj.core = types.SimpleNamespace(DefaultExecutor=DefaultExecutor)
    monkeypatch.setitem(sys.modules, "data_juicer", dj)
    monkeypatch.setitem(sys.modules, "data_juicer.config", dj.config)
    monkeypatch.setitem(sys.modules, "data_juicer.core", dj.core)
    # An operator that is not native runs under data-juicer when it is importable (it checks its own operators);
    # replaysim's own degeneracy filter runs natively first, everything else goes to data-juicer.
    recipe = _recipe(tmp_path, {"text_keys": "chosen", "process": [
        {"degenerate_action_filter": {"check_text_for_call": False}}, {"language_id_score_filter": {"lang": "en"}},
        {"text_length_filter": {}}]})
    n = DJNormalizer(recipe)
    rollout = {**_pair("r", "abcde"), "rejected_messages": [], "metadata": {"rejected_source": "rollout"}}
    rollout.pop("rejected")
    out = n.normalize([_pair("a", "abc"), _pair("b", "x"), _pair("c", "abcd"), _pair("d", "la la la la la la"), rollout])
    assert [p.state_id for p in out] == ["a", "c", "r"]
    assert out[0].metadata["backend"] == "data_juicer"
    assert out[0].metadata["ops"] == [{"op": "degenerate_action_filter", "text_key": "chosen", "backend": "native"},
                                      {"op": "language_id_score_filter", "backend": "data_juicer"},
                                      {"op": "text_length_filter", "backend": "data_juicer"}]
    assert seen["cfg"]["process"] == [{"language_id_score_filter": {"lang": "en"}}, {"text_length_filter": {}}]
    assert seen["cfg"]["np"] == 1
    assert [(d.state_id, d.op) for d in n.last_report.dropped] == [("b", "data_juicer"), ("d", "degenerate_action_filter")]


# ------------------------------------------------------------------------------------------------
# replay -> extract -> normalise
# ------------------------------------------------------------------------------------------------
def _fake_teacher_replay(calls: dict):
    async def replay_trace(states, teachers=("default",), max_total_usd=5.0, api_key=None):
        calls["replay"] = {"states": states, "teachers": teachers, "max_total_usd": max_total_usd, "api_key": api_key}
        return [{"state_id": s["state_id"], "teacher_slug": t, "response_text": "[TOOL_USE] name=Read input={}",
                 "latency_s": 0.0, "prompt_tokens": 1, "completion_tokens": 1, "cost_usd": 0.0, "error": None}
                for s in states for t in ("t1", "t2")]

    def extract_dpo_pairs(states, teacher_actions, agreement_threshold=2, rejected_from_rollout=False):
        calls["extract"] = {"n": len(teacher_actions), "agreement_threshold": agreement_threshold,
                            "rejected_from_rollout": rejected_from_rollout}
        return [_pair(s["state_id"], "[TOOL_USE] name=Read input={}", s["student_action"]) for s in states]

    return types.SimpleNamespace(replay_trace=replay_trace, extract_dpo_pairs=extract_dpo_pairs)


STATES = [{"state_id": "t::0000", "messages": [{"role": "user", "content": "go"}], "student_action": "ls"},
          {"state_id": "t::0001", "messages": [{"role": "user", "content": "go"}], "student_action": ""}]


def test_replay_and_normalize_trace_forwards_and_normalises(monkeypatch):
    calls: dict = {}
    monkeypatch.setattr(norm_mod, "teacher_replay", _fake_teacher_replay(calls))
    raw, pairs = asyncio.run(replaysim.replay_and_normalize_trace(
        states=STATES, agreement_threshold=3, max_total_usd=1.5, api_key="k"))
    assert len(raw) == 4 and calls["extract"] == {"n": 4, "agreement_threshold": 3, "rejected_from_rollout": False}
    assert calls["replay"]["teachers"] == ("default",)  # teachers=None -> replay_trace's default
    assert calls["replay"]["max_total_usd"] == 1.5 and calls["replay"]["api_key"] == "k"
    assert [p.state_id for p in pairs] == ["t::0000"]  # empty student action dropped by the default recipe
    assert pairs[0].metadata["backend"] == "native"


def test_replay_sync_wrapper_and_explicit_normalizer(monkeypatch):
    calls: dict = {}
    monkeypatch.setattr(norm_mod, "teacher_replay", _fake_teacher_replay(calls))
    teachers = [{"slug": "local:tiny", "input_per_mtok": 0.0, "output_per_mtok": 0.0}]
    raw, pairs = replaysim.replay_and_normalize_trace_sync(
        states=STATES, teachers=teachers, normalizer=DJNormalizer(skip_dj=True))
    assert calls["replay"]["teachers"] == teachers
    assert len(pairs) == 2 and all(p.metadata == {"skipped": True} for p in pairs)
    with pytest.raises(TypeError, match="normalizer must be a DJNormalizer"):
        replaysim.replay_and_normalize_trace_sync(states=STATES, normalizer=object())


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited")
def test_sync_wrappers_refuse_a_running_loop():
    from composer_replication.teacher_replay import replay_trace_sync

    async def inner(sync):
        sync(states=STATES)

    for sync in (replaysim.replay_and_normalize_trace_sync, replay_trace_sync):
        with pytest.raises(RuntimeError, match="cannot be called from a running event loop"):
            asyncio.run(inner(sync))
    gc.collect()  # the coroutines never awaited warn here, under this test's filter


def test_reexports():
    from composer_replication import types as t

    assert replaysim.DPOPair is t.DPOPair and replaysim.TeacherCallResult is t.TeacherCallResult
    with pytest.raises(AttributeError):
        replaysim.not_a_name  # noqa: B018
    try:
        tr = importlib.import_module("composer_replication.teacher_replay")
        fns = (tr.replay_trace, tr.extract_dpo_pairs)
    except (ImportError, AttributeError):
        pytest.skip("composer_replication.teacher_replay is not complete yet")
    assert (replaysim.replay_trace, replaysim.extract_dpo_pairs) == fns


def test_end_to_end_with_the_real_teacher_replay():
    """The real replay_trace/extract_dpo_pairs over an in-process OpenAI-compatible transport."""
    httpx = pytest.importorskip("httpx")
    try:
        importlib.import_module("composer_replication.teacher_replay").replay_trace  # noqa: B018
    except (ImportError, AttributeError):
        pytest.skip("composer_replication.teacher_replay is not complete yet")
    action = '[TOOL_USE] name=Bash input={"cmd": "ls"}'

    def handler(request):
        body = json.loads(request.content)
        return httpx.Response(200, json={
            "id": "x", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": action}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5}})

    states = [{"state_id": "t::0000", "messages": [{"role": "user", "content": "list files"}], "student_action": "No."},
              {"state_id": "t::0001", "messages": [{"role": "user", "content": "again"}], "student_action": action},
              {"state_id": "t::0002", "messages": [{"role": "user", "content": "list files"}], "student_action": "No."}]
    teachers = [{"slug": "a/m1", "input_per_mtok": 1.0, "output_per_mtok": 1.0},
                {"slug": "b/m2", "input_per_mtok": 1.0, "output_per_mtok": 1.0}]
    raw, pairs = asyncio.run(replaysim.replay_and_normalize_trace(
        states=states, teachers=teachers, api_key="sk-test", http_client=httpx.MockTransport(handler)))
    assert len(raw) == 6 and all(r["error"] is None for r in raw)
    # t::0001 agrees with the teachers (no pair); t::0002 duplicates t::0000's (chosen, rejected)
    assert [p.state_id for p in pairs] == ["t::0000"]
    assert pairs[0].chosen_messages == [{"role": "assistant", "content": action}]
    assert pairs[0].n_teachers_agreeing == 2

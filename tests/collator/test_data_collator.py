"""ComposerDataCollator on the real SmolLM2 tokenizer: masks, alignment, padding, truncation, errors."""

from __future__ import annotations

import pytest
import torch

from composer_replication.chat_format import (
    build_hinted_teacher_sequence,
    build_prompt_ids,
    build_response_ids,
    to_chat_messages,
)
from composer_replication.hint_generator import make_hint_generator
from composer_replication.trainer.data_collator import CollatorConfig, ComposerDataCollator

HINTS = make_hint_generator()
CALL_TEXT = 'Let me read it.\n[TOOL_USE] name=Reed input={"file_path": "a.py"}'


def make(tokenizer, **kw) -> ComposerDataCollator:
    kw.setdefault("hint_generator", HINTS)
    return ComposerDataCollator(tokenizer, CollatorConfig(**kw))


def error_example(**extra) -> dict:
    """user -> failing assistant (unknown tool) -> tool error -> fixed call -> result -> final answer."""
    return {
        "trace_id": "err",
        "final_reward": 1.0,
        "turns": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Read a.py please"},
            {
                "role": "assistant",
                "content": "Let me read it.",
                "tool_call": {"name": "Reed", "arguments": {"file_path": "a.py"}},
                "tool_error": "tool_not_found",
                "error_meta": {"available_tools": ["Read", "Write"], "error_message": "unknown tool Reed"},
            },
            {"role": "tool", "content": "Error: unknown tool Reed"},
            {
                "role": "assistant",
                "content": "",
                "tool_call": {"function": {"name": "Read", "arguments": '{"file_path": "a.py"}'}},
            },
            {"role": "tool", "content": "print(1)"},
            {"role": "assistant", "content": "The file prints 1."},
        ],
        **extra,
    }


def simple_example(user: str = "hi", answer: str = "hello there", **extra) -> dict:
    return {"turns": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}], **extra}


def assistant_texts(example: dict) -> list[str]:
    msgs = to_chat_messages(example["turns"])
    return [m["content"] for m in msgs if m["role"] == "assistant"]


def runs(mask_row: torch.Tensor) -> list[tuple[int, int]]:
    """Contiguous [start, end) runs of ones."""
    out, start = [], None
    for i, v in enumerate(mask_row.tolist() + [0]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            out.append((start, i))
            start = None
    return out


def unpadded(batch: dict, key: str, mask_key: str, row: int) -> list[int]:
    return batch[key][row][batch[mask_key][row].bool()].tolist()


# ---------------------------------------------------------------------------- chat formatting


@pytest.mark.parametrize("text", ["hello", " leading space", "\nnewline first", "ünïcödé 🎉", "", CALL_TEXT])
def test_prompt_plus_response_equals_chat_template(tokenizer, text):
    msgs = [{"role": "user", "content": "hi"}]
    full = tokenizer.apply_chat_template(
        msgs + [{"role": "assistant", "content": text}], tokenize=True, return_dict=False
    )
    assert full[-1] == tokenizer.convert_tokens_to_ids("\n") or tokenizer.decode(full[-1:]) == "\n"
    assert build_prompt_ids(tokenizer, msgs) + build_response_ids(tokenizer, text) == full[:-1]


def test_build_response_ids_ends_with_im_end(tokenizer):
    ids = build_response_ids(tokenizer, "ok")
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    with pytest.raises(ValueError, match="response text must be a string"):
        build_response_ids(tokenizer, None)


def test_build_hinted_teacher_sequence(tokenizer):
    history = [{"role": "user", "content": "Read a.py"}]
    resp = build_response_ids(tokenizer, CALL_TEXT)
    ids, start = build_hinted_teacher_sequence(tokenizer, history, "Use `Read`.", resp)
    assert ids[start:] == resp
    assert ids[:start] == build_prompt_ids(tokenizer, history + [{"role": "user", "content": "Use `Read`."}])
    assert tokenizer.decode(ids[:start]).endswith(
        "<|im_start|>user\nUse `Read`.<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="hint must be a non-empty string"):
        build_hinted_teacher_sequence(tokenizer, history, "  ", resp)
    with pytest.raises(ValueError, match="response_ids is empty"):
        build_hinted_teacher_sequence(tokenizer, history, "hint", [])


def test_to_chat_messages_renders_tool_calls_as_action_text():
    msgs = to_chat_messages(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "Read", "arguments": '{"p": 1}'}},
                    {"name": "Bash", "input": {"cmd": "ls"}},
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {
                "role": "assistant",
                "content": CALL_TEXT,
                "tool_call": {"name": "Reed", "arguments": {"file_path": "a.py"}},
            },
        ]
    )
    assert msgs[0] == {"role": "user", "content": "part one\npart two"}
    assert (
        msgs[1]["content"] == '[TOOL_USE] name=Read input={"p": 1}\n[TOOL_USE] name=Bash input={"cmd": "ls"}'
    )
    assert msgs[2] == {"role": "tool", "content": "ok"}
    assert msgs[3]["content"] == CALL_TEXT  # the call already in the content is not repeated


# ---------------------------------------------------------------------------- channel 1


@pytest.mark.parametrize("side", ["left", "right"])
def test_response_mask_covers_exactly_the_assistant_texts(tokenizer, side):
    batch_in = [error_example(), simple_example()]
    out = make(tokenizer, padding_side=side)(batch_in)
    assert out["input_ids"].dtype == torch.long and out["input_ids"].shape == out["response_mask"].shape
    for b, ex in enumerate(batch_in):
        spans = runs(out["response_mask"][b])
        decoded = [tokenizer.decode(out["input_ids"][b, s:e]) for s, e in spans]
        assert decoded == [t + "<|im_end|>" for t in assistant_texts(ex)]
        for s, _ in spans:  # the role header sits right before each response, outside the mask
            assert tokenizer.decode(out["input_ids"][b, :s]).endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert (out["response_mask"][b] <= out["attention_mask"][b]).all()


def test_student_row_matches_prompt_and_response_builders(tokenizer):
    ex = error_example()
    out = make(tokenizer)([ex])
    ids = unpadded(out, "input_ids", "attention_mask", 0)
    msgs = to_chat_messages(ex["turns"])
    first = build_prompt_ids(tokenizer, msgs[:2])
    assert ids[: len(first)] == first
    last = build_response_ids(tokenizer, msgs[-1]["content"])
    assert ids[-len(last) :] == last
    # the row is the template's rendering of the whole conversation, minus the final newline
    full = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False)
    assert ids == full[:-1]


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_side_and_pad_id(tokenizer, side):
    out = make(tokenizer, padding_side=side)(
        [simple_example(answer="a much longer answer " * 3), simple_example()]
    )
    short_mask = out["attention_mask"][1]
    n = int(short_mask.sum())
    pad = out["input_ids"][1][~short_mask.bool()]
    assert (pad == tokenizer.pad_token_id).all() and len(pad) > 0
    if side == "left":
        assert short_mask[-n:].all() and not short_mask[0]
    else:
        assert short_mask[:n].all() and not short_mask[-1]
    assert out["response_mask"][1][~short_mask.bool()].sum() == 0


def test_padding_defaults_from_tokenizer_and_config_override(tokenizer):
    coll = ComposerDataCollator(tokenizer)
    assert coll._side == tokenizer.padding_side and coll._pad_id == tokenizer.pad_token_id
    out = make(tokenizer, pad_token_id=7, padding_side="right")(
        [simple_example("a"), simple_example("a b c d e")]
    )
    assert out["input_ids"][0, -1] == 7


def test_rewards_key_and_default(tokenizer):
    out = make(tokenizer)([simple_example(final_reward=0.5), simple_example("x")])
    assert out["rewards"].dtype == torch.float32 and out["rewards"].tolist() == [0.5, 0.0]
    out = make(tokenizer, rlvr_reward_key="score")([simple_example(score=2, final_reward=9.0)])
    assert out["rewards"].tolist() == [2.0]
    with pytest.raises(ValueError, match="example 0.*reward 'final_reward' must be a finite number"):
        make(tokenizer)([simple_example(final_reward="high")])
    with pytest.raises(ValueError, match="finite number"):
        make(tokenizer)([simple_example(final_reward=float("nan"))])


def test_group_ids_from_identical_prompts_and_explicit_keys(tokenizer):
    coll = make(tokenizer)
    out = coll([simple_example("q1", "a"), simple_example("q2", "b"), simple_example("q1", "c")])
    assert out["group_ids"].tolist() == [0, 1, 0]
    assert "group_ids" not in coll([simple_example("q1"), simple_example("q2")])
    out = coll([simple_example("q1", group_id="g"), simple_example("q2", group_id="g"), simple_example("q3")])
    assert out["group_ids"].tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match="'group_id' must be hashable"):
        coll([simple_example(group_id=["x"])])


def test_response_turns_last_masks_only_final_turn(tokenizer):
    ex = error_example()
    out = make(tokenizer, response_turns="last")([ex])
    spans = runs(out["response_mask"][0])
    assert [tokenizer.decode(out["input_ids"][0, s:e]) for s, e in spans] == ["The file prints 1.<|im_end|>"]


# ---------------------------------------------------------------------------- channel 2


def check_alignment(out: dict) -> None:
    si, ti = out["sdpo_student_index"], out["sdpo_teacher_index"]
    assert si.shape == ti.shape and si.shape[1] == 2 and si.dtype == ti.dtype == torch.long
    assert torch.equal(out["input_ids"][si[:, 0], si[:, 1]], out["ctx_teacher_input_ids"][ti[:, 0], ti[:, 1]])
    assert (si[:, 1] >= 1).all() and (ti[:, 1] >= 1).all()
    assert int(out["sdpo_loss_mask"].sum()) == len(ti)
    assert out["sdpo_loss_mask"][ti[:, 0], ti[:, 1]].all()
    assert out["attention_mask"][si[:, 0], si[:, 1]].all()


@pytest.mark.parametrize("side", ["left", "right"])
def test_teacher_is_hinted_history_plus_exact_student_response(tokenizer, side):
    ex = error_example()
    out = make(tokenizer, padding_side=side)([simple_example(answer="long " * 100), ex])  # row 1 gets padded
    assert out["ctx_teacher_input_ids"].shape[0] == 1
    assert int(out["attention_mask"][1].sum()) < out["input_ids"].shape[1]
    check_alignment(out)
    teacher = unpadded(out, "ctx_teacher_input_ids", "ctx_teacher_attention_mask", 0)
    resp = build_response_ids(tokenizer, CALL_TEXT)
    assert teacher[-len(resp) :] == resp  # ends with exactly the student's response tokens
    text = tokenizer.decode(teacher)
    assert text.endswith(
        "<|im_start|>user\nReminder: there is no tool named `Reed`. Did you mean `Read`? The available tools are: "
        "`Read`, `Write`.<|im_end|>\n<|im_start|>assistant\n" + CALL_TEXT + "<|im_end|>"
    )
    assert "Read a.py please" in text and "print(1)" not in text  # history before the failing turn only
    si = out["sdpo_student_index"]
    assert set(si[:, 0].tolist()) == {1}
    assert tokenizer.decode(out["input_ids"][1, si[:, 1]]) == CALL_TEXT + "<|im_end|>"
    loss_mask = out["sdpo_loss_mask"][0]
    assert tokenizer.decode(out["ctx_teacher_input_ids"][0][loss_mask.bool()]) == CALL_TEXT + "<|im_end|>"


def test_error_on_tool_turn_marks_preceding_assistant_and_meta_reaches_generator(tokenizer):
    seen = []

    def gen(kind, meta):
        seen.append((kind, dict(meta)))
        return f"HINT {kind} {meta.get('tool_name')}"

    ex = error_example()
    for t in ex["turns"]:
        t.pop("tool_error", None)
        t.pop("error_meta", None)
    ex["turns"][5]["tool_error"] = "runtime_error"  # the result of the second call
    ex["turns"][5]["error_meta"] = {"error_message": "boom"}
    out = make(tokenizer, hint_generator=gen)([ex])
    check_alignment(out)
    assert seen == [
        ("runtime_error", {"error_message": "boom", "error_kind": "runtime_error", "tool_name": "Read"})
    ]
    si = out["sdpo_student_index"]
    assert (
        tokenizer.decode(out["input_ids"][0, si[:, 1]])
        == '[TOOL_USE] name=Read input={"file_path": "a.py"}<|im_end|>'
    )


def test_several_sites_across_examples(tokenizer):
    ex1 = error_example()
    ex2 = error_example()
    ex2["turns"][6]["tool_error"] = "other"
    out = make(tokenizer, padding_side="left")([ex1, simple_example(), ex2])
    assert out["ctx_teacher_input_ids"].shape[0] == 3
    check_alignment(out)
    rows = out["sdpo_student_index"][:, 0].unique().tolist()
    assert rows == [0, 2]


def test_channel2_toggles(tokenizer):
    ex = error_example()
    keys = {
        "ctx_teacher_input_ids",
        "ctx_teacher_attention_mask",
        "sdpo_loss_mask",
        "sdpo_student_index",
        "sdpo_teacher_index",
    }
    assert keys <= set(make(tokenizer)([ex]))
    assert not keys & set(make(tokenizer, enable_sdpo=False)([ex]))
    assert not keys & set(make(tokenizer, hint_generator=None)([ex]))
    coll = make(tokenizer, hint_generator=lambda kind, meta: None)
    assert not keys & set(coll([ex]))
    assert coll.stats.sdpo_sites == 1 and coll.stats.sdpo_sites_without_hint == 1
    assert not keys & set(make(tokenizer)([simple_example()]))  # no error site


# ---------------------------------------------------------------------------- channel 3


def test_dpo_pairs(tokenizer):
    state = [
        {"role": "user", "content": "Read a.py"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "Glob", "arguments": '{"p": "*"}'}}],
        },
        {"role": "tool", "content": "a.py"},
    ]
    pair = {
        "state_id": "s",
        "state_messages": state,
        "chosen": '[TOOL_USE] name=Read input={"file_path": "a.py"}',
        "rejected": "I refuse.",
        "n_teachers_agreeing": 2,
    }
    ex = simple_example(dpo_pairs=[pair, dict(pair, chosen="B", rejected="C")])
    out = make(tokenizer, padding_side="left")([ex, simple_example()])
    assert out["dpo_chosen_input_ids"].shape[0] == 2 and out["dpo_rejected_input_ids"].shape[0] == 2
    prompt = build_prompt_ids(tokenizer, state)
    assert '[TOOL_USE] name=Glob input={"p": "*"}' in tokenizer.decode(prompt)
    for side, texts in (("chosen", [pair["chosen"], "B"]), ("rejected", ["I refuse.", "C"])):
        for p, text in enumerate(texts):
            ids = unpadded(out, f"dpo_{side}_input_ids", f"dpo_{side}_attention_mask", p)
            assert ids == prompt + build_response_ids(tokenizer, text)
            resp = out[f"dpo_{side}_input_ids"][p][out[f"dpo_{side}_response_mask"][p].bool()]
            assert tokenizer.decode(resp) == text + "<|im_end|>"
    assert "dpo_chosen_ref_logprobs" not in out
    assert not any(k.startswith("dpo_") for k in make(tokenizer, enable_replay_dpo=False)([ex]))
    assert not any(k.startswith("dpo_") for k in make(tokenizer)([simple_example()]))


def test_bad_dpo_pair(tokenizer):
    with pytest.raises(ValueError, match=r"example 0.*dpo_pairs\[0\].*'rejected' must be the action text"):
        make(tokenizer)([simple_example(dpo_pairs=[{"state_messages": [], "chosen": "a", "rejected": None}])])
    with pytest.raises(ValueError, match=r"dpo_pairs\[0\] must be a DPOPair dict"):
        make(tokenizer)([simple_example(dpo_pairs=["nope"])])


# ---------------------------------------------------------------------------- truncation


def test_policy_truncation_keeps_last_response_and_counts(tokenizer):
    ex = error_example()
    full = make(tokenizer)([ex])
    n = int(full["attention_mask"].sum())
    coll = make(tokenizer, max_seq_len=n - 10)
    out = coll([ex, simple_example()])
    assert coll.stats.truncated_policy == 1
    ids = unpadded(out, "input_ids", "attention_mask", 0)
    assert len(ids) == n - 10
    assert ids == unpadded(full, "input_ids", "attention_mask", 0)[10:]  # history dropped from the left
    spans = runs(out["response_mask"][0])
    assert (
        tokenizer.decode(out["input_ids"][0, spans[-1][0] : spans[-1][1]]) == "The file prints 1.<|im_end|>"
    )
    check_alignment(out)  # the failing turn survived the cut, the teacher row is cut to the same cap
    assert out["ctx_teacher_input_ids"].shape[1] <= n - 10


def test_truncation_drops_site_whose_response_was_cut(tokenizer):
    ex = error_example()
    last = len(build_response_ids(tokenizer, "The file prints 1."))
    coll = make(tokenizer, max_seq_len=last + 25)
    out = coll([ex])
    assert coll.stats.truncated_policy == 1 and coll.stats.sdpo_sites_dropped == 1
    assert "ctx_teacher_input_ids" not in out
    assert int(out["attention_mask"].sum()) == last + 25


def test_teacher_truncation_keeps_response_whole(tokenizer):
    ex = error_example()
    ex["turns"] = ex["turns"][:3]  # the failing turn is the last one
    n = int(make(tokenizer)([ex])["attention_mask"].sum())
    coll = make(tokenizer, max_seq_len=n)  # the hint makes the teacher longer than the student
    out = coll([ex])
    assert coll.stats.truncated_policy == 0 and coll.stats.truncated_sdpo == 1
    assert out["ctx_teacher_input_ids"].shape[1] == n
    check_alignment(out)
    teacher = out["ctx_teacher_input_ids"][0].tolist()
    assert teacher[-len(build_response_ids(tokenizer, CALL_TEXT)) :] == build_response_ids(
        tokenizer, CALL_TEXT
    )


def test_response_longer_than_cap_raises(tokenizer):
    answer = "word " * 40
    n_resp = len(build_response_ids(tokenizer, answer))
    with pytest.raises(ValueError, match=rf"has {n_resp} tokens but max_seq_len=20 must exceed it"):
        make(tokenizer, max_seq_len=20)([simple_example(answer=answer)])


def test_dpo_truncation_cuts_shared_prompt(tokenizer):
    pair = {
        "state_messages": [{"role": "user", "content": "long context " * 30}],
        "chosen": "yes",
        "rejected": "no no no",
    }
    coll = make(tokenizer, max_dpo_seq_len=24)
    out = coll([simple_example(dpo_pairs=[pair])])
    assert coll.stats.truncated_dpo == 1
    c_ids = unpadded(out, "dpo_chosen_input_ids", "dpo_chosen_attention_mask", 0)
    r_ids = unpadded(out, "dpo_rejected_input_ids", "dpo_rejected_attention_mask", 0)
    rc, rr = build_response_ids(tokenizer, "yes"), build_response_ids(tokenizer, "no no no")
    assert max(len(c_ids), len(r_ids)) == 24
    assert c_ids[-len(rc) :] == rc and r_ids[-len(rr) :] == rr
    assert c_ids[: -len(rc)] == r_ids[: -len(rr)]  # the same prompt on both sides
    tight = make(tokenizer, max_dpo_seq_len=3)  # a response alone reaches the cap: skipped, counted
    assert not any(k.startswith("dpo_") for k in tight([simple_example(dpo_pairs=[pair])]))
    assert tight.stats.skipped_dpo == 1 and tight.stats_batching.skipped == {"response_over_length": 1}
    skip = make(tokenizer, max_dpo_seq_len=24, over_length="skip")  # the other policy: no cut, skipped
    assert not any(k.startswith("dpo_") for k in skip([simple_example(dpo_pairs=[pair])]))
    assert skip.stats.skipped_dpo == 1 and skip.stats.truncated_dpo == 0


# ---------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("batch", [[], (), {"turns": []}, None])
def test_empty_or_wrong_batch(tokenizer, batch):
    with pytest.raises(ValueError, match="batch must be a non-empty list"):
        make(tokenizer)(batch)


@pytest.mark.parametrize(
    ("example", "match"),
    [
        ({"turns": [{"role": "user", "content": "hi"}]}, "has no assistant turn"),
        ({"turns": []}, "'turns' must be a non-empty list"),
        ("not a dict", "an example must be a dict"),
        (
            {"turns": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
            "role 'robot'",
        ),
        ({"turns": [{"role": "assistant", "content": "y"}]}, "turn 0 is an assistant turn"),
        (
            {
                "turns": [
                    {"role": "user", "content": "x", "tool_error": "json_decode"},
                    {"role": "assistant", "content": "y"},
                ]
            },
            "turn 0 has role 'user' but carries tool_error",
        ),
        (
            {
                "turns": [
                    {"role": "user", "content": "x"},
                    {"role": "tool", "content": "e", "tool_error": "other"},
                    {"role": "assistant", "content": "y"},
                ]
            },
            "no assistant turn precedes it",
        ),
        (
            {
                "turns": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": "y", "error_meta": "bad"},
                ]
            },
            "error_meta must be a dict",
        ),
        (
            {
                "turns": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "tool_call": {"arguments": {}}},
                ]
            },
            "tool call must be a dict with a 'name'",
        ),
    ],
)
def test_bad_examples(tokenizer, example, match):
    with pytest.raises(ValueError, match=match):
        make(tokenizer)([simple_example(), example])


def test_error_names_the_example(tokenizer):
    with pytest.raises(ValueError, match=r"example 1 \(trace_id='t9'\)"):
        make(tokenizer)([simple_example(), {"trace_id": "t9", "turns": [{"role": "user", "content": "x"}]}])


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"max_seq_len": 1}, "max_seq_len must be an int >= 2"),
        ({"max_dpo_seq_len": 0}, "max_dpo_seq_len must be an int >= 2"),
        ({"padding_side": "up"}, "padding_side must be None, 'left' or 'right'"),
        ({"pad_token_id": -1}, "pad_token_id must be None or an int >= 0"),
        ({"hint_generator": "x"}, "hint_generator must be callable"),
        ({"response_turns": "some"}, "response_turns must be 'all' or 'last'"),
        ({"rlvr_reward_key": ""}, "must be non-empty"),
    ],
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        CollatorConfig(**kw)


def test_tokenizer_without_chat_template_is_rejected():
    with pytest.raises(ValueError, match="tokenizer must provide apply_chat_template"):
        ComposerDataCollator(object())


def test_trainer_package_exports_and_lazy_trainer():
    import composer_replication.trainer as trainer_pkg

    assert trainer_pkg.ComposerDataCollator is ComposerDataCollator
    assert "ComposerReplicationTrainer" in trainer_pkg.__all__  # resolved lazily, needs trl
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        trainer_pkg.nope  # noqa: B018

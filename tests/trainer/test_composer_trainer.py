"""ComposerReplicationTrainer: the channel-2/3 data path, each channel against a direct computation,
the composition with TRL's GRPO loss, and two real training steps on the tiny model."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from composer_replication.chat_format import (  # noqa: E402
    build_hinted_teacher_sequence,
    build_prompt_ids,
    build_response_ids,
)
from composer_replication.opsd import generalized_jsd_loss  # noqa: E402
from composer_replication.trainer.composer_trainer import ComposerReplicationTrainer  # noqa: E402

CHOSEN = '[TOOL_USE] name=Bash input={"cmd": "ls"}'


def _rows(n: int, every: int = 2) -> list[dict]:
    """n prompt rows; rows with i % every == 0 carry a hint and a DPO pair."""
    return [{"prompt": [{"role": "user", "content": f"List the files in dir{i}."}],
             "hint": "Use the Bash tool with ls." if i % every == 0 else None,
             "dpo_chosen": CHOSEN if i % every == 0 else None,
             "dpo_rejected": "I cannot do that." if i % every == 0 else None} for i in range(n)]


def _reward_len(completions, **kwargs):
    return [len(c[0]["content"]) / 10.0 for c in completions]


def _config(out_dir: str, **kw) -> GRPOConfig:
    base = dict(output_dir=out_dir, use_vllm=False, use_cpu=True, bf16=False, gradient_checkpointing=False,
                per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=2,
                learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", seed=0)
    return GRPOConfig(**(base | kw))


@pytest.fixture(scope="module")
def trainer(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    with tempfile.TemporaryDirectory() as d:
        yield ComposerReplicationTrainer(
            model=copy.deepcopy(model), reward_funcs=[_reward_len], args=_config(d),
            train_dataset=Dataset.from_list(_rows(4)), processing_class=tok, alpha_sdpo=0.5, beta_replay=0.5)


@pytest.fixture(scope="module")
def batch(trainer):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); loss calls here run outside it
    torch.manual_seed(0)
    return trainer._generate_and_score_completions(_rows(4))


def _student_ids(batch, i: int) -> tuple[list[int], int]:
    """Unpadded prompt + completion ids of row i, and the completion length."""
    p = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
    n = int(batch["completion_mask"][i].sum())
    return p + batch["completion_ids"][i, :n].tolist(), n


# ------------------------------------------------------------------------------------------------
# Data path
# ------------------------------------------------------------------------------------------------
def test_channel_tensors_follow_the_batch_contract(trainer, batch):
    tok = trainer.processing_class
    b = batch["completion_ids"].shape[0]
    for key in ("ctx_teacher_input_ids", "ctx_teacher_attention_mask", "sdpo_loss_mask",
                "dpo_chosen_input_ids", "dpo_chosen_response_mask", "dpo_rejected_input_ids",
                "dpo_rejected_response_mask", "dpo_chosen_attention_mask", "dpo_rejected_attention_mask"):
        assert batch[key].shape[0] == b and batch[key].dtype == torch.long, key
    assert batch["dpo_chosen_ref_logprobs"].shape == (b,)
    for i, row in enumerate(_rows(4)):
        has = row["hint"] is not None
        assert bool(batch["sdpo_loss_mask"][i].any()) == has
        assert bool(batch["dpo_chosen_response_mask"][i].any()) == has
        if not has:
            continue
        ids, n = _student_ids(batch, i)
        want, start = build_hinted_teacher_sequence(tok, row["prompt"], row["hint"], ids[-n:])
        got_len = int(batch["ctx_teacher_attention_mask"][i].sum())
        assert batch["ctx_teacher_input_ids"][i, :got_len].tolist() == want
        assert batch["sdpo_loss_mask"][i].tolist()[:got_len] == [0] * start + [1] * n
        p = build_prompt_ids(tok, row["prompt"])
        for side, text in (("chosen", row["dpo_chosen"]), ("rejected", row["dpo_rejected"])):
            r = build_response_ids(tok, text)
            assert batch[f"dpo_{side}_input_ids"][i, : len(p) + len(r)].tolist() == p + r
            assert batch[f"dpo_{side}_response_mask"][i].sum() == len(r)
            # the reference is the sampling-time policy (TRL keeps no ref_model when beta == 0)
            with torch.no_grad():
                logits = trainer.model(input_ids=torch.tensor([p + r])).logits[0]
            lp = F.log_softmax(logits[len(p) - 1:-1], -1).gather(-1, torch.tensor(r)[:, None]).sum()
            torch.testing.assert_close(batch[f"dpo_{side}_ref_logprobs"][i], lp, atol=1e-4, rtol=1e-5)


def test_extra_tensors_survive_prepare_inputs_shuffle(trainer):
    trainer.model.train()
    torch.manual_seed(1)
    out = trainer._prepare_inputs(_rows(4))
    assert "sdpo_loss_mask" in out and "dpo_chosen_ref_logprobs" in out
    for i in range(out["completion_ids"].shape[0]):  # teacher tail == the completion of the same row
        m = out["sdpo_loss_mask"][i].bool()
        if m.any():
            n = int(out["completion_mask"][i].sum())
            assert out["ctx_teacher_input_ids"][i][m].tolist() == out["completion_ids"][i, :n].tolist()


def test_non_conversational_prompt_with_hint_is_refused(trainer, batch):
    rows = [{"prompt": "plain text", "hint": "h"}] + [{"prompt": r["prompt"]} for r in _rows(3)]
    with pytest.raises(ValueError, match="row 0 has a hint but its prompt is not conversational"):
        trainer._sdpo_tensors([r["prompt"] for r in rows], [r.get("hint") for r in rows], batch)
    with pytest.raises(ValueError, match="dpo_chosen and dpo_rejected must both be non-empty"):
        trainer._dpo_tensors([("x", None)] + [(None, None)] * 3, batch)


# ------------------------------------------------------------------------------------------------
# Channels against direct computations
# ------------------------------------------------------------------------------------------------
def test_sdpo_loss_matches_unpadded_reference(trainer, batch):
    model = trainer.model
    got = trainer._compute_sdpo_loss(model, batch)
    s_all, t_all = [], []
    for i, row in enumerate(_rows(4)):
        if row["hint"] is None:
            continue
        ids, n = _student_ids(batch, i)
        teacher, _ = build_hinted_teacher_sequence(trainer.processing_class, row["prompt"], row["hint"], ids[-n:])
        s_all.append(model(input_ids=torch.tensor([ids])).logits[0, -n - 1:-1])
        with torch.no_grad():
            t_all.append(model(input_ids=torch.tensor([teacher])).logits[0, -n - 1:-1])
    s, t = torch.cat(s_all)[None], torch.cat(t_all)[None]
    want = generalized_jsd_loss(s, t, labels=torch.zeros(s.shape[:2], dtype=torch.long), beta=0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert got.requires_grad


def test_dpo_loss_matches_direct_formula(trainer, batch):
    b = dict(batch)
    b["dpo_chosen_ref_logprobs"] = batch["dpo_chosen_ref_logprobs"] - 1.0  # make Delta nonzero
    b["dpo_rejected_ref_logprobs"] = batch["dpo_rejected_ref_logprobs"] + 0.5
    got = trainer._compute_trace_replay_loss(trainer.model, b)
    rows = [i for i, r in enumerate(_rows(4)) if r["hint"] is not None]
    deltas = []
    for i in rows:
        lp = {}
        for side in ("chosen", "rejected"):
            n_tok = int(b[f"dpo_{side}_attention_mask"][i].sum())
            ids = b[f"dpo_{side}_input_ids"][i, :n_tok]
            resp = b[f"dpo_{side}_response_mask"][i, :n_tok].bool()
            logp = F.log_softmax(trainer.model(input_ids=ids[None]).logits[0, :-1], -1)
            lp[side] = logp.gather(-1, ids[1:, None])[:, 0][resp[1:]].sum()
        deltas.append((lp["chosen"] - b["dpo_chosen_ref_logprobs"][i]) - (lp["rejected"] - b["dpo_rejected_ref_logprobs"][i]))
    want = -F.logsigmoid(0.1 * torch.stack(deltas)).mean()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_compute_loss_composes_grpo_and_channels(trainer, batch, monkeypatch):
    model = trainer.model
    grpo = GRPOTrainer._compute_loss(trainer, model, batch)
    sdpo = trainer._compute_sdpo_loss(model, batch)
    dpo = trainer._compute_trace_replay_loss(model, batch)
    trainer._channel_metrics["train"].clear()
    monkeypatch.setattr(trainer, "current_gradient_accumulation_steps", 2)
    total = trainer._compute_loss(model, batch)  # the channels' shares are 1 / GA (TRL's GRPO loss is scaled)
    torch.testing.assert_close(total, grpo / 2 + 0.5 * sdpo / 2 + 0.5 * dpo / 2, atol=1e-5, rtol=1e-5)
    pending = trainer._channel_metrics["train"]
    assert {"composer/jsd", "composer/jsd/num_tokens", "composer/dpo", "composer/dpo/num_pairs",
            "composer/dpo/reward_accuracy"} <= pending.keys()
    assert all(isinstance(v, torch.Tensor) for vs in pending.values() for v in vs)  # read once per logging step
    trainer._channel_metrics["train"].clear()
    monkeypatch.setattr(trainer, "current_gradient_accumulation_steps", 1)
    monkeypatch.setattr(trainer, "loss_config", dataclasses.replace(trainer.loss_config, alpha_sdpo=0.0, beta_replay=0.0))
    assert float(trainer._compute_sdpo_loss(model, batch)) == 0.0
    assert torch.equal(trainer._compute_loss(model, batch), GRPOTrainer._compute_loss(trainer, model, batch))
    assert not trainer._channel_metrics["train"]


def test_channels_skip_rows_without_data_and_check_alignment(trainer, batch):
    trainer._channel_metrics["train"].clear()
    b = {k: v for k, v in batch.items() if not k.startswith(("ctx_", "sdpo_", "dpo_"))}
    assert float(trainer._compute_sdpo_loss(trainer.model, b)) == 0.0
    assert float(trainer._compute_trace_replay_loss(trainer.model, b)) == 0.0
    b = dict(batch)
    b["sdpo_loss_mask"] = torch.zeros_like(batch["sdpo_loss_mask"])
    assert float(trainer._compute_sdpo_loss(trainer.model, b)) == 0.0
    assert not trainer._channel_metrics["train"]  # a channel that did not run logs nothing
    bad = batch["sdpo_loss_mask"].clone()
    row = int(bad.any(-1).nonzero()[0])
    bad[row, bad[row].nonzero()[-1]] = 0  # drop the last distilled token of one row
    with pytest.raises(ValueError, match="per-row counts of response_mask"):
        trainer._compute_sdpo_loss(trainer.model, dict(batch, sdpo_loss_mask=bad))


# ------------------------------------------------------------------------------------------------
# Construction
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"alpha_sdpo": -1.0}, "'loss.alpha_sdpo' must be a number in .0, "), ({"beta_replay": -0.1}, "'loss.beta_replay' must be a number in .0, "),
     ({"sdpo_jsd_beta": 1.5}, r"'loss.sdpo_jsd_beta' must be a number in \[0, 1\]"),
     ({"sdpo_temperature": 0.0}, "'loss.sdpo_temperature' must be a number in .0, "),
     ({"sdpo_token_clip": 0.0}, "'loss.sdpo_token_clip' must be a number in .0, "),
     ({"replay_dpo_beta": 0.0}, "'loss.replay_dpo_beta' must be a number in .0, "),
     ({"loss_chunk_size": 0}, "'loss.chunk_size' must be an integer in .1, ")],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ComposerReplicationTrainer(**kwargs)


def test_missing_trl_import_error(monkeypatch):
    from composer_replication.trainer import composer_trainer as ct

    monkeypatch.setattr(ct, "_TRL_AVAILABLE", False)
    with pytest.raises(ImportError, match=r"pip install composer-replication\[trl\]"):
        ct.ComposerReplicationTrainer()


@pytest.mark.slow
def test_module_imports_without_trl():
    code = ("import sys; sys.modules['trl'] = None\n"
            "from composer_replication.trainer import composer_trainer as ct\n"
            "assert ct._TRL_AVAILABLE is False and ct.ComposerReplicationTrainer.__mro__[1] is object\n"
            "try:\n    ct.ComposerReplicationTrainer()\nexcept ImportError as e:\n    print('IMPORT-ERROR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "IMPORT-ERROR" in out.stdout and "composer-replication[trl]" in out.stdout


# ------------------------------------------------------------------------------------------------
# Two real training steps
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_training_steps_log_channels_and_change_every_parameter(tiny_model_and_tokenizer, tmp_path):
    model, tok = tiny_model_and_tokenizer
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tr = ComposerReplicationTrainer(
        model=model, reward_funcs=[_reward_len], args=_config(str(tmp_path)),
        train_dataset=Dataset.from_list(_rows(4, every=1)), processing_class=tok, alpha_sdpo=0.5, beta_replay=0.5)
    tr.train()
    logs = [h for h in tr.state.log_history if "composer/jsd" in h]
    assert len(logs) == 2
    for h in logs:
        for key in ("composer/jsd/num_tokens", "composer/dpo", "composer/dpo/reward_margin", "loss"):
            assert key in h, (key, h)
        assert h["composer/dpo/num_pairs"] == 4.0
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p.detach(), before[n])]
    assert unchanged == []

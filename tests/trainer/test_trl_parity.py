"""With alpha_sdpo = beta_replay = 0, ComposerReplicationTrainer is plain TRL GRPOTrainer.

Same seed, same batch: the same loss bit for bit, the same gradients, and after real optimizer steps the same
weights. The dataset carries the channel-2/3 columns (hint, DPO pair), so switching the channels off must also
leave the data path untouched. The docs' TRL snippet (docs/integrations.md) runs here too.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from composer_replication.trainer.composer_trainer import ComposerReplicationTrainer  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def _rows(n: int) -> list[dict]:
    """Conversational prompts; every other row carries a hint and a DPO pair (unused with the channels off)."""
    return [
        {
            "prompt": [{"role": "user", "content": f"List the files in dir{i}."}],
            "hint": "Use the Bash tool with ls." if i % 2 == 0 else None,
            "dpo_chosen": '[TOOL_USE] name=Bash input={"cmd": "ls"}' if i % 2 == 0 else None,
            "dpo_rejected": "I cannot do that." if i % 2 == 0 else None,
        }
        for i in range(n)
    ]


def _reward_len(completions, **kwargs):
    return [len(c[0]["content"]) / 10.0 for c in completions]


def _config(out_dir: Path, **kw) -> GRPOConfig:
    """CPU GRPO settings (notes/offline-deps.md §2); beta > 0 so TRL's KL-to-reference term is in the loss."""
    base = dict(
        output_dir=str(out_dir),
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-2,
        beta=0.04,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    return GRPOConfig(**(base | kw))


@pytest.fixture(scope="module")
def model_dir(tiny_model_and_tokenizer, tmp_path_factory) -> Path:
    """The tiny model saved to a folder: TRL loads the policy and (beta > 0) its frozen reference from it."""
    model, tok = tiny_model_and_tokenizer
    path = tmp_path_factory.mktemp("tiny")
    copy.deepcopy(model).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _trainer(cls, model_dir: Path, tok, out_dir: Path, **kw):
    extra = dict(alpha_sdpo=0.0, beta_replay=0.0) if cls is ComposerReplicationTrainer else {}
    return cls(
        model=str(model_dir),
        reward_funcs=[_reward_len],
        args=_config(out_dir, **kw),
        train_dataset=Dataset.from_list(_rows(4)),
        processing_class=tok,
        **extra,
    )


def _loss_and_grads(trainer, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); this call runs outside it
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None
    }


@pytest.mark.slow
def test_same_batch_same_loss_and_gradients(tiny_model_and_tokenizer, model_dir, tmp_path):
    tok = tiny_model_and_tokenizer[1]
    plain = _trainer(GRPOTrainer, model_dir, tok, tmp_path / "plain")
    composer = _trainer(ComposerReplicationTrainer, model_dir, tok, tmp_path / "composer")
    batches = []
    for t in (plain, composer):  # each generates from the same seed: the channels off change nothing here
        t.model.train()
        torch.manual_seed(0)
        batches.append(t._generate_and_score_completions(_rows(4)))
    assert batches[0].keys() == batches[1].keys()
    for k, v in batches[0].items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, batches[1][k]), k
    assert batches[0]["advantages"].abs().sum() > 0  # a batch that actually carries a policy gradient

    loss_p, grads_p = _loss_and_grads(plain, batches[0])
    loss_c, grads_c = _loss_and_grads(composer, batches[0])
    assert torch.equal(loss_p, loss_c)
    assert grads_p.keys() == grads_c.keys() and len(grads_p) == len(list(plain.model.parameters()))
    for n, g in grads_p.items():
        assert torch.equal(g, grads_c[n]), n
    assert not composer._channel_metrics["train"]  # with both channels off nothing of ours is logged


@pytest.mark.slow
def test_two_training_steps_give_the_same_weights(tiny_model_and_tokenizer, model_dir, tmp_path):
    model, tok = tiny_model_and_tokenizer
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights, losses, keys = [], [], []
    for cls in (GRPOTrainer, ComposerReplicationTrainer):  # built and trained one after the other: same RNG
        t = _trainer(cls, model_dir, tok, tmp_path / cls.__name__)
        t.train()
        weights.append({n: p.detach().clone() for n, p in t.model.named_parameters()})
        losses.append([row["loss"] for row in t.state.log_history if "loss" in row])
        keys.append([sorted(row) for row in t.state.log_history])
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    assert keys[0] == keys[1]  # the logged keys are GRPOTrainer's, no composer/* with the channels off
    for n, w in weights[0].items():
        assert torch.equal(w, weights[1][n]), n
    assert any(not torch.equal(w, before[n]) for n, w in weights[0].items())  # the steps did update


@pytest.mark.slow
def test_docs_trl_snippet_runs():
    m = re.search(r"<!-- runs: trl -->\s*```python\n(.*?)```", DOCS.read_text(encoding="utf-8"), re.S)
    assert m, "docs/integrations.md has no runnable 'trl' snippet"
    exec(compile(m.group(1), str(DOCS), "exec"), {"__name__": "docs_snippet"})

"""ComposerReplicationTrainer under the GRPOConfig / GRPOTrainer options that reach ``_compute_loss`` (issue #25).

Each option: the trainer builds, and one training step runs with both channels on where this CPU allows it
(``docs/integrations.md`` has the table). Liger's kernels need Triton on a GPU: its import boundary is mocked
(``liger_kernel.transformers._apply_liger_kernel_to_instance``) so the step runs here. vLLM is not installed: TRL's
``VLLMGeneration`` is replaced by a fake that samples with the policy and returns its log-probs.
"""

from __future__ import annotations

import copy
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from composer_replication.trainer.composer_trainer import ComposerReplicationTrainer  # noqa: E402

HINT, CHOSEN, REJECTED = "Use the Bash tool with ls.", '[TOOL_USE] name=Bash input={"cmd": "ls"}', "I cannot do that."
TRL_TEMPLATES = Path(sys.modules["trl"].__file__).parent / "chat_templates"


def _rows(n: int = 4) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"List the files in dir{i}."}], "hint": HINT,
             "dpo_chosen": CHOSEN, "dpo_rejected": REJECTED} for i in range(n)]


def _reward_len(completions, **kwargs):
    return [len(c[0]["content"]) / 10.0 for c in completions]


def _args(out: Path, **kw) -> GRPOConfig:
    base = dict(output_dir=str(out), use_cpu=True, bf16=False, gradient_checkpointing=False,
                per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=1,
                learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", seed=0)
    return GRPOConfig(**(base | kw))


def _trainer(model_and_tok, out: Path, rows=None, *, tok=None, **kw) -> ComposerReplicationTrainer:
    model, tiny_tok = model_and_tok
    trainer_kw = {k: kw.pop(k) for k in ("peft_config", "tools", "rollout_func", "environment_factory") if k in kw}
    return ComposerReplicationTrainer(
        model=copy.deepcopy(model), reward_funcs=[_reward_len], args=_args(out, **kw),
        train_dataset=Dataset.from_list(rows or _rows()), processing_class=tok or tiny_tok,
        alpha_sdpo=0.5, beta_replay=0.5, **trainer_kw)


def _step_logs_channels(trainer) -> dict:
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h][-1]
    assert {"composer/jsd", "composer/jsd/num_tokens", "composer/dpo", "composer/dpo/num_pairs"} <= logged.keys(), logged
    assert logged["composer/jsd/num_tokens"] > 0
    moved = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved, "no trainable parameter changed"
    return logged


def _tool_tokenizer(tok):
    """The tiny tokenizer with TRL's Qwen2.5 chat template: the same ChatML tokens, and tool calling."""
    tool_tok = copy.deepcopy(tok)
    tool_tok.chat_template = (TRL_TEMPLATES / "qwen2_5.jinja").read_text()
    return tool_tok


# ---------------------------------------------------------------------------- liger


@pytest.fixture
def fake_liger(monkeypatch):
    """Liger's import boundary: ``_apply_liger_kernel_to_instance`` records its call instead of patching layers."""
    calls = []
    pkg, sub = types.ModuleType("liger_kernel"), types.ModuleType("liger_kernel.transformers")
    sub._apply_liger_kernel_to_instance = lambda model, **cfg: calls.append(cfg)
    pkg.transformers = sub
    monkeypatch.setitem(sys.modules, "liger_kernel", pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", sub)
    monkeypatch.setattr("transformers.integrations.liger.is_liger_kernel_available", lambda: True)
    return calls


@pytest.mark.slow
def test_liger_builds_with_channels_on_and_off_and_runs_a_step(tiny_model_and_tokenizer, tmp_path, fake_liger):
    for alpha in (0.0, 0.5):  # the former `use_liger_kernel=True skips _compute_loss` refusal is gone
        ComposerReplicationTrainer(model=copy.deepcopy(tiny_model_and_tokenizer[0]), reward_funcs=[_reward_len],
                                   args=_args(tmp_path, use_liger_kernel=True), processing_class=tiny_model_and_tokenizer[1],
                                   train_dataset=Dataset.from_list(_rows()), alpha_sdpo=alpha, beta_replay=alpha)
    trainer = _trainer(tiny_model_and_tokenizer, tmp_path, use_liger_kernel=True)
    _step_logs_channels(trainer)
    assert fake_liger == [{"fused_linear_cross_entropy": False}]  # TRL applies layer kernels only


# ---------------------------------------------------------------------------- peft


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_peft_lora_step(tiny_model_and_tokenizer, tmp_path, beta):
    peft = pytest.importorskip("peft")
    trainer = _trainer(tiny_model_and_tokenizer, tmp_path, beta=beta,
                       peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    _, ctx = trainer._dpo_reference()  # the reference is the adapter-disabled model, as TRL's
    assert type(ctx).__name__ == "_GeneratorContextManager"
    _step_logs_channels(trainer)


@pytest.mark.slow
@pytest.mark.parametrize("peft_kw", [{"target_modules": ["q_proj", "v_proj"]},
                                     {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}])
def test_liger_with_peft_builds_and_steps(tiny_model_and_tokenizer, tmp_path, fake_liger, peft_kw):
    """TRL's test_liger_kernel_with_peft_{non_lm_head_target,modules_to_save_lm_head}_allowed, with our channels."""
    peft = pytest.importorskip("peft")
    trainer = _trainer(tiny_model_and_tokenizer, tmp_path, use_liger_kernel=True,
                       peft_config=peft.LoraConfig(r=4, lora_alpha=8, **peft_kw))
    _step_logs_channels(trainer)


# ---------------------------------------------------------------------------- vLLM


class _FakeVLLM:
    """TRL's ``VLLMGeneration`` interface: samples with the policy itself and returns its token log-probs."""

    def __init__(self, *, model, processing_class, max_completion_length, **kwargs):
        self.model, self.tok, self.max_new = model, processing_class, max_completion_length
        self.vllm_client = types.SimpleNamespace(
            get_server_info=lambda: {"model_config": {"logprobs_mode": "processed_logprobs"}})
        self.synced = 0

    def sync_weights(self):
        self.synced += 1

    def generate(self, prompts, images, num_generations, profiler=None):
        completions, logprobs = [], []
        with torch.no_grad():
            for ids in prompts:
                x = torch.tensor([ids])
                out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=self.max_new,
                                          do_sample=True, eos_token_id=self.tok.eos_token_id)
                new = out[0, len(ids):].tolist()
                logits = self.model(input_ids=out).logits[0, len(ids) - 1:-1].float()
                lp = torch.log_softmax(logits, -1).gather(-1, out[0, len(ids):, None])[:, 0]
                completions.append(new)
                logprobs.append([[v] for v in lp.tolist()])
        return prompts, completions, logprobs, None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_vllm_generation_feeds_the_channels(tiny_model_and_tokenizer, tmp_path, monkeypatch, mode):
    monkeypatch.setattr("trl.trainer.grpo_trainer.VLLMGeneration", _FakeVLLM)
    trainer = _trainer(tiny_model_and_tokenizer, tmp_path, use_vllm=True, vllm_mode=mode)
    logged = _step_logs_channels(trainer)
    assert trainer.vllm_generation.synced >= 1 and "sampling/importance_sampling_ratio/mean" in logged


@pytest.mark.slow
def test_bf16_model_with_cast_lm_head_to_fp32(tiny_model_and_tokenizer, tmp_path):
    model, tok = tiny_model_and_tokenizer
    trainer = _trainer((copy.deepcopy(model).to(torch.bfloat16), tok), tmp_path, cast_lm_head_to_fp32=True)
    assert trainer.model.lm_head.weight.dtype == torch.float32
    _step_logs_channels(trainer)


# ---------------------------------------------------------------------------- multi-step / buffered generations


@pytest.mark.slow
def test_num_iterations_and_steps_per_generation(tiny_model_and_tokenizer, tmp_path):
    trainer = _trainer(tiny_model_and_tokenizer, tmp_path, rows=_rows(8), num_iterations=2, steps_per_generation=2,
                       gradient_accumulation_steps=2, max_steps=2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all("composer/jsd" in h and "composer/dpo" in h for h in logs)
    batch = trainer._buffered_inputs[0]  # the buffered generation batch, split with the channel keys
    assert "old_per_token_logps" in batch and batch["sdpo_loss_mask"].shape[0] == batch["completion_ids"].shape[0]


@pytest.mark.slow
def test_remove_unused_columns_keeps_the_channel_columns(tiny_model_and_tokenizer, tmp_path):
    _step_logs_channels(_trainer(tiny_model_and_tokenizer, tmp_path, remove_unused_columns=True))


# ---------------------------------------------------------------------------- custom rollouts, tools, environments


def _env_rollout(prompts, trainer):
    """A rollout_func: the model's reply, an environment's output (env_mask 0), then the model again."""
    tok = trainer.processing_class
    prompt_ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
                  for p in prompts]
    said, env = tok.encode("ls", add_special_tokens=False), tok.encode(" [env: a.txt] ", add_special_tokens=False)
    tail = tok.encode("done", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    completion = said + env + tail
    mask = [1] * len(said) + [0] * len(env) + [1] * len(tail)
    return {"prompt_ids": prompt_ids, "completion_ids": [completion] * len(prompts),
            "logprobs": [[0.0] * len(completion)] * len(prompts), "env_mask": [mask] * len(prompts)}


@pytest.mark.slow
def test_rollout_func_env_mask_is_left_out_of_channel_two(tiny_model_and_tokenizer, tmp_path):
    trainer = _trainer(tiny_model_and_tokenizer, tmp_path, rollout_func=_env_rollout, max_completion_length=16)
    trainer.model.train()
    out = trainer._generate_and_score_completions(_rows())
    own = out["completion_mask"] * out["tool_mask"]
    for i in range(own.shape[0]):
        m = out["sdpo_loss_mask"][i].bool()
        n = int(out["completion_mask"][i].sum())
        assert out["ctx_teacher_input_ids"][i][m].tolist() == out["completion_ids"][i, :n][own[i, :n].bool()].tolist()
    assert int(out["sdpo_loss_mask"].sum()) == int(own.sum()) < int(out["completion_mask"].sum())
    _step_logs_channels(trainer)


def ls(path: str) -> str:
    """List the files of a folder.

    Args:
        path: The folder.
    """
    return "a.txt b.txt"


def _tool_call_rollout(prompts, trainer):
    """A rollout_func whose first turn calls the ``ls`` tool; TRL runs it and generates the next turn."""
    tok = trainer.processing_class
    prompt_ids = [tok.apply_chat_template(p, tools=[ls], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for p in prompts]
    call = tok.encode('<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>', add_special_tokens=False)
    call.append(tok.convert_tokens_to_ids("<|im_end|>"))
    return {"prompt_ids": prompt_ids, "completion_ids": [call] * len(prompts), "logprobs": None}  # (trl: None with HF generation)


@pytest.mark.slow
def test_tool_calls_run_and_tool_results_are_left_out_of_channel_two(tiny_model_and_tokenizer, tmp_path):
    tok = _tool_tokenizer(tiny_model_and_tokenizer[1])
    trainer = _trainer(tiny_model_and_tokenizer, tmp_path, tok=tok, tools=[ls], rollout_func=_tool_call_rollout,
                       max_completion_length=96, max_tool_calling_iterations=1)
    trainer.model.train()
    out = trainer._generate_and_score_completions(_rows())
    assert "tool_mask" in out and int((out["completion_mask"] * (1 - out["tool_mask"])).sum()) > 0  # a tool result
    own = out["completion_mask"] * out["tool_mask"]
    assert int(out["sdpo_loss_mask"].sum()) == int(own.sum())
    teacher = tok.decode(out["ctx_teacher_input_ids"][0])
    assert '"name": "ls"' in teacher and HINT in teacher  # rendered with the tool schema, then the hint
    _step_logs_channels(trainer)


class _FolderEnv:
    """An environment_factory environment: ``reset`` returns the observation TRL appends to the prompt."""

    def reset(self, **kwargs) -> str:
        return " The folder holds a.txt."

    def read(self, name: str) -> str:
        """Read a file.

        Args:
            name: The file name.
        """
        return "hello"


@pytest.mark.slow
def test_environment_observation_reaches_the_teacher_prompt(tiny_model_and_tokenizer, tmp_path):
    tok = _tool_tokenizer(tiny_model_and_tokenizer[1])
    trainer = _trainer(tiny_model_and_tokenizer, tmp_path, tok=tok, environment_factory=_FolderEnv,
                       max_completion_length=8, max_tool_calling_iterations=1)
    trainer.model.train()
    out = trainer._generate_and_score_completions(_rows())
    assert "The folder holds a.txt." in tok.decode(out["ctx_teacher_input_ids"][0])
    assert "The folder holds a.txt." in tok.decode(out["dpo_chosen_input_ids"][0])
    _step_logs_channels(trainer)


# ---------------------------------------------------------------------------- refused: images


def test_images_with_a_channel_on_are_refused(tiny_model_and_tokenizer, tmp_path, monkeypatch):
    trainer = _trainer(tiny_model_and_tokenizer, tmp_path)
    monkeypatch.setattr("trl.GRPOTrainer._generate_and_score_completions",
                        lambda self, inputs: {"pixel_values": torch.zeros(1), "completion_ids": torch.zeros(4, 1)})
    with pytest.raises(ValueError, match="batch has images.*alpha_sdpo=0 and beta_replay=0"):
        trainer._generate_and_score_completions(_rows())

"""StudentTrainerCore and run_plain with the tiny model on hand-made trace states.

A wrapper environment forces error sites on half the samples (a random tiny model never writes a
well-formed tool call by itself), so all three channels carry signal: GRPO on rewards that vary,
self-distillation at the hinted error sites, and trace-replay DPO on one pair.
"""

from __future__ import annotations

import json

import pytest
import torch

from composer_replication.engine import (
    LossConfig,
    OptimConfig,
    RolloutConfig,
    StudentConfig,
    StudentTrainerCore,
    TrainingData,
    build_training_data,
    run_plain,
)
from composer_replication.engine.checkpoint import latest_checkpoint, load_checkpoint

SYSTEM = {"role": "system", "content": "You are a coding agent."}
STATES = [
    {
        "state_id": "s1",
        "messages": [SYSTEM, {"role": "user", "content": "Show me a.py"}],
        "student_action": '[TOOL_USE] name=Bash input={"command": "cat a.py"}',
        "tools": ["Read", "Bash"],
    },
    {
        "state_id": "s2",
        "messages": [SYSTEM, {"role": "user", "content": "List the files"}],
        "student_action": '[TOOL_USE] name=Bash input={"command": "ls"}',
        "tools": ["Bash"],
    },
    {
        "state_id": "s3",
        "messages": [SYSTEM, {"role": "user", "content": "Say hi"}],
        "student_action": "hi",
        "tools": [],
    },
]
PAIRS = [
    {
        "state_id": "s1",
        "state_messages": STATES[0]["messages"],
        "chosen": '[TOOL_USE] name=Read input={"file_path": "a.py"}',
        "rejected": '[TOOL_USE] name=Bash input={"command": "cat a.py"}',
        "n_teachers_agreeing": 2,
    }
]


class ForcedErrors:
    """Next-action scoring, plus a length-dependent bonus (rewards vary within a group) and a forced
    ``tool_not_found`` error on even-length samples (error sites -> hints -> channel 2)."""

    name = "forced_errors"

    def __init__(self, inner):
        self.inner = inner

    def prompts(self):
        return self.inner.prompts()

    def score(self, prompt, action_text):
        from composer_replication.rollout import Score

        base = self.inner.score(prompt, action_text)
        reward = base.reward + 0.1 * (len(action_text) % 5)
        if len(action_text) % 2 == 0:
            meta = {"error_message": "Tool 'Edit' is not available.", "tool_name": "Edit",
                    "available_tools": list(prompt.tools)}
            return Score(reward, error_kind="tool_not_found", error_meta=meta)
        return Score(reward)


def make_data() -> TrainingData:
    data = build_training_data("next_action", states=STATES, pairs=PAIRS)
    data.environment = ForcedErrors(data.environment)
    return data


def make_config(**loss) -> StudentConfig:
    return StudentConfig(
        model="tiny", device="cpu", seed=3, num_steps=4,
        optim=OptimConfig(lr=1e-3, warmup_steps=1, scheduler="cosine"),
        loss=LossConfig(alpha_sdpo=1.0, beta_replay=1.0, kl_beta=0.04, **loss),
        rollout=RolloutConfig(prompts_per_step=2, num_generations=2, max_new_tokens=6, pairs_per_step=1),
    )


def params(core) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in core.model.named_parameters()}


@pytest.fixture(scope="module")
def straight():
    """4 uninterrupted steps (TAID on): initial/after-2/after-4 parameters and every step's metrics."""
    core = StudentTrainerCore(make_config(sdpo_wrapper="taid"), data=make_data())
    out = {"p0": params(core), "metrics": []}
    for step in range(4):
        out["metrics"].append(core.train_step(step))
        if step == 1:
            out["p2"] = params(core)
    out["p4"] = params(core)
    out["core"] = core
    return out


@pytest.mark.slow
def test_two_steps_change_every_parameter(straight):
    unchanged = [n for n, p in straight["p0"].items() if torch.equal(p, straight["p2"][n])]
    assert not unchanged, f"parameters not updated by two steps: {unchanged}"
    core = straight["core"]
    assert all(not p.requires_grad for p in core.reference.parameters()) and not core.reference.training
    assert core.optimizer.defaults["fused"] is True  # every parameter on the CPU: the fused AdamW kernel
    for n, p in core.reference.named_parameters():  # the reference stays at the initial weights
        assert torch.equal(p, straight["p0"][n]), n


@pytest.mark.slow
def test_metrics_name_every_channel_and_all_three_fire(straight):
    metrics = straight["metrics"]
    for m in metrics:
        for key in ("loss/grpo", "loss/taid", "loss/dpo", "loss/total", "reward/mean", "reward/std",
                    "rollout/num_error_sites", "replay/num_pairs", "perf/tokens", "perf/tokens_per_s", "loss/lr",
                    "loss/grad_norm", "loss/taid/t", "perf/step_time_s"):
            assert key in m, key
        assert "loss/lm_ce" not in m  # rollouts carry old log-probs: channel 1 is GRPO, never mislabelled
        assert "loss/jsd" not in m and "sdpo_jsd" not in m  # TAID ran: channel 2 is named for it
        assert all(k.split("/")[0] in ("loss", "reward", "rollout", "replay", "perf") for k in m), sorted(m)
        assert all(isinstance(v, float) for v in m.values())
    for channel in ("loss/grpo", "loss/taid", "loss/dpo"):
        assert any(m[channel] != 0.0 for m in metrics), f"channel {channel} never fired"
    assert all(m["rollout/num_error_sites"] > 0 and m["rollout/num_hinted"] > 0 and m["replay/num_pairs"] == 1.0
               for m in metrics)
    # warm-up then cosine: lr rises to the peak at step 1, then decays
    lrs = [m["loss/lr"] for m in metrics]
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3) and lrs[3] < lrs[2] < lrs[1]
    taid = [m["loss/taid/t"] for m in metrics]
    assert taid[0] == pytest.approx(0.4) and all(b >= a for a, b in zip(taid, taid[1:]))


@pytest.mark.slow
def test_resume_in_a_new_core_is_bit_identical(straight):
    first = StudentTrainerCore(make_config(sdpo_wrapper="taid"), data=make_data())
    first.train_step(0)
    first.train_step(1)
    state = first.state_dict()
    del first
    resumed = StudentTrainerCore(make_config(sdpo_wrapper="taid"), data=make_data())
    resumed.load_state_dict(state)
    assert resumed.step == 2
    m2 = resumed.train_step(2)
    m3 = resumed.train_step(3)
    assert m2["loss/total"] == straight["metrics"][2]["loss/total"]
    assert m3["loss/taid/t"] == straight["metrics"][3]["loss/taid/t"]
    for n, p in resumed.model.named_parameters():
        assert torch.equal(p, straight["p4"][n]), f"{n} differs after resume"


@pytest.mark.slow
def test_run_plain_crash_and_resume_matches_and_keeps_metrics_unique(tmp_path, straight):
    cfg = make_config(sdpo_wrapper="taid")

    def crash_at_2(step, metrics):
        if step == 2:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        run_plain(cfg, make_data(), tmp_path, checkpoint_every=2, on_step=crash_at_2, evaluate=False)
    assert latest_checkpoint(tmp_path).name == "step_000002"
    summary = run_plain(cfg, make_data(), tmp_path, checkpoint_every=2, resume=True, evaluate=True)
    assert summary["start_step"] == 2 and summary["eval_start"] is None  # a resumed run does not re-evaluate
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss/total" in r] == [0, 1, 2, 3]  # every step once
    assert [r["step"] for r in rows if "eval/mean" in r] == [4]  # the final evaluation row
    final = load_checkpoint(latest_checkpoint(tmp_path))
    assert final["step"] == 4
    for n, p in straight["p4"].items():
        assert torch.equal(final["model"][n], p), n
    assert (tmp_path / "config.yaml").is_file() and list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert json.loads((tmp_path / "pairs.jsonl").read_text())["state_id"] == "s1"
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["eval_end"]["eval/num_scored"] == 2.0 and 0.0 <= written["eval_end"]["eval/mean"]


@pytest.mark.slow
def test_pairs_only_falls_back_to_lm_ce_and_simpo():
    data = TrainingData(environment=ForcedErrors(None), prompts=[], pairs=PAIRS)
    cfg = make_config(dpo_variant="simpo")
    core = StudentTrainerCore(cfg, data=data)
    m = core.train_step(0)
    assert m["loss/lm_ce"] > 0 and "loss/grpo" not in m and m["loss/simpo"] != 0.0 and "loss/dpo" not in m
    assert "rollout/num_samples" not in m and m["replay/num_pairs"] == 1.0


@pytest.mark.slow
def test_weights_round_trip_evaluate_and_errors(straight):
    core = straight["core"]
    weights = core.get_weights()
    assert all(w.device.type == "cpu" for w in weights.values())
    name = "model.embed_tokens.weight"
    assert weights["lm_head.weight"] is weights[name]  # tied: one tensor under both names
    weights[name] += 1.0  # a clone: the model is untouched
    assert not torch.equal(core.model.state_dict()[name], weights[name])
    core.set_weights(weights)
    assert torch.equal(core.model.state_dict()[name], weights[name])
    assert torch.equal(core.model.lm_head.weight, weights[name])
    untied = dict(weights)
    untied["lm_head.weight"] = weights[name] + 1.0
    with pytest.raises(ValueError, match="one tied tensor"):
        core.set_weights(untied)
    with pytest.raises(ValueError, match="missing keys"):
        core.set_weights({name: weights[name]})
    bad = dict(weights)
    bad[name] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape mismatch"):
        core.set_weights(bad)
    ev = core.evaluate()
    assert ev["eval/num_scored"] == 2.0 and set(ev) == {"eval/mean", "eval/std", "eval/error_rate",
                                                          "eval/num_scored", "eval/agreement", "eval/agreement_partial",
                                                          "eval/tool_choice_rate", "eval/well_formed_call_rate"}
    assert str(core.evaluate(greedy=True)) == str(ev)  # greedy is deterministic (str: NaN equals NaN)
    one = core.data.prompts[:1]
    sampled = core.evaluate(one, greedy=False)
    assert sampled["eval/num_scored"] == 1.0 and str(sampled) == str(core.evaluate(one, greedy=False))  # seeded
    with pytest.raises(ValueError, match="missing keys"):
        core.load_state_dict({"step": 1})
    with pytest.raises(ValueError, match="'step' must be >= 0"):
        core.train_step(-1)


def test_constructor_rejects_bad_rank():
    with pytest.raises(ValueError, match="need 0 <= rank < world_size"):
        StudentTrainerCore(make_config(), data=make_data(), rank=2, world_size=2)


def test_build_training_data_errors_and_held_out_prompts():
    with pytest.raises(ValueError, match="needs trace states"):
        build_training_data("next_action", states=[])
    with pytest.raises(ValueError, match="'rollout.environment' must be"):
        build_training_data("chess", states=STATES)
    data = build_training_data("next_action", states=STATES, pairs=PAIRS, num_eval_prompts=1, seed=0)
    assert len(data.prompts) == 2 and len(data.eval_prompts) == 1
    ids = {p.prompt_id for p in data.prompts} | {p.prompt_id for p in data.eval_prompts}
    assert ids == {"s1", "s2", "s3"}
    s1 = next(p for p in data.prompts + data.eval_prompts if p.prompt_id == "s1")
    assert s1.reference == PAIRS[0]["chosen"]  # the consensus action is the reference


def test_mixed_environment_routes_by_prompt_id_and_rejects_collisions():
    from composer_replication.engine.data import MixedEnvironment
    from composer_replication.rollout import Prompt, Score

    class Fixed:
        def __init__(self, name, ids, reward):
            self.name, self.ids, self.reward = name, ids, reward

        def prompts(self):
            return [Prompt(prompt_id=i, messages=[{"role": "user", "content": i}]) for i in self.ids]

        def score(self, prompt, action_text):
            return Score(self.reward)

    mixed = MixedEnvironment([Fixed("a", ["x", "y"], 0.0), Fixed("b", ["z"], 1.0)])
    prompts = mixed.prompts()
    assert [p.prompt_id for p in prompts] == ["x", "y", "z"]
    assert [mixed.score(p, "").reward for p in prompts] == [0.0, 0.0, 1.0]
    with pytest.raises(KeyError, match="no environment offers prompt_id 'w'"):
        mixed.score(Prompt(prompt_id="w", messages=[{"role": "user", "content": "w"}]), "")
    with pytest.raises(ValueError, match="prompt_id 'x' is offered by both 'a' and 'b'"):
        MixedEnvironment([Fixed("a", ["x"], 0.0), Fixed("b", ["x"], 1.0)])


def test_build_training_data_python_tasks_and_mixed():
    tasks = build_training_data("python_tasks")
    assert tasks.prompts and tasks.environment.name == "python_tasks"
    mixed = build_training_data("mixed", states=STATES, pairs=PAIRS)
    assert len(mixed.prompts) == len(tasks.prompts) + len(STATES) and mixed.environment.name == "mixed"


def test_lr_lambda_shapes():
    from composer_replication.engine.config import build_lr_lambda

    const = build_lr_lambda(warmup_steps=2, num_steps=10, scheduler="constant")
    assert [const(s) for s in range(4)] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])
    lin = build_lr_lambda(warmup_steps=0, num_steps=4, scheduler="linear")
    assert [lin(s) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    cos = build_lr_lambda(warmup_steps=0, num_steps=2, scheduler="cosine")
    assert [cos(s) for s in range(3)] == pytest.approx([1.0, 0.5, 0.0], abs=1e-12)

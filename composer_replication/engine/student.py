"""The single-process student trainer: rollouts -> rewards -> hints -> three-channel loss -> AdamW step.

:class:`StudentTrainerCore` is the whole training engine of one replica, with no Monarch in it.
The Monarch ``StudentTrainer`` actor (``meshes/trainer.py``) wraps each method in an endpoint, and
``engine.drive`` runs its steps (``run_plain`` in a plain process). One step (:meth:`StudentTrainerCore.train_step`):

1. the prompts of ``(seed, step, rank)`` (``engine.data.prompts_for_step``);
2. ``rollout.sample_rollouts``: G samples per prompt, seeded from ``(seed, step, rank)``;
3. ``environment.score`` per sample (reward, error kind) -> ``rollout.assemble_batch``: channel 1
   (GRPO keys) and channel 2 (hinted teacher sequences at error sites);
4. the step's channel-3 pairs, tokenized, with the frozen reference's summed log-probs (no grad);
5. ``losses.compose_loss`` (per micro-batch, ``engine.accumulate``) -> backward -> clip -> AdamW -> LR
   scheduler -> TAID ``update_t``.

Everything random is derived from ``(seed, step, rank)``, so ``state_dict`` (model, optimizer,
scheduler, TAID, RNG, step) is enough for a resumed run to reproduce an uninterrupted one exactly.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

import torch

from composer_replication.batching import BatchingStats, pad_id, preference_batch, tokenize_pairs
from composer_replication.engine.accumulate import channel_sizes, split_batch
from composer_replication.engine.config import StudentConfig, resolve_device, resolve_dtype
from composer_replication.engine.data import (
    TrainingData,
    derive_seed,
    pair_indices_for_step,
    prompts_for_step,
)
from composer_replication.engine.evaluate import greedy_texts, next_action_stats, reward_stats
from composer_replication.engine.metrics import combine_loss_metrics, count_tokens, loss_metrics
from composer_replication.engine.perf import PhaseTimer
from composer_replication.engine.reference import ReferenceLogprobCache
from composer_replication.engine.refresh import PairRefresher, tokenize_live
from composer_replication.engine.schedule import build_lr_lambda
from composer_replication.engine.weights import cpu_weights, load_weights

__all__ = ["StudentTrainerCore"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1


class StudentTrainerCore:
    """One student replica: model, frozen reference, AdamW, LR schedule, TAID schedule, data.

    Args:
        config: the student's configuration.
        data: environment, prompts and pairs (see :class:`~composer_replication.engine.data.TrainingData`).
        rank: this replica's global rank (changes its data and sampling seeds).
        world_size: number of replicas (reported; data is drawn per rank).
        local_rank: GPU index for ``device="auto"`` (default: ``LOCAL_RANK`` env, else 0).

    Attributes:
        model: the trained causal LM (train mode). ``reference``: its frozen initial copy (eval, no grad).
        ``reference_logprobs``: a :class:`ReferenceLogprobCache` over ``reference`` (channel-3 reference log-probs).
        tokenizer, optimizer (AdamW), scheduler (``LambdaLR``), taid (``TAIDScheduler`` or ``None``),
        device, step (optimizer steps completed).

    Raises:
        ValueError: ``rank``/``world_size`` out of range, or a bad config value (naming the key).
    """

    def __init__(
        self,
        config: StudentConfig,
        *,
        data: TrainingData,
        rank: int = 0,
        world_size: int = 1,
        local_rank: int | None = None,
    ) -> None:
        from composer_replication.models import load_model_and_tokenizer

        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.config = config
        self.data = data
        self.rank = rank
        self.world_size = world_size
        self.device = resolve_device(config.device, local_rank=local_rank)
        self.dtype = resolve_dtype(config.dtype)
        self.model, self.tokenizer = load_model_and_tokenizer(
            config.model, seed=config.seed, dtype=self.dtype, device=self.device
        )
        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.reference_logprobs = ReferenceLogprobCache(self.reference, chunk_size=config.loss.chunk_size)
        self.batching_stats = BatchingStats()
        self.tokenized_pairs = tokenize_pairs(self.tokenizer, data.pairs, max_seq_len=config.max_seq_len,
                                              over_length=config.over_length, stats=self.batching_stats)
        r = config.rollout  # the student side of recorded pairs is re-sampled every r.pair_refresh_every steps
        self.pair_refresher = PairRefresher(
            data.pairs, every=r.pair_refresh_every, seed=config.seed, rank=rank, max_new_tokens=r.max_new_tokens,
            temperature=r.temperature, top_p=r.top_p,
            draw=lambda t: pair_indices_for_step(data, t, rank=rank, pairs_per_step=r.pairs_per_step, seed=config.seed),
        )
        self.model.train()
        o = config.optim
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
            weight_decay=o.weight_decay,
            # one fused kernel over all parameters: 5x faster than the per-tensor loop on CPU (0.12 s vs
            # 0.64 s per step for the 135M default), same update up to float rounding
            fused=all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params) or None,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            build_lr_lambda(warmup_steps=o.warmup_steps, num_steps=config.num_steps, scheduler=o.scheduler),
        )
        self.taid = None
        if config.loss.sdpo_wrapper == "taid":
            from composer_replication.losses import TAIDScheduler

            L = config.loss
            self.taid = TAIDScheduler(
                config.num_steps, t_start=L.taid_t_start, t_end=L.taid_t_end, alpha=L.taid_alpha, beta=L.taid_beta
            )
        self.step = 0
        self.timer = PhaseTimer()

    # ------------------------------------------------------------------ one step

    def train_step(self, step: int) -> dict[str, float]:
        """Run optimizer step ``step`` (0-based) and return its metrics.

        Metrics (floats), in the project's one metrics scheme (``docs/recipes.md``): ``loss/*`` (each channel under the name
        of the loss that ran, its own metrics, ``loss/grad_norm``, ``loss/lr``), ``reward/*`` (the step's
        rollouts: mean, population std, error rate), ``rollout/*`` (``rollout.rollout_stats``), ``replay/*``
        (pairs trained on, over-length drops) and ``perf/*`` (tokens, times).

        With no prompts (pairs only), channel 1 falls back to LM cross-entropy on the chosen responses.

        Raises:
            ValueError: ``step < 0``, or the step has neither prompts nor pairs.
            FloatingPointError: the total loss is not finite (the weights are left untouched).
        """
        if step < 0:
            raise ValueError(f"'step' must be >= 0, got {step}")
        if step != self.step:
            log.warning("train_step(%d) called after %d completed steps; the LR schedule follows calls", step,
                        self.step)
        t0 = time.perf_counter()
        self.timer = PhaseTimer()
        batch, info = self._build_batch(step)
        t_sampled = time.perf_counter()
        metrics = self._optimize(batch, step)
        metrics.update(info)
        metrics.update(self.timer.metrics())
        elapsed = time.perf_counter() - t0
        metrics["perf/sample_time_s"] = t_sampled - t0
        metrics["perf/step_time_s"] = elapsed
        metrics["perf/tokens_per_s"] = metrics["perf/tokens"] / elapsed if elapsed > 0 else 0.0
        self.step = step + 1
        return metrics

    def _build_batch(self, step: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Channels 1+2 from rollouts, channel 3 from pairs; all tensors on ``self.device``."""
        cfg, r = self.config, self.config.rollout
        self._refresh_pairs(step)
        prompts = prompts_for_step(self.data, step, rank=self.rank, prompts_per_step=r.prompts_per_step,
                                   seed=cfg.seed)
        batch: dict[str, torch.Tensor] = {}
        info: dict[str, float] = reward_stats([], prefix="reward/")
        if prompts:
            batch, rinfo = self._rollout_batch(prompts, seed=derive_seed(cfg.seed, step, self.rank))
            info.update(rinfo)
        drawn = pair_indices_for_step(self.data, step, rank=self.rank, pairs_per_step=r.pairs_per_step, seed=cfg.seed)
        pairs = [self.tokenized_pairs[i] for i in drawn if self.tokenized_pairs[i] is not None]
        info["replay/num_pairs"] = float(len(pairs))
        info.update(self.pair_refresher.metrics(step))
        info.update(self.batching_stats.as_metrics(prefix="replay/"))
        replay = preference_batch(pairs, pad_id(self.tokenizer), device=self.device)  # tokenized once per run
        if replay:
            if cfg.loss.dpo_variant == "dpo":
                with self.timer.phase("reference"):
                    self.reference_logprobs.fill(replay)  # one reference pass per distinct sequence
            batch.update(replay)
            if "input_ids" not in batch:  # pairs only: channel 1 is LM cross-entropy on the chosen side
                for key in ("input_ids", "attention_mask", "response_mask"):
                    batch[key] = replay[f"dpo_chosen_{key}"]
        if not batch:
            raise ValueError(
                f"step {step} has neither prompts nor pairs; give TrainingData prompts, or pairs with "
                "rollout.pairs_per_step > 0"
            )
        return batch, info

    def _refresh_pairs(self, step: int) -> None:
        """On refresh steps, re-sample the student side of the recorded pairs that the next
        ``rollout.pair_refresh_every`` steps draw, from the current weights (``engine.refresh``)."""
        self._set_live_pairs(self.pair_refresher.maybe_refresh(step, self.model, self.tokenizer))

    def _set_live_pairs(self, live: list[Any] | None) -> None:
        """Tokenize refreshed pairs once (``None``: nothing changed); dropped pairs are never drawn."""
        if live is not None:
            self.batching_stats = BatchingStats()
            self.tokenized_pairs = tokenize_live(self.tokenizer, live, max_seq_len=self.config.max_seq_len,
                                                 over_length=self.config.over_length, stats=self.batching_stats)

    def _rollout_batch(self, prompts: list[Any], *, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        from composer_replication import rollout as R

        cfg, r = self.config, self.config.rollout
        rollouts = R.sample_rollouts(
            self.model, self.tokenizer, prompts, num_generations=r.num_generations,
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, seed=seed,
            chunk_size=cfg.loss.chunk_size, old_logprobs=r.old_logprob_pass,
        )
        for phase, seconds in rollouts.timings.items():
            self.timer.add(phase, seconds)
        with self.timer.phase("score"):
            scores = R.score_texts(self.data.environment, prompts, rollouts.prompt_index, rollouts.texts)
        with self.timer.phase("assemble"):  # channel 1 tensors and the hinted-teacher rows of channel 2
            batch = R.assemble_batch(self.tokenizer, rollouts, scores, prompts=prompts,
                                     scale_rewards=cfg.loss.scale_rewards, enable_sdpo=cfg.loss.alpha_sdpo > 0)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        if cfg.loss.kl_beta > 0:
            from composer_replication.losses import token_logprobs_for

            with torch.no_grad(), self.timer.phase("reference"):
                ref = token_logprobs_for(self.reference, batch["input_ids"], batch["attention_mask"],
                                         response_mask=batch["response_mask"], chunk_size=cfg.loss.chunk_size)
            batch["ref_logprobs"] = ref.float()  # [B, T], 0 off the response
        info = reward_stats(scores, prefix="reward/")
        info.update(R.rollout_stats(rollouts, scores, batch))
        return batch, info

    def _optimize(self, batch: dict[str, torch.Tensor], step: int) -> dict[str, float]:

        L, o = self.config.loss, self.config.optim
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        micro_batches = split_batch(batch, o.grad_accum_steps)
        if len(micro_batches) == 1:  # the whole batch in one pass
            with self.timer.phase("loss_forward"):
                comps = self._loss(batch)
            with self.timer.phase("loss_backward"):
                self._backward(comps.total, comps, step)
            metrics, distill = loss_metrics(comps, L), comps.sdpo_jsd.detach()
        else:  # each channel weighted by the micro-batch's share of its denominator (engine.accumulate)
            sizes = [channel_sizes(m, loss_type=L.loss_type) for m in micro_batches]
            totals = [sum(s[c] for s in sizes) for c in range(3)]
            parts, distill = [], torch.zeros(())
            for micro, size in zip(micro_batches, sizes):
                with self.timer.phase("loss_forward"):
                    comps = self._loss(micro)
                w = [size[c] / totals[c] if totals[c] else 0.0 for c in range(3)]
                scaled = w[0] * comps.lm_ce + L.alpha_sdpo * w[1] * comps.sdpo_jsd + L.beta_replay * w[2] * comps.trace_replay_dpo
                with self.timer.phase("loss_backward"):
                    self._backward(scaled, comps, step)
                distill = distill + w[1] * comps.sdpo_jsd.detach().cpu()
                parts.append((loss_metrics(comps, L), w, float(scaled.detach())))
            metrics = combine_loss_metrics(parts)
        with self.timer.phase("optimizer"):
            params = [p for p in self.model.parameters() if p.grad is not None]
            max_norm = o.max_grad_norm if o.max_grad_norm > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros(())
            self.optimizer.step()
            self.scheduler.step()
        if self.taid is not None:
            metrics["loss/taid/t"] = self.taid.t  # the t this step's loss used
            if "ctx_teacher_input_ids" in batch:
                self.taid.update_t(distill, global_step=step)
        metrics["loss/lr"] = lr
        metrics["loss/grad_norm"] = float(grad_norm)
        metrics["perf/tokens"] = float(count_tokens(batch))
        return metrics

    def _loss(self, batch: dict[str, torch.Tensor]) -> Any:
        """``compose_loss`` of one (micro-)batch with this trainer's loss config."""
        from composer_replication.losses import compose_loss

        return compose_loss(self.model, batch, self.config.loss, taid_t=self.taid.t if self.taid is not None else None,
                            max_completion_length=self.config.rollout.max_new_tokens)

    @staticmethod
    def _backward(loss: torch.Tensor, comps: Any, step: int) -> None:
        """``loss.backward()`` after checking it is finite (the weights are left untouched otherwise)."""
        if not torch.isfinite(loss.detach()):
            raise FloatingPointError(
                f"step {step}: the total loss is {float(loss)} ({comps.metrics()}); lower optim.lr or check the batch"
            )
        loss.backward()

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, prompts: list[Any] | None = None, *, greedy: bool = True) -> dict[str, float]:
        """Score one answer per prompt (greedy by default) on the held-out or a fixed set of prompts.

        Args:
            prompts: defaults to ``data.eval_prompts`` (held-out sessions, scored by
                ``data.eval_environment`` against their recorded actions), else the first
                ``rollout.prompts_per_step`` training prompts (a fixed set, so evaluations compare across steps).
            greedy: greedy decoding (batched); ``False`` samples one answer at the rollout temperature with a
                fixed seed. Answers have at most ``data.eval_max_new_tokens`` (else ``rollout.max_new_tokens``) tokens.

        Returns:
            ``eval/mean``, ``eval/std``, ``eval/error_rate``, ``eval/num_scored`` (rewards of the answers) and,
            for next-action prompts, ``eval/agreement``, ``eval/agreement_partial``, ``eval/tool_choice_rate``
            and ``eval/well_formed_call_rate`` (``engine.evaluate.next_action_stats``).
        """
        from composer_replication import rollout as R

        if prompts is None:
            prompts = self.data.eval_prompts or self.data.prompts[: self.config.rollout.prompts_per_step]
        if not prompts:
            return {**reward_stats([], prefix="eval/"), **next_action_stats([], [], [], prefix="eval/")}
        r = self.config.rollout
        max_new = self.data.eval_max_new_tokens or r.max_new_tokens
        if greedy:
            texts = greedy_texts(self.model, self.tokenizer, prompts, max_new_tokens=max_new)
            index = list(range(len(prompts)))
        else:
            rollouts = R.sample_rollouts(
                self.model, self.tokenizer, prompts, num_generations=1, max_new_tokens=max_new,
                temperature=r.temperature, top_p=r.top_p, seed=derive_seed(self.config.seed, 0, self.rank, "eval"),
                chunk_size=self.config.loss.chunk_size,
            )
            texts, index = rollouts.texts, rollouts.prompt_index
        scores = R.score_texts(self.data.eval_scorer(prompts), prompts, index, texts)
        answered = [prompts[i] for i in index]
        return {**reward_stats(scores, prefix="eval/"), **next_action_stats(answered, texts, scores, prefix="eval/")}

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: model, optimizer, scheduler, TAID, torch RNG states, step.

        Sampling and data draws use seeds derived from ``(seed, step, rank)`` and no Python
        ``random`` global state, so there is no data cursor to save.

        The frozen reference is not saved: it is re-created from the config (same model, same seed).
        """
        return {
            "version": _STATE_VERSION,
            "step": self.step,
            "model": self.get_weights(),  # CPU clones; tied tensors saved once
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "taid": self.taid.state_dict() if self.taid is not None else None,
            "pair_refresh": self.pair_refresher.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                # only this replica's GPU: get_rng_state_all would open a context on every GPU
                "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (also restores the process's torch CPU/CUDA RNG states).

        Raises:
            ValueError: a key is missing, the version is unknown, or TAID use differs from the config.
        """
        missing = [k for k in ("version", "step", "model", "optimizer", "scheduler", "taid", "rng") if k not in state]
        if missing:
            raise ValueError(f"trainer state is missing keys {missing}; was it written by StudentTrainerCore?")
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"trainer state version {state['version']} is not supported (expected {_STATE_VERSION})")
        if (state["taid"] is None) != (self.taid is None):
            raise ValueError(
                "checkpoint and config disagree on loss.sdpo_wrapper == 'taid'; resume with the run's config.yaml"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.taid is not None:
            self.taid.load_state_dict(state["taid"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        self.step = int(state["step"])
        self._set_live_pairs(self.pair_refresher.load_state_dict(state.get("pair_refresh")))

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The model's weights cloned to CPU (``engine.weights.cpu_weights``), for weight sync / DiLoCo."""
        return cpu_weights(self.model)

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load weights in place (``engine.weights.load_weights``); the optimizer state is kept."""
        load_weights(self.model, weights)

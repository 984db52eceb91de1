"""ComposerReplicationTrainer: TRL's GRPO plus self-distillation at error sites plus trace-replay DPO.

    total = LossConfig.combine(grpo, distill, replay, shares=(1, 1 / GA, 1 / GA))

- Channel 1 is TRL's ``GRPOTrainer._compute_loss`` unchanged (already scaled for gradient accumulation ``GA``).
- Channel 2 (SDPO / OPSD, arXiv 2601.20802 / 2601.18734): the generalized JSD between the policy on the sampled
  completion and the same model, without gradient, on the student's prompt + ``[hint as a user turn]`` + the same
  completion tokens, over the tokens the policy generated (``completion_mask * tool_mask``): the loss library's
  ``self_distillation_loss`` on the rows that have a hint.
- Channel 3 (DPO, arXiv 2305.18290): sigmoid DPO over (the student's prompt, chosen, rejected), reference log-probs
  computed once at generation time from TRL's ``ref_model``, else the adapter-disabled PEFT model (TRL's ``ref``
  adapter when it keeps one), else the policy at sampling time.

Data path: optional dataset columns next to a conversational ``prompt``: ``hint`` (str), ``dpo_chosen`` /
``dpo_rejected`` (str). ``_generate_and_score_completions`` (called by TRL's ``_prepare_inputs``) adds one row per
completion (batch-contract keys, ``docs/collator.md``) so that TRL's shuffling and splitting
(``steps_per_generation``, ``num_iterations``) slice them with the completions; rows without a hint or pair carry
all-zero masks and are skipped. The hinted prompt is rendered by TRL's own ``_tokenize_prompts`` from the prompt TRL
generated from (environment observations, tool schemas and ``chat_template_kwargs`` included). GRPOConfig options:
``docs/integrations.md``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import torch

from composer_replication.batching import pad_id, pad_rows
from composer_replication.chat_format import build_response_ids
from composer_replication.losses import LossConfig, dpo_loss, self_distillation_loss, sequence_logprobs_for

try:
    from accelerate.utils import is_peft_model
    from trl import GRPOTrainer
    from trl.trainer.utils import use_adapter

    _TRL_AVAILABLE = True
except ImportError:  # the module still imports; instantiation raises
    GRPOTrainer = object
    _TRL_AVAILABLE = False

__all__ = ["ComposerReplicationTrainer", "HINT_COLUMN", "DPO_CHOSEN_COLUMN", "DPO_REJECTED_COLUMN"]

HINT_COLUMN = "hint"
DPO_CHOSEN_COLUMN = "dpo_chosen"
DPO_REJECTED_COLUMN = "dpo_rejected"
_INSTALL = "pip install composer-replication[trl]"


def _padded(ids: list[list[int]], masks: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``(ids, attention mask, masks)``, each ``[B, max(len)]`` long, right-padded (at least one column; rows
    may be empty)."""
    rows = ((ids, pad), ([[1] * len(s) for s in ids], 0), (masks, 0))
    return tuple(pad_rows(r, fill)[0].to(device) for r, fill in rows)


def _messages(prompt: Any, row: int, what: str) -> list[dict]:
    if not isinstance(prompt, list) or not all(isinstance(m, Mapping) for m in prompt):
        raise ValueError(f"row {row} has a {what} but its prompt is not conversational (a list of messages); "
                         "channels 2 and 3 need chat prompts so the hint / DPO responses follow the chat template")
    return list(prompt)


def _rows(inputs: dict[str, Any], weight: float, *masks: str) -> torch.Tensor | None:
    """Indices ``[b]`` of the rows where every one of ``masks`` (``[B, T]``) has a 1; None when the channel's
    ``weight`` is 0, a mask is absent, or no row qualifies."""
    if weight == 0 or any(m not in inputs for m in masks):
        return None
    rows = torch.stack([inputs[m].any(-1) for m in masks]).all(0).nonzero().squeeze(-1)
    return rows if rows.numel() else None


class ComposerReplicationTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose loss adds self-distillation (channel 2) and trace-replay DPO (channel 3).

    With ``alpha_sdpo = beta_replay = 0`` it is ``GRPOTrainer``: the same loss, gradients, weights and logged keys.

    Args:
        *args, **kwargs: ``GRPOTrainer``'s (model, reward_funcs, args, train_dataset, processing_class, peft_config,
            tools, rollout_func, environment_factory, ...).
        alpha_sdpo / beta_replay: channel-2 / channel-3 weights (``0`` turns a channel off).
        sdpo_jsd_beta: generalized JSD ``beta`` in ``[0, 1]`` (0 forward KL, 1 reverse KL).
        sdpo_temperature: channel-2 softmax temperature (``> 0``). sdpo_token_clip: clamp of the per-token JSD (``> 0``).
        replay_dpo_beta: DPO ``beta`` (``> 0``).
        loss_chunk_size: rows of logits per chunk in channels 2 and 3 (``losses.logprobs``); ``None`` = full logits.

    Raises:
        ImportError: trl is not installed. ValueError: a weight or hyper-parameter out of range (naming the
        ``loss.`` key), or a batch with images while a channel runs (channels 2 and 3 pass token ids only).
    """

    def __init__(self, *args: Any, alpha_sdpo: float = 0.1, beta_replay: float = 0.05, sdpo_jsd_beta: float = 0.5,
                 sdpo_temperature: float = 1.0, sdpo_token_clip: float | None = None, replay_dpo_beta: float = 0.1,
                 loss_chunk_size: int | None = 1024, **kwargs: Any) -> None:  # fmt: skip
        if not _TRL_AVAILABLE:
            raise ImportError(f"ComposerReplicationTrainer needs trl (a TRL GRPOTrainer subclass): {_INSTALL}")
        self.loss_config = LossConfig(alpha_sdpo=alpha_sdpo, beta_replay=beta_replay, sdpo_jsd_beta=sdpo_jsd_beta,
                                      sdpo_temperature=sdpo_temperature, sdpo_token_clip=sdpo_token_clip,
                                      replay_dpo_beta=replay_dpo_beta, chunk_size=loss_chunk_size)
        self._channel_metrics = {m: defaultdict(list) for m in ("train", "eval")}  # mode -> key -> [device scalars]
        super().__init__(*args, **kwargs)

    def _set_signature_columns_if_needed(self) -> None:
        """Keep the channel columns when ``remove_unused_columns=True``."""
        super()._set_signature_columns_if_needed()
        extra = [c for c in (HINT_COLUMN, DPO_CHOSEN_COLUMN, DPO_REJECTED_COLUMN) if c not in self._signature_columns]
        self._signature_columns = [*self._signature_columns, *extra]

    # --- data path: attach the channel-2/3 tensors to the generation batch (sliced by _prepare_inputs) ---
    def _generate(self, prompts: list):
        """TRL's generation; records the prompts it renders (after environment resets) for the channel rows."""
        self._rollout_prompts = prompts
        return super()._generate(prompts)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's generation and scoring, plus the channel-2/3 tensors built from the dataset columns."""
        output = super()._generate_and_score_completions(inputs)
        hints = [x.get(HINT_COLUMN) for x in inputs]
        pairs = [(x.get(DPO_CHOSEN_COLUMN), x.get(DPO_REJECTED_COLUMN)) for x in inputs]
        distill = self.loss_config.alpha_sdpo > 0 and any(hints)
        replay = self.loss_config.beta_replay > 0 and any(c or r for c, r in pairs)
        if (distill or replay) and "pixel_values" in output:
            raise ValueError("this batch has images, but channels 2 and 3 run the decoder on token ids only and would "
                             "drop them; set alpha_sdpo=0 and beta_replay=0 for multimodal data")
        if distill:
            output.update(self._sdpo_tensors(self._rollout_prompts, hints, output))
        if replay:
            output.update(self._dpo_tensors(pairs, output))
        return output

    def _sdpo_tensors(self, prompts: list[Any], hints: list[Any], output: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Teacher rows ``prompt + [hint] + completion`` ``[B, Tt]``; the mask is 1 on the policy's own tokens
        (``completion_mask * tool_mask``), all zero where there is no hint."""
        device, comp = output["completion_ids"].device, output["completion_mask"]
        own = comp * output["tool_mask"] if "tool_mask" in output else comp
        hinted = [[*_messages(p, i, "hint"), {"role": "user", "content": str(h)}] if h else p
                  for i, (p, h) in enumerate(zip(prompts, hints))]
        teacher_prompts = self._tokenize_prompts(hinted)[0]
        ids, masks = [[] for _ in hints], [[] for _ in hints]  # empty: no hint, or a completion masked out entirely
        for i, hint in enumerate(hints):
            if hint and (n := int(comp[i].sum())):
                prompt = list(teacher_prompts[i])
                ids[i] = prompt + output["completion_ids"][i, :n].tolist()
                masks[i] = [0] * len(prompt) + own[i, :n].tolist()
        keys = ("ctx_teacher_input_ids", "ctx_teacher_attention_mask", "sdpo_loss_mask")
        return dict(zip(keys, _padded(ids, masks, pad_id(self.processing_class), device)))

    def _dpo_tensors(self, pairs: list[tuple[Any, Any]], output: dict[str, Any]) -> dict[str, torch.Tensor]:
        """``student prompt + response`` rows for chosen and rejected ``[B, T*]``, reference log-probs ``[B]``."""
        tok, device = self.processing_class, output["prompt_ids"].device
        rows = [i for i, (c, r) in enumerate(pairs) if c or r]
        for i in rows:
            c, r = pairs[i]
            if not isinstance(c, str) or not isinstance(r, str) or not c or not r:
                raise ValueError(f"row {i}: {DPO_CHOSEN_COLUMN} and {DPO_REJECTED_COLUMN} must both be non-empty "
                                 f"strings, got {c!r:.40} and {r!r:.40}")
        out = {}
        for k, side in enumerate(("chosen", "rejected")):
            seqs, masks = [[] for _ in pairs], [[] for _ in pairs]
            for i in rows:
                prompt = output["prompt_ids"][i][output["prompt_mask"][i].bool()].tolist()
                response = build_response_ids(tok, pairs[i][k])
                seqs[i], masks[i] = prompt + response, [0] * len(prompt) + [1] * len(response)
            keys = (f"dpo_{side}_input_ids", f"dpo_{side}_attention_mask", f"dpo_{side}_response_mask")
            out.update(zip(keys, _padded(seqs, masks, pad_id(tok), device)))
        ref_model, ctx = self._dpo_reference()
        index = torch.tensor(rows, device=device)
        with torch.no_grad(), ctx:
            for side in ("chosen", "rejected"):
                lp = self._side_logprobs(ref_model, out, side, index)
                out[f"dpo_{side}_ref_logprobs"] = torch.zeros(len(pairs), device=device).index_copy(0, index, lp.float())
        return out

    def _dpo_reference(self) -> tuple[torch.nn.Module, Any]:
        """TRL's reference: ``ref_model``; else, under PEFT, the model with its ``ref`` adapter or none; else the policy."""
        if getattr(self, "ref_model", None) is not None:
            return self.ref_model, nullcontext()
        model = self.accelerator.unwrap_model(self.model)
        if is_peft_model(model):
            return model, use_adapter(model, "ref" if "ref" in model.peft_config else None)
        return model, nullcontext()

    # --- loss and metrics ---
    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """``LossConfig.combine(grpo, sdpo, dpo, shares=(1, 1/GA, 1/GA))`` (TRL's GRPO loss is already scaled)."""
        grpo = super()._compute_loss(model, inputs)
        ga = self.current_gradient_accumulation_steps if self.model.training else 1
        sdpo, dpo = self._compute_sdpo_loss(model, inputs), self._compute_trace_replay_loss(model, inputs)
        return self.loss_config.combine(grpo, sdpo, dpo, shares=(1.0, 1.0 / ga, 1.0 / ga))

    def _record(self, **metrics: Any) -> None:
        """Keep channel metrics as device tensors; :meth:`log` reads them once per logging step (no host sync)."""
        store = self._channel_metrics["train" if self.model.training else "eval"]
        for key, value in metrics.items():
            store[f"composer/{key}"].append(torch.as_tensor(value, dtype=torch.float32).detach())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's ``log``, with the means of the channel metrics of this logging step (``composer/*``, only for a
        channel that ran; per process, like the rest of the local metrics)."""
        mode = "train" if self.model.training else "eval"
        if store := self._channel_metrics[mode]:
            keys, device = list(store), next(iter(store.values()))[0].device
            means = torch.stack([torch.stack([v.to(device) for v in store[k]]).mean() for k in keys]).tolist()
            self._metrics[mode].update({k: [v] for k, v in zip(keys, means)})
            store.clear()
        super().log(logs, start_time)

    def _compute_sdpo_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """Token-mean generalized JSD between the policy and its hinted self on the same tokens (rows with a nonzero
        ``sdpo_loss_mask``): ``self_distillation_loss`` on student ``prompt_ids + completion_ids [b, Tp + Tc]``
        (response mask ``[0 | completion_mask * tool_mask]``) and teacher ``ctx_teacher_input_ids [b, Tt]``.

        Returns a scalar, ``0`` when the channel is off or no row has a hint; ``ValueError`` (from the library)
        when a row's student and teacher tokens differ.
        """
        rows = _rows(inputs, self.loss_config.alpha_sdpo, "sdpo_loss_mask")
        if rows is None:
            return torch.zeros((), device=inputs["completion_ids"].device)
        prompt_mask, comp = inputs["prompt_mask"], inputs["completion_mask"]
        own = comp * inputs["tool_mask"] if "tool_mask" in inputs else comp
        sub = {"input_ids": torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)[rows],  # [b, Tp + Tc]
               "attention_mask": torch.cat([prompt_mask, comp], 1)[rows],
               "response_mask": torch.cat([torch.zeros_like(prompt_mask), own], 1)[rows],
               **{k: inputs[k][rows] for k in ("ctx_teacher_input_ids", "ctx_teacher_attention_mask", "sdpo_loss_mask")}}
        loss, metrics = self_distillation_loss(self.accelerator.unwrap_model(model), sub, self.loss_config)
        self._record(**{"jsd": metrics["loss/jsd"], "jsd/num_tokens": metrics["loss/jsd/num_tokens"]})
        return loss

    def _compute_trace_replay_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """Sigmoid DPO over the rows that carry a pair (nonzero chosen and rejected response masks), policy
        log-probs from :meth:`_side_logprobs`; a scalar, ``0`` when the channel is off or no row has a pair."""
        rows = _rows(inputs, self.loss_config.beta_replay, "dpo_chosen_response_mask", "dpo_rejected_response_mask")
        if rows is None:
            return torch.zeros((), device=inputs["completion_ids"].device)
        policy = self.accelerator.unwrap_model(model)
        logps = [self._side_logprobs(policy, inputs, side, rows) for side in ("chosen", "rejected")]
        loss, stats = dpo_loss(*logps, inputs["dpo_chosen_ref_logprobs"][rows], inputs["dpo_rejected_ref_logprobs"][rows],
                               beta=self.loss_config.replay_dpo_beta)
        self._record(**{("dpo" if k == "dpo/loss" else k): v for k, v in stats.items()}, **{"dpo/num_pairs": rows.numel()})
        return loss

    def _side_logprobs(self, model: torch.nn.Module, batch: dict[str, Any], side: str, rows: torch.Tensor) -> torch.Tensor:
        """Summed response log-probs ``[b]`` of rows ``rows`` of the ``dpo_{side}_*`` tensors ``[B, T]`` of ``batch``
        (``losses.sequence_logprobs_for``)."""
        ids, resp, attn = (batch[f"dpo_{side}_{k}"][rows] for k in ("input_ids", "response_mask", "attention_mask"))
        return sequence_logprobs_for(model, ids, resp, attn, chunk_size=self.loss_config.chunk_size)

"""ComposerReplicationTrainer: TRL GRPO plus self-distillation at error sites plus trace-replay DPO.

    total = grpo + alpha_sdpo * sdpo_jsd / GA + beta_replay * trace_replay_dpo / GA

- Channel 1 is TRL's ``GRPOTrainer._compute_loss`` unchanged (its loss is already scaled for
  gradient accumulation ``GA``, as are channels 2 and 3 here).
- Channel 2 (SDPO/OPSD, arXiv 2601.20802 / 2601.18734): the generalized JSD between the policy on the
  sampled completion and the same model, without gradient, on ``prompt + [hint as a user turn] +
  the same completion tokens``. Token mean over the distilled tokens. Computed by the loss library
  (``composer_replication.loss.self_distillation_loss``, channel 2 of ``compose_loss`` alone) on the rows that have a hint.
- Channel 3 (DPO, arXiv 2305.18290): the sigmoid DPO loss (``composer_replication.dpo.dpo_loss``) over
  ``(prompt, chosen, rejected)`` pairs, log-probs from ``composer_replication.loss.sequence_logprobs_for``,
  reference log-probs computed once at generation time.

Data path. The extra channels come from optional dataset columns next to ``prompt`` (which must then
be conversational): ``hint`` (str) and ``dpo_chosen`` / ``dpo_rejected`` (str, the row's prompt is
the DPO context). ``_generate_and_score_completions`` (called by TRL's ``_prepare_inputs``) builds
the batch-contract tensors with one row per completion, so TRL's ``shuffle_sequence_dict`` and
``split_tensor_dict`` slice them together with the completions: rows without a hint or pair carry an
all-zero ``sdpo_loss_mask`` / ``dpo_*_response_mask`` and are skipped by the loss. A prompt repeated
``num_generations`` times repeats its pair that many times (equal weights per prompt).

Batch keys (the batch contract, ``docs/collator.md``): ``ctx_teacher_input_ids``, ``ctx_teacher_attention_mask``,
``sdpo_loss_mask`` ``[B, Tt]``; ``dpo_{chosen,rejected}_{input_ids,attention_mask,response_mask}``
``[B, T*]`` and ``dpo_{chosen,rejected}_ref_logprobs`` ``[B]``. The DPO reference is ``ref_model``
when TRL keeps one (``beta > 0``), the adapter-disabled model under PEFT, else the policy at sampling
time (no grad).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from composer_replication.batching import TokenizedPair, pad_id, pad_rows, tokenize_pair
from composer_replication.chat_format import build_hinted_teacher_sequence
from composer_replication.losses import LossConfig, dpo_loss, self_distillation_loss, sequence_logprobs_for
from composer_replication.types import PreferencePair

try:
    from trl import GRPOTrainer

    _TRL_AVAILABLE = True
except ImportError:  # the module still imports; instantiation raises
    GRPOTrainer = object
    _TRL_AVAILABLE = False

__all__ = ["ComposerReplicationTrainer", "HINT_COLUMN", "DPO_CHOSEN_COLUMN", "DPO_REJECTED_COLUMN"]

log = logging.getLogger(__name__)

HINT_COLUMN = "hint"
DPO_CHOSEN_COLUMN = "dpo_chosen"
DPO_REJECTED_COLUMN = "dpo_rejected"
_INSTALL = "pip install composer-replication[trl]"


def _pad_right(seqs: Sequence[Sequence[int]], fill: int, device: torch.device) -> torch.Tensor:
    """``[B, max(len)]`` long tensor (at least one column; rows may be empty), right-padded with ``fill``."""
    return pad_rows(seqs, fill)[0].to(device)


def _messages(prompt: Any, row: int, what: str) -> list[dict]:
    if not isinstance(prompt, list) or not all(isinstance(m, Mapping) for m in prompt):
        raise ValueError(
            f"row {row} has a {what} but its prompt is not conversational (a list of messages); "
            "channels 2 and 3 need chat prompts so the hint / DPO responses follow the chat template"
        )
    return list(prompt)


class ComposerReplicationTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose loss adds self-distillation (channel 2) and trace-replay DPO (channel 3).

    Args:
        *args, **kwargs: ``GRPOTrainer``'s (model, reward_funcs, args, train_dataset, processing_class, ...).
        alpha_sdpo: channel-2 weight (``0`` disables it).
        beta_replay: channel-3 weight (``0`` disables it).
        sdpo_jsd_beta: ``beta`` of ``generalized_jsd_loss`` in ``[0, 1]`` (0 forward KL, 1 reverse KL).
        sdpo_temperature: softmax temperature of channel 2 (``> 0``).
        sdpo_token_clip: optional clamp of the pointwise JSD terms (``> 0``).
        replay_dpo_beta: DPO ``beta`` (``> 0``).
        loss_chunk_size: rows of logits per chunk in channels 2 and 3 (``composer_replication.logprobs``);
            ``None`` materialises the full logits.

    Raises:
        ImportError: trl is not installed (``pip install composer-replication[trl]``).
        ValueError: a weight or hyper-parameter out of range, or ``use_liger_kernel=True`` (TRL's Liger
            path bypasses ``_compute_loss``).
    """

    def __init__(
        self,
        *args: Any,
        alpha_sdpo: float = 0.1,
        beta_replay: float = 0.05,
        sdpo_jsd_beta: float = 0.5,
        sdpo_temperature: float = 1.0,
        sdpo_token_clip: float | None = None,
        replay_dpo_beta: float = 0.1,
        loss_chunk_size: int | None = 1024,
        **kwargs: Any,
    ) -> None:
        if not _TRL_AVAILABLE:
            raise ImportError(f"ComposerReplicationTrainer needs trl (a TRL GRPOTrainer subclass): {_INSTALL}")
        # one set of checks: the loss library's config (errors name the key, e.g. 'loss.alpha_sdpo')
        self.loss_config = LossConfig(alpha_sdpo=alpha_sdpo, beta_replay=beta_replay, sdpo_jsd_beta=sdpo_jsd_beta,
                                      sdpo_temperature=sdpo_temperature, sdpo_token_clip=sdpo_token_clip,
                                      replay_dpo_beta=replay_dpo_beta, chunk_size=loss_chunk_size)
        c = self.loss_config
        self.alpha_sdpo, self.beta_replay = float(c.alpha_sdpo), float(c.beta_replay)
        self.sdpo_jsd_beta, self.sdpo_temperature = float(c.sdpo_jsd_beta), float(c.sdpo_temperature)
        self.sdpo_token_clip, self.replay_dpo_beta = c.sdpo_token_clip, float(c.replay_dpo_beta)
        self.loss_chunk_size = c.chunk_size
        super().__init__(*args, **kwargs)
        if getattr(self.args, "use_liger_kernel", False):
            raise ValueError("use_liger_kernel=True skips _compute_loss, so channels 2 and 3 would never run; "
                             "set use_liger_kernel=False")

    # ------------------------------------------------------------------------------------------
    # Data path: attach channel-2/3 tensors to the generation batch (sliced by _prepare_inputs)
    # ------------------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's generation and scoring, plus the channel-2/3 tensors built from the dataset columns."""
        output = super()._generate_and_score_completions(inputs)
        hints = [x.get(HINT_COLUMN) for x in inputs]
        pairs = [(x.get(DPO_CHOSEN_COLUMN), x.get(DPO_REJECTED_COLUMN)) for x in inputs]
        if self.alpha_sdpo > 0 and any(hints):
            output.update(self._sdpo_tensors([x["prompt"] for x in inputs], hints, output))
        if self.beta_replay > 0 and any(c or r for c, r in pairs):
            output.update(self._dpo_tensors([x["prompt"] for x in inputs], pairs, output["completion_ids"].device))
        return output

    def _sdpo_tensors(self, prompts: list[Any], hints: list[Any], output: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Teacher rows ``prompt + [hint] + completion`` (``[B, Tt]``); zero mask where there is no hint."""
        tok, device = self.processing_class, output["completion_ids"].device
        ids, masks = [], []
        for i, (prompt, hint) in enumerate(zip(prompts, hints)):
            n = int(output["completion_mask"][i].sum())
            if not hint or n == 0:  # no hint, or a completion masked out entirely (e.g. truncated)
                ids.append([])
                masks.append([])
                continue
            response = output["completion_ids"][i, :n].tolist()
            seq, start = build_hinted_teacher_sequence(tok, _messages(prompt, i, "hint"), str(hint), response)
            ids.append(seq)
            masks.append([0] * start + [1] * n)
        attn = [[1] * len(s) for s in ids]
        return {
            "ctx_teacher_input_ids": _pad_right(ids, pad_id(tok), device),
            "ctx_teacher_attention_mask": _pad_right(attn, 0, device),
            "sdpo_loss_mask": _pad_right(masks, 0, device),
        }

    def _dpo_tensors(self, prompts: list[Any], pairs: list[tuple[Any, Any]], device: torch.device) -> dict[str, torch.Tensor]:
        """``prompt + response`` rows for chosen and rejected (``[B, T*]``) and reference log-probs ``[B]``."""
        tok = self.processing_class
        tokenized: list[TokenizedPair | None] = []
        for i, (prompt, (chosen, rejected)) in enumerate(zip(prompts, pairs)):
            if not chosen and not rejected:
                tokenized.append(None)
                continue
            if not isinstance(chosen, str) or not isinstance(rejected, str) or not chosen or not rejected:
                raise ValueError(f"row {i}: {DPO_CHOSEN_COLUMN} and {DPO_REJECTED_COLUMN} must both be non-empty "
                                 f"strings, got {chosen!r:.40} and {rejected!r:.40}")
            pair = PreferencePair.from_actions(state_id=f"row {i}", state_messages=_messages(prompt, i, "DPO pair"),
                                               chosen=chosen, rejected=rejected)
            tokenized.append(tokenize_pair(tok, pair))
        out = {}
        for side in ("chosen", "rejected"):  # one row per batch row; rows without a pair stay empty
            rows = [list(t.prompt) + list(getattr(t, side)) if t else [] for t in tokenized]
            masks = [[0] * len(t.prompt) + [1] * len(getattr(t, side)) if t else [] for t in tokenized]
            out[f"dpo_{side}_input_ids"] = _pad_right(rows, pad_id(tok), device)
            out[f"dpo_{side}_attention_mask"] = _pad_right([[1] * len(r) for r in rows], 0, device)
            out[f"dpo_{side}_response_mask"] = _pad_right(masks, 0, device)
        ref_model, ctx = self._dpo_reference()
        with torch.no_grad(), ctx:
            for side in ("chosen", "rejected"):
                out[f"dpo_{side}_ref_logprobs"] = self._sequence_logprobs(
                    ref_model, out[f"dpo_{side}_input_ids"], out[f"dpo_{side}_response_mask"],
                    out[f"dpo_{side}_attention_mask"], chunk_size=self.loss_chunk_size).detach()
        return out

    def _dpo_reference(self) -> tuple[torch.nn.Module, Any]:
        """The DPO reference: TRL's ``ref_model``, else the adapter-disabled PEFT model, else the policy."""
        if getattr(self, "ref_model", None) is not None:
            return self.ref_model, nullcontext()
        unwrapped = self.accelerator.unwrap_model(self.model)
        if hasattr(unwrapped, "disable_adapter") and hasattr(unwrapped, "peft_config"):
            return self.model, unwrapped.disable_adapter()
        return self.model, nullcontext()

    # ------------------------------------------------------------------------------------------
    # Loss
    # ------------------------------------------------------------------------------------------
    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """``grpo + alpha_sdpo * sdpo / GA + beta_replay * dpo / GA``; logs ``composer/*`` metrics."""
        grpo = super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1
        total = grpo
        metrics = self._metrics[mode]
        metrics["composer/grpo"].append(float(grpo.detach()))
        if self.alpha_sdpo > 0 and "sdpo_loss_mask" in inputs:
            sdpo = self._compute_sdpo_loss(model, inputs)
            total = total + self.alpha_sdpo * sdpo / ga
        if self.beta_replay > 0 and "dpo_chosen_input_ids" in inputs:
            dpo = self._compute_trace_replay_loss(model, inputs)
            total = total + self.beta_replay * dpo / ga
        metrics["composer/total"].append(float(total.detach()))
        return total

    def _compute_sdpo_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """Token-mean generalized JSD between the policy and the hinted teacher on the same tokens.

        The rows with a nonzero ``sdpo_loss_mask`` go through ``composer_replication.loss.self_distillation_loss``
        (channel 2 of ``compose_loss`` alone, the loss library's code path): student ``prompt_ids + completion_ids``
        ``[b, Tp + Tc]`` with ``response_mask = [0 | completion_mask]``, teacher ``ctx_teacher_input_ids``
        ``[b, Tt]`` with ``sdpo_loss_mask``.

        Returns:
            A scalar (``0`` when the channel is off or no row has a hint).

        Raises:
            ValueError: (from ``self_distillation_loss``) a row's student and teacher response tokens differ.
        """
        device = inputs["completion_ids"].device
        if self.alpha_sdpo == 0 or "sdpo_loss_mask" not in inputs:
            return torch.zeros((), device=device)
        rows = inputs["sdpo_loss_mask"].any(-1).nonzero().squeeze(-1)
        if rows.numel() == 0:
            return torch.zeros((), device=device)
        prompt_mask, completion_mask = inputs["prompt_mask"], inputs["completion_mask"]
        sub = {
            "input_ids": torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)[rows],  # [b, Tp + Tc]
            "attention_mask": torch.cat([prompt_mask, completion_mask], 1)[rows],
            "response_mask": torch.cat([torch.zeros_like(prompt_mask), completion_mask], 1)[rows],
            **{k: inputs[k][rows] for k in ("ctx_teacher_input_ids", "ctx_teacher_attention_mask", "sdpo_loss_mask")},
        }
        loss, metrics = self_distillation_loss(
            model, sub, sdpo_jsd_beta=self.sdpo_jsd_beta, sdpo_temperature=self.sdpo_temperature,
            sdpo_token_clip=self.sdpo_token_clip, chunk_size=self.loss_chunk_size,
        )
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["composer/sdpo_jsd"].append(float(loss.detach()))
        self._metrics[mode]["composer/sdpo_tokens"].append(metrics.get("loss/jsd/num_tokens", 0.0))
        return loss

    def _compute_trace_replay_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """Sigmoid DPO over the rows that carry a pair (nonzero chosen and rejected response masks).

        Policy log-probs come from ``composer_replication.loss.sequence_logprobs_for`` and the loss from
        ``composer_replication.dpo.dpo_loss``, as in the loss library's channel 3.

        Returns:
            A scalar (``0`` when the channel is off or no row has a pair).
        """
        device = inputs["completion_ids"].device
        if self.beta_replay == 0 or "dpo_chosen_input_ids" not in inputs:
            return torch.zeros((), device=device)
        c_resp, r_resp = inputs["dpo_chosen_response_mask"], inputs["dpo_rejected_response_mask"]
        rows = (c_resp.any(-1) & r_resp.any(-1)).nonzero().squeeze(-1)
        if rows.numel() == 0:
            return torch.zeros((), device=device)
        logps = {
            side: self._sequence_logprobs(
                model, inputs[f"dpo_{side}_input_ids"][rows], inputs[f"dpo_{side}_response_mask"][rows],
                inputs[f"dpo_{side}_attention_mask"][rows], chunk_size=self.loss_chunk_size)
            for side in ("chosen", "rejected")
        }
        loss, stats = dpo_loss(
            logps["chosen"], logps["rejected"],
            inputs["dpo_chosen_ref_logprobs"][rows], inputs["dpo_rejected_ref_logprobs"][rows],
            beta=self.replay_dpo_beta,
        )
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["composer/trace_replay_dpo"].append(float(loss.detach()))
        self._metrics[mode]["composer/dpo_pairs"].append(float(rows.numel()))
        for k, v in stats.items():
            self._metrics[mode][f"composer/{k}"].append(float(v))
        return loss

    @staticmethod
    def _sequence_logprobs(
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        response_mask: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        chunk_size: int | None = 1024,
    ) -> torch.Tensor:
        """Summed log-probs of the response tokens, ``[P]``, for ``input_ids`` / masks ``[P, T]``.

        ``composer_replication.loss.sequence_logprobs_for`` (chunked, positions from the attention mask).
        """
        return sequence_logprobs_for(model, input_ids, response_mask, attention_mask, chunk_size=chunk_size)

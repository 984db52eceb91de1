"""Hand-made three-channel batches for the compose_loss tests (two rows, both padding sides)."""

from __future__ import annotations

import torch


def _seqs(parts, side: str):
    """``parts``: list of (prompt ids, response ids) -> ids, attention mask, response mask ``[B, T]``."""
    T = max(len(p) + len(r) for p, r in parts)
    ids, att, resp = (torch.zeros(len(parts), T, dtype=torch.long) for _ in range(3))
    for i, (p, r) in enumerate(parts):
        n = len(p) + len(r)
        off = T - n if side == "left" else 0
        ids[i, off : off + n] = torch.tensor(p + r)
        att[i, off : off + n] = 1
        resp[i, off + len(p) : off + n] = 1
    return ids, att, resp


def make_batch(side: str = "right", *, seed: int = 0, sdpo: bool = True, dpo: bool = True) -> dict:
    """Student rows (responses of 4 and 3 tokens), hinted teacher rows ending with the same responses, and
    two (chosen, rejected) pairs with reference log-probs; ``side``: padding side."""
    g = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(3, 3000, (n,), generator=g).tolist()

    responses = [toks(4), toks(3)]
    batch = {}
    batch["input_ids"], batch["attention_mask"], batch["response_mask"] = _seqs(
        [(toks(5), responses[0]), (toks(3), responses[1])], side
    )
    if sdpo:  # hinted context (longer) + exactly the same response tokens
        t_ids, t_att, t_mask = _seqs([(toks(8), responses[0]), (toks(9), responses[1])], side)
        batch.update(ctx_teacher_input_ids=t_ids, ctx_teacher_attention_mask=t_att, sdpo_loss_mask=t_mask)
    if dpo:
        prompts = [toks(3), toks(4)]
        for name, lens in (("chosen", (4, 2)), ("rejected", (5, 3))):
            ids, att, mask = _seqs([(p, toks(n)) for p, n in zip(prompts, lens)], side)
            batch.update(
                {
                    f"dpo_{name}_input_ids": ids,
                    f"dpo_{name}_attention_mask": att,
                    f"dpo_{name}_response_mask": mask,
                }
            )
        batch["dpo_chosen_ref_logprobs"] = torch.tensor([-30.0, -20.0])
        batch["dpo_rejected_ref_logprobs"] = torch.tensor([-35.0, -25.0])
    return batch

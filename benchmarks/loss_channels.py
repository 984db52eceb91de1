"""Every channel's loss and gradient norm on the ``benchmarks.losses`` batch, for every loss variant.

A refactor of the loss library must not change a bit of what it computes. For channel 3 in {dpo, simpo} x
channel 2 in {jsd (``sdpo_wrapper="none"``), taid, entropy_opd} this prints each channel's value (``lm_ce``
(GRPO here), ``sdpo_jsd``, ``trace_replay_dpo``, ``total``) and the global L2 norm of its gradient alone, as
exact ``float.hex`` strings, through the spec's keyword API of ``compose_loss`` only: ``diff`` the output of
a run before and after a change.

    python -m benchmarks.loss_channels                   # B=2, T=256, chunk sizes 256 and naive
    python -m benchmarks.loss_channels --seq 1024 --chunk-sizes 256
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.losses import _batch, _model, batch_args

CHANNELS = ("lm_ce", "sdpo_jsd", "trace_replay_dpo", "total")
VARIANTS = [(v, w) for v in ("dpo", "simpo") for w in ("none", "taid", "entropy_opd")]


def _grad_norm(loss: torch.Tensor, params: list[torch.Tensor]) -> float:
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    sq = [g.double().pow(2).sum() for g in grads if g is not None]
    return float(torch.stack(sq).sum().sqrt()) if sq else 0.0


def run(args: argparse.Namespace) -> list[str]:
    """One line per (chunk size, variant, channel): ``loss=<value> (<hex>) grad_norm=<value> (<hex>)``."""
    from composer_replication.loss import compose_loss, token_logprobs_for

    torch.set_num_threads(args.threads)
    model = _model("cpu", args.layers)
    params = [p for p in model.parameters() if p.requires_grad]
    batch = _batch(args.batch, args.seq, args.response_frac, args.hint, "cpu")
    with torch.no_grad():  # on-policy rollout: old log-probs = current ones, as in benchmarks.losses
        batch["old_logprobs"] = token_logprobs_for(model, batch["input_ids"], batch["attention_mask"],
                                                   response_mask=batch["response_mask"], chunk_size=256)
    lines = []
    for chunk in args.chunk_sizes:
        chunk_size = None if chunk == "naive" else int(chunk)
        for variant, wrapper in VARIANTS:
            out = compose_loss(model, batch, dpo_variant=variant, sdpo_wrapper=wrapper, chunk_size=chunk_size,
                               taid_t=0.4 if wrapper == "taid" else None)
            for name in CHANNELS:
                loss = getattr(out, name)
                g = _grad_norm(loss, params)
                lines.append(f"chunk={chunk:<5} {variant:<5} {wrapper:<11} {name:<16} "
                             f"loss={float(loss):.9g} ({float(loss).hex()}) grad_norm={g:.9g} ({g.hex()})")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = batch_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), seq=256)
    p.add_argument("--chunk-sizes", nargs="+", default=["256", "naive"], help="chunk sizes ('naive' = full logits)")
    args = p.parse_args(argv)
    print("\n".join(run(args)))


if __name__ == "__main__":
    main()

"""Chunked vs naive three-channel loss: peak memory, time and loss equality, forward + backward.

DESIGN.md section 4.5 targets a fraction of the naive peak memory at near the naive speed at SmolLM2's
vocabulary. ``compose_loss`` with all three channels (GRPO with rollout keys, generalized-JSD
self-distillation, DPO) runs with full logits (``chunk_size=None``) and once per chunk size, each in a
fresh subprocess, on a random Llama with SmolLM2-135M's hidden size (576) and vocabulary (49152) but 2
layers. Memory: the worker's peak RSS during one forward + backward minus its RSS before
(``/proc/self/clear_refs`` resets the high-water mark; glibc mmaps every allocation above 64 KiB so freed
buffers leave RSS); on CUDA, ``torch.cuda.max_memory_allocated``.

    python -m benchmarks.losses                       # B=2, T=1024, chunk sizes 1024 and 256
    python -m benchmarks.losses --chunk-sizes 1024 256 128 --response-frac 1.0 --no-record
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from benchmarks.report import command, parser, record, table


def _model(device: str, layers: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=2, bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.to(device).train()


def _batch(B: int, T: int, frac: float, hint: int, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Channel 1: B rows of T tokens, the last ``frac * T`` are the response. Channel 2: each row's history
    plus ``hint`` tokens, then the same response. Channel 3: B pairs of T-token sequences."""
    g = torch.Generator().manual_seed(seed)
    R = max(1, min(T - 1, int(T * frac)))  # position 0 has no logits predicting it
    P_len = T - R

    def seqs(prompt_len: int, responses: torch.Tensor):
        prompt = torch.randint(3, 49152, (B, prompt_len), generator=g)
        ids = torch.cat([prompt, responses], 1)
        mask = torch.zeros_like(ids)
        mask[:, prompt_len:] = 1
        return ids, torch.ones_like(ids), mask

    resp = torch.randint(3, 49152, (B, R), generator=g)
    b = {}
    b["input_ids"], b["attention_mask"], b["response_mask"] = seqs(P_len, resp)
    b["ctx_teacher_input_ids"], b["ctx_teacher_attention_mask"], b["sdpo_loss_mask"] = seqs(P_len + hint, resp)
    for side in ("chosen", "rejected"):
        ids, att, mask = seqs(P_len, torch.randint(3, 49152, (B, R), generator=g))
        b.update({f"dpo_{side}_input_ids": ids, f"dpo_{side}_attention_mask": att, f"dpo_{side}_response_mask": mask})
    b["dpo_chosen_ref_logprobs"] = -10.8 * R + torch.randn(B, generator=g)
    b["dpo_rejected_ref_logprobs"] = -10.8 * R + torch.randn(B, generator=g)
    b["advantages"] = torch.randn(B, generator=g)
    return {k: v.to(device) for k, v in b.items()}


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _run(model, batch, chunk_size):
    from composer_replication.losses import compose_loss

    out = compose_loss(model, batch, chunk_size=chunk_size)
    out.total.backward()
    return out


def worker(args: argparse.Namespace) -> dict:
    """One measured forward + backward in this process; returns the figures as a dict."""
    from composer_replication.losses import token_logprobs_for

    torch.set_num_threads(args.threads)
    chunk = None if args.worker == "naive" else int(args.worker)
    model = _model(args.device, args.layers)
    batch = _batch(args.batch, args.seq, args.response_frac, args.hint, args.device)
    small = _batch(args.batch, 32, args.response_frac, 4, args.device, seed=1)
    with torch.no_grad():  # on-policy rollout: old log-probs = current ones
        for b in (batch, small):
            b["old_logprobs"] = token_logprobs_for(model, b["input_ids"], b["attention_mask"],
                                                   response_mask=b["response_mask"], chunk_size=256)
    _run(model, small, chunk)  # warm-up: allocates .grad and lazy state
    model.zero_grad(set_to_none=False)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base = _rss_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    out = _run(model, batch, chunk)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() if cuda else _rss_kib("VmHWM") * 1024) - base
    emb = model.get_input_embeddings().weight.grad
    return {
        "mode": args.worker, "seconds": seconds, "peak_bytes": peak, **out.metrics(),
        "grad_norm_embed": float(emb.norm()), "grad_norm_layer0_q": float(model.model.layers[0].self_attn.q_proj.weight.grad.norm()),
    }


def _spawn(mode: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.losses", "--worker", mode]
    for k in ("batch", "seq", "response_frac", "hint", "layers", "threads", "device"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(args.threads)}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"worker {mode} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _channels(result: dict) -> list[str]:
    """The ``loss/<name>`` keys of the channels that ran (true names), then ``loss/total``."""
    names = [k for k in result if k.startswith("loss/") and k.count("/") == 1 and k != "loss/total"]
    return [*names, "loss/total"]


def _table(naive: dict, rows: list[dict]) -> str:
    channels = _channels(naive)
    lines = table(["path", "peak memory (MiB)", "memory ratio", "time (s)", "time ratio", "max abs loss diff",
                   "embed grad rel diff"],
                  [["naive (full logits)", f"{naive['peak_bytes'] / 2**20:.0f}", "1.00", f"{naive['seconds']:.1f}", "1.00",
                    0, 0]] + [[f"chunked, chunk_size={r['mode']}", f"{r['peak_bytes'] / 2**20:.0f}",
                               f"{r['peak_bytes'] / naive['peak_bytes']:.2f}", f"{r['seconds']:.1f}",
                               f"{r['seconds'] / naive['seconds']:.2f}", f"{max(abs(r[k] - naive[k]) for k in channels):.1e}",
                               f"{abs(r['grad_norm_embed'] - naive['grad_norm_embed']) / naive['grad_norm_embed']:.1e}"]
                              for r in rows])
    lines += ["", *table(["path", *channels, "embed grad norm", "layer-0 q grad norm"],
                         [[r["mode"], *(f"{r[k]:.9g}" for k in (*channels, "grad_norm_embed", "grad_norm_layer0_q"))]
                          for r in [naive, *rows]])]
    return "\n".join(lines)


def batch_args(p: argparse.ArgumentParser, seq: int) -> argparse.ArgumentParser:
    """Add the batch and model flags of :func:`_batch` and :func:`_model` (shared with ``benchmarks.loss_channels``;
    ``seq``: the default T) to ``p``."""
    p.add_argument("--batch", type=int, default=2, help="student rows B (also teacher rows and DPO pairs)")
    p.add_argument("--seq", type=int, default=seq, help="sequence length T")
    p.add_argument("--response-frac", type=float, default=0.5, help="fraction of each sequence that is response")
    p.add_argument("--hint", type=int, default=64, help="extra tokens in the teacher's hinted context")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the random SmolLM2-sized Llama")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (per worker)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = batch_args(parser(__doc__), seq=1024)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[1024, 256], help="chunk sizes to compare")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(args)))
        return
    naive = _spawn("naive", args)
    rows = [_spawn(str(c), args) for c in args.chunk_sizes]
    header = (f"B={args.batch}, T={args.seq}, response fraction {args.response_frac}, hint +{args.hint} tokens, "
              f"{args.layers} layers, hidden 576, vocab 49152, {args.device}, {args.threads} thread(s); "
              f"channels {', '.join(k.removeprefix('loss/') for k in _channels(naive)[:-1])}, alpha_sdpo=0.1, "
              "beta_replay=0.05")
    table = _table(naive, rows)
    print(f"{header}\n{table}")
    md = f"# Chunked vs naive loss: the latest run\n\nCommand: `{command('losses', argv)}`\n\n{header}\n\n{table}\n"
    record(args, "losses_latest", md)


if __name__ == "__main__":
    main()

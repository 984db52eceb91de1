"""The replica's training function: the tiny Llama, a causal-LM loss on bundled text, torchft DiLoCo.

``replica_entrypoint`` calls :func:`train` in every replica with that replica's ``ObjectStoreAllReduce``.
Each replica reads a different share of the text (windows ``i`` with ``i % world_size == rank``), takes
``sync_every`` AdamW steps, then torchft's ``DiLoCo`` averages the pseudo-gradients through the store
(``MockManager``) and applies the outer Nesterov SGD step, identically on every replica.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

import composer_replication
from composer_replication.diloco import make_diloco_outer_loop
from composer_replication.diloco.replica import param_sha256
from composer_replication.diloco.serverless import MockManager, ObjectStoreAllReduce
from composer_replication.models import load_model_and_tokenizer

CORPUS = Path(composer_replication.__file__).parent / "data" / "tasks" / "python_tasks.jsonl"


def token_windows(tokenizer: Any, seq_len: int) -> torch.Tensor:
    """The bundled Python tasks (prompt + reference solution) as one token stream cut in ``[N, seq_len]`` windows."""
    texts = [f"{t['prompt']}\n{t['reference_solution']}" for t in map(json.loads, CORPUS.read_text().splitlines())]
    ids = tokenizer("\n\n".join(texts), return_tensors="pt")["input_ids"][0]
    n = ids.numel() // seq_len
    return ids[: n * seq_len].view(n, seq_len)  # [N, T]


def train(*, allreduce: ObjectStoreAllReduce, num_steps: int = 20, sync_every: int = 5, batch_size: int = 4,
          seq_len: int = 64, lr: float = 3e-3, seed: int = 0, max_dropped_rounds: int | None = None) -> dict[str, Any]:
    """Train one replica; its final parameter digest and counters. ``num_steps`` must be a multiple of
    ``sync_every``, so that the run ends on a sync (then every replica holds the same parameters)."""
    if num_steps % sync_every:
        raise ValueError(f"num_steps={num_steps} must be a multiple of sync_every={sync_every} so the run ends on "
                         "an outer step")
    rank, world = allreduce.rank, allreduce.world_size
    model, tok = load_model_and_tokenizer("tiny", seed=seed)  # the same initial weights on every replica
    model.train()
    windows = token_windows(tok, seq_len)
    mine = windows[rank::world]  # [N / world, T]
    inner = torch.optim.AdamW(model.parameters(), lr=lr)
    manager = MockManager(allreduce, max_dropped_rounds=max_dropped_rounds)
    data = torch.Generator().manual_seed(seed * 1000 + rank)
    losses, t0 = [], time.perf_counter()
    outer = make_diloco_outer_loop(manager, [model], inner, sync_every=sync_every)
    with outer:
        for step in range(1, num_steps + 1):
            batch = mine[torch.randint(len(mine), (batch_size,), generator=data)]  # [B, T]
            loss = model(input_ids=batch, labels=batch).loss
            inner.zero_grad()
            loss.backward()
            inner.step()  # every sync_every-th step also runs the DiLoCo outer step through the store
            losses.append(loss.item())
            if step % sync_every == 0:
                print(f"replica {rank}: step {step} loss {loss.item():.4f} committed rounds {manager.current_step()} "
                      f"dropped {manager.dropped_rounds}", flush=True)
    return {"rank": rank, "digest": param_sha256(model), "first_loss": losses[0], "last_loss": losses[-1],
            "committed_rounds": manager.current_step(), "dropped_rounds": manager.dropped_rounds,
            "nonfinite_rounds": outer.finite_guard.own_rounds, "bytes_written": allreduce.bytes_written,
            "bytes_read": allreduce.bytes_read, "seconds": time.perf_counter() - t0}

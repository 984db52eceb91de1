"""DiLoCo on meshes: bytes on the wire, loss against one replica, and the cost of losing a replica.

    python -m benchmarks.diloco                 # every part, figures into docs/benchmarks.md
    python -m benchmarks.diloco --skip-runs     # bytes and LM loss only (no recipe runs, ~1 min)

1. **Bytes per inner step.** Two replicas of the tiny student (threads, a real torchft lighthouse, gloo) train
   ``N`` inner steps with DiLoCo, and with a per-step gradient allreduce through the same torchft ``Manager``;
   every tensor handed to ``Manager.allreduce`` is counted. Expected ratio: about ``1/sync_every``. Then the
   held-out LM loss of 2 DiLoCo replicas against 1 on the same tokens (target: at most 5 % worse).
2. **The ``diloco`` preset, 2 replicas x S steps against ``diloco.replicas=1`` x 2S** (``recipes.monarch.run``):
   the mean ``loss/total`` of the last quarter and the final evaluation (target: within 5 %).
3. **A replica's death** (replica 1 calls ``os._exit`` at step 5): the time to its healed return, and the
   survivor's steps/s meanwhile against before.
4. **On a real SLURM** (``--slurm-only`` prints just this row): the ``slurm`` preset on a local two-node SLURM,
   submission to first step and the heal time after a node's host process is killed.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.report import REPO, metrics_rows, parser, record, run_recipe, table

# ---------------------------------------------------------------------------- 1. bytes on the wire


class _TinyLM:
    """The trainer surface ``DilocoReplica`` needs, over the tiny student on random tokens."""

    def __init__(self, rank: int, lock: threading.Lock, *, pattern: bool = False) -> None:
        import torch

        from composer_replication.models import load_model_and_tokenizer

        with lock:
            self.model, _ = load_model_and_tokenizer("tiny", seed=0)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.rank, self.step, self.pattern = rank, 0, pattern

    def loss(self, step: int, *, seed: int | None = None):
        """LM loss on a batch of ``(rank, step)``: random tokens ``[2, 32]``, or (``pattern``) ``[4, 32]`` of a
        learnable sequence ``t[k+1] = (5 t[k] + 3) mod 97`` from random starts (a held-out batch with ``seed``)."""
        import torch

        g = torch.Generator().manual_seed(1000 * self.rank + step if seed is None else seed)
        if not self.pattern:
            ids = torch.randint(0, self.model.config.vocab_size, (2, 32), generator=g)
        else:
            ids = torch.empty(4, 32, dtype=torch.long)
            ids[:, 0] = torch.randint(0, 97, (4,), generator=g)
            for k in range(31):
                ids[:, k + 1] = (5 * ids[:, k] + 3) % 97
        return self.model(input_ids=ids, labels=ids).loss

    def train_step(self, step: int) -> dict[str, float]:
        self.optimizer.zero_grad()
        (loss := self.loss(step)).backward()
        self.optimizer.step()
        self.step = step + 1
        return {"loss/total": float(loss.detach())}

    def state_dict(self):
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step}

    def load_state_dict(self, state) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]


def _run(mode: str, trainer: _TinyLM, replica, barrier: threading.Barrier, steps: int) -> None:
    """One replica's ``steps``: DiLoCo's inner steps, or per-step gradient allreduce through the manager."""
    m = replica.manager
    for s in range(steps):
        barrier.wait()
        if mode == "diloco":
            replica.train_step(s)
            continue
        trainer.optimizer.zero_grad()
        trainer.loss(s).backward()
        m.start_quorum()
        for work in [m.allreduce(p.grad) for p in trainer.model.parameters() if p.grad is not None]:
            work.wait()
        m.should_commit()
        trainer.optimizer.step()


def _train_pair(mode: str, sync_every: int, trainers: dict[int, _TinyLM], steps: int,
                counters: dict[int, list[int]] | None = None) -> None:
    """Replicas 0 and 1 (threads, a real lighthouse) train ``steps``: DiLoCo, or (``allreduce``) per-step gradients
    through the same manager; with ``counters``, the bytes each hands to ``Manager.allreduce``."""
    from composer_replication.diloco.config import DilocoConfig
    from composer_replication.diloco.replica import DilocoReplica, Lighthouse

    cfg = DilocoConfig(replicas=2, sync_every=sync_every, heartbeat_timeout_ms=1000, quorum_timeout_s=30)
    lighthouse = Lighthouse(cfg)
    reps = {i: DilocoReplica(t, cfg, replica_id=f"replica_{i}", lighthouse_addr=lighthouse.address)
            for i, t in trainers.items()}
    for i, rep in reps.items():
        if counters is not None:  # count every tensor handed to Manager.allreduce
            inner, seen = rep.manager.allreduce, counters[i]
            rep.manager.allreduce = lambda t, *a, _f=inner, _c=seen, **k: (_c.append(t.numel() * t.element_size()),
                                                                           _f(t, *a, **k))[1]
        if mode == "allreduce":
            rep.outer.__exit__(None, None, None)  # unhook DiLoCo: plain data parallel below
    barrier = threading.Barrier(2)
    threads = [threading.Thread(target=_run, args=(mode, trainers[i], reps[i], barrier, steps)) for i in reps]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for rep in reps.values():
        rep.shutdown()
    lighthouse.shutdown()


def bytes_per_step(sync_every: int, steps: int) -> dict[str, float]:
    """Bytes one replica hands to ``Manager.allreduce`` per inner step: DiLoCo against per-step gradients."""
    out: dict[str, float] = {}
    for mode in ("diloco", "allreduce"):
        lock, counters = threading.Lock(), {0: [], 1: []}
        _train_pair(mode, sync_every, {i: _TinyLM(i, lock) for i in (0, 1)}, steps, counters)
        out[mode] = sum(counters[0]) / steps
    out["ratio"] = out["diloco"] / out["allreduce"]
    return out


def lm_loss_comparison(steps: int, sync_every: int = 8) -> dict[str, float]:
    """Held-out LM loss of the tiny student on a learnable sequence task: 2 DiLoCo replicas x ``steps``
    against 1 replica (plain AdamW) x 2*``steps``: the same number of training tokens."""
    import torch

    def held_out(trainer: _TinyLM) -> float:
        with torch.no_grad():
            return statistics.fmean(float(trainer.loss(0, seed=10**6 + k)) for k in range(4))

    lock = threading.Lock()
    single = _TinyLM(0, lock, pattern=True)
    for s in range(2 * steps):
        single.train_step(s)
    trainers = {i: _TinyLM(i, lock, pattern=True) for i in (0, 1)}
    _train_pair("diloco", sync_every, trainers, steps)
    return {"one": held_out(single), "two": held_out(trainers[0]), "init": held_out(_TinyLM(0, lock, pattern=True))}


# ---------------------------------------------------------------------------- 2-3. recipe runs


def _recipe(folder: Path, *args: str) -> tuple[list[dict], dict]:
    """The ``diloco`` preset in ``folder``: its metrics rows and its summary."""
    rows = run_recipe(folder, "--config", "diloco", "run.display=none", "teachers.slugs=[local:tiny]",
                      "run.checkpoint_every=0", *args, env={"OMP_NUM_THREADS": "1"}, timeout=1200)
    return rows, json.loads((folder / "summary.json").read_text())


def _identical(summary: dict) -> float:
    """1.0 when every replica ended with the same parameters (``replica_param_sha256``)."""
    return float(len(set(summary["replica_param_sha256"].values())) == 1)


def _tail_loss(rows: list[dict]) -> float:
    losses = [r["loss/total"] for r in rows if "loss/total" in r]
    return statistics.fmean(losses[-max(1, len(losses) // 4) :])


def loss_comparison(root: Path, steps: int) -> dict[str, float]:
    """The diloco preset with 2 replicas x ``steps`` against 1 replica x 2*``steps``."""
    two, s2 = _recipe(root / "two", f"student.num_steps={steps}")
    one, s1 = _recipe(root / "one", f"student.num_steps={2 * steps}", "diloco.replicas=1")
    return {"two": _tail_loss(two), "one": _tail_loss(one), "eval_two": s2["eval_end"]["eval/mean"],
            "eval_one": s1["eval_end"]["eval/mean"]}


def death_and_heal(root: Path, steps: int) -> dict[str, float]:
    """Replica 1 exits at step 5; time to its healed return and the survivor's throughput meanwhile."""
    _, summary = _recipe(root / "fault", f"student.num_steps={steps}", "mesh.inject_fault=trainer:1:5:exit")
    event = summary["diloco_events"][0]
    stamp = _steps_done(root / "fault")
    died, back = stamp[4], stamp[event["rejoined_step"]]  # step 5 starts when step 4's row is written
    return {"heal_s": back - died, "steps_down": event["rejoined_step"] - 5,
            "before_steps_per_s": 4 / (stamp[4] - stamp[0]),
            "during_steps_per_s": (event["rejoined_step"] - 4) / (back - died),
            "restarts": summary["restarts"]["1"], "identical": _identical(summary)}


# ---------------------------------------------------------------------------- 4. on a real SLURM


def slurm_row(steps: int = 24) -> dict[str, float] | str:
    """The ``slurm`` preset on a local two-node SLURM (``tests/slurm/cluster.py``), node n2's host process killed
    after step 2: seconds from submission to the end of the first step, from the kill to the loss being noticed
    (``mesh.call_timeout_s`` 20) and to the replica's healed return. A string says why it could not run."""
    sys.path.insert(0, str(REPO / "tests" / "slurm"))
    from cluster import LocalCluster, free_ports, missing

    reason = missing()
    if reason:
        return reason
    with LocalCluster(2) as cluster, tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        env = {**cluster.env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "recipes.monarch.run", "--config", "slurm", f"run.dir={run_dir}",
             "run.display=none", "teachers.slugs=[local:tiny]", f"mesh.slurm.port={free_ports()}",
             f"student.num_steps={steps}", "mesh.call_timeout_s=20", "run.checkpoint_every=0"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None and 2 not in _steps_done(run_dir):
            time.sleep(0.2)
        killed = time.time()
        cluster.kill_node("n2")
        out, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"SLURM run failed (rc {proc.returncode}): {out[-2000:]}")
        stamp = _steps_done(run_dir)
        summary = json.loads((run_dir / "summary.json").read_text())
    event = summary["diloco_events"][0]
    return {"first_step_s": stamp[0] - summary["slurm_submitted_at"], "noticed_s": stamp[event["step"]] - killed,
            "heal_s": stamp[event["rejoined_step"]] - killed, "identical": _identical(summary)}


def _steps_done(run_dir: Path) -> dict[int, float]:
    """``{step: time its row was written}`` of the training rows so far."""
    return {int(r["step"]): r["time"] for r in metrics_rows(run_dir) if "loss/total" in r}


def slurm_line(row: dict[str, float] | str) -> str:
    """The SLURM row of the page."""
    if isinstance(row, str):
        return f"On a real SLURM: not measured ({row})."
    return (
        f"On a real SLURM (`slurm` preset, two `slurmd` nodes on loopback, `tests/slurm/cluster.py`): submission "
        f"to the end of the first step **{row['first_step_s']:.1f} s** (sbatch, workers up, teacher replay, setup, "
        f"first eval); node n2's host process killed after step 2: noticed after {row['noticed_s']:.1f} s "
        f"(`mesh.call_timeout_s` 20), healed back **{row['heal_s']:.1f} s** after the kill (a new worker step on "
        f"n2, setup, the group's next quorum); parameters identical at the end: {bool(row['identical'])}."
    )


# ---------------------------------------------------------------------------- report


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, prog="python -m benchmarks.diloco")
    p.add_argument("--steps", type=int, default=32, help="inner steps of the bytes measurement")
    p.add_argument("--run-steps", type=int, default=16, help="steps of the 2-replica recipe run")
    p.add_argument("--lm-steps", type=int, default=64, help="steps per DiLoCo replica of the LM-loss comparison")
    p.add_argument("--skip-runs", action="store_true", help="no recipe runs (bytes and LM loss only)")
    p.add_argument("--slurm-only", action="store_true", help="print the SLURM row only (the page is not written)")
    args = p.parse_args(argv)
    if args.slurm_only:
        print(slurm_line(slurm_row()))
        return 0
    lines = ["# DiLoCo on meshes (`python -m benchmarks.diloco`)", "",
             "Two replicas of the tiny student on this machine (loopback gloo).", "", *table(
                 ["sync_every", "DiLoCo bytes / inner step", "per-step allreduce bytes / step", "ratio", "1/sync_every"],
                 [[h, f"{b['diloco'] / 1e6:.3f} MB", f"{b['allreduce'] / 1e6:.3f} MB", f"{b['ratio']:.4f}", f"{1 / h:.4f}"]
                  for h, b in ((h, bytes_per_step(h, args.steps)) for h in (2, 8, 32))])]
    print("\n".join(lines[4:]), flush=True)
    lm = lm_loss_comparison(args.lm_steps)
    lm_gap = (lm["two"] - lm["one"]) / lm["one"]
    lines += [
        "", "Held-out LM loss on the same training tokens (tiny student, a learnable sequence task, "
        f"`lm_loss_comparison`, sync_every 8): 2 DiLoCo replicas x {args.lm_steps} steps **{lm['two']:.4f}**, "
        f"1 replica x {2 * args.lm_steps} steps **{lm['one']:.4f}** (untrained {lm['init']:.3f}): DiLoCo "
        f"{100 * lm_gap:+.1f} % against one replica (target: at most 5 % worse).",
    ]
    print(lines[-1], flush=True)
    if not args.skip_runs:
        with tempfile.TemporaryDirectory() as tmp:
            lc = loss_comparison(Path(tmp), args.run_steps)
            gap = abs(lc["two"] - lc["one"]) / max(abs(lc["one"]), 1e-12)
            dh = death_and_heal(Path(tmp), 32)
        lines += [
            "", f"The `diloco` preset itself (last quarter's mean `loss/total`, an RL loss near 0 whose value is noise "
            f"at this size, so the LM figure above is the comparison): "
            f"2 replicas x {args.run_steps} steps **{lc['two']:.4g}**, 1 replica x {2 * args.run_steps} "
            f"steps **{lc['one']:.4g}** (gap {100 * gap:.1f} %, target 5 %); final greedy eval reward "
            f"{lc['eval_two']:.3f} vs {lc['eval_one']:.3f}.", "",
            f"A replica's death (`mesh.inject_fault=trainer:1:5:exit`): back and healed **{dh['heal_s']:.1f} s** "
            f"after it died ({dh['steps_down']} steps without it; Monarch reports the death after ~10 s, then a "
            f"fresh proc mesh imports torch and loads the model); the survivor ran **{dh['during_steps_per_s']:.2f}"
            f" steps/s** meanwhile against {dh['before_steps_per_s']:.2f} before (it waits for the death report "
            f"once, then trains alone); parameters identical at the end: {bool(dh['identical'])}.", "",
            slurm_line(slurm_row()),
        ]
    record(args, "diloco", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The recipe's progress line and summary table (plain mode, no terminal needed)."""

from __future__ import annotations

from recipes.monarch.display import Display, format_step, summary_rows

METRICS = {"loss/grpo": 0.125, "loss/taid": 0.0, "loss/simpo": 0.6931, "loss/total": 0.3466,
           "reward/mean": 0.25, "perf/tokens_per_s": 912.0}


def test_format_step_names_every_channel():
    line = format_step(2, 10, METRICS, 0.0123)
    assert line.startswith("step 3/10")
    for part in ("grpo=0.125", "taid=0", "simpo=0.6931", "total=0.3466", "reward=0.25",
                 "tok/s=912", "spend=$0.0123"):
        assert part in line
    assert "lm_ce" not in line and "jsd" not in line and "dpo=" not in line.replace("simpo=", "")
    assert "reward=-" in format_step(0, 1, {"loss/total": 1.0, "reward/mean": float("nan")}, 0.0)


def test_summary_rows_and_plain_display(capsys):
    summary = {"run_dir": "/r", "steps": 4, "start_step": 2, "n_states": 6, "n_pairs": 5, "replay/spent_usd": 0.5,
               "final_metrics": METRICS, "channel_nonzero_steps": {"loss/grpo": 3}, "eval_end": {"eval/mean": 0.4},
               "wall_time_s": 12.0}
    rows = dict(summary_rows(summary))
    assert rows["steps"] == "2 -> 4" and rows["trace states / pairs"] == "6 / 5"
    assert rows["final loss/simpo"] == "0.6931" and rows["steps with loss/grpo != 0"] == "3"
    assert rows["eval_end reward"] == "0.4" and rows["teacher spend (USD)"] == "0.5000"
    d = Display("rich", num_steps=4)  # not a terminal under pytest: falls back to plain lines
    assert d.mode == "plain"
    d.replay(2, 2, 1, 0.0)
    d.step(3, METRICS, 0.5)
    d.summary(summary)
    d.close()
    out = capsys.readouterr().out
    assert "replay 2/2  pairs=1" in out and "step 4/4" in out and "teacher spend (USD)" in out
    quiet = Display("none", num_steps=1)
    quiet.step(0, METRICS, 0.0)
    quiet.summary(summary)
    assert capsys.readouterr().out == ""

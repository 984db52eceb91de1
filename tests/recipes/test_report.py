"""The run picture (recipes.monarch.report) on synthetic run folders: what it draws and how it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes.monarch.report import ReportError, load_run, main, recipe_report, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run_folder(
    tmp_path: Path,
    *,
    steps: int = 4,
    diloco: bool = False,
    summary: bool = True,
    distill: str = "jsd",
    replay: str = "dpo",
) -> Path:
    """A run folder as the recipe writes it: an eval row at the start, one row per step, an eval row at the end."""
    run = tmp_path / "run"
    run.mkdir(parents=True)
    evals = {"eval/mean": 0.25, "eval/std": 0.1, "eval/error_rate": 0.5, "eval/num_scored": 4.0}
    rows = [{"step": 0, "time": 1.0, **evals}]
    for k in range(steps):
        row = {
            "step": k,
            "time": 2.0 + k,
            "loss/grpo": 0.1 / (k + 1),
            f"loss/{distill}": 0.02 * k,
            f"loss/{replay}": 0.69 - 0.01 * k,
            "loss/total": 0.5 - 0.05 * k,
            "loss/grpo/clip_ratio": 0.0,
            "loss/lr": 1e-3,
            "loss/grad_norm": 0.3,
            "reward/mean": 0.1 * k,
            "reward/std": 0.05,
        }
        if diloco and k % 2 == 1:
            row.update({"diloco/participants": 2.0 if k < 3 else 1.0, "diloco/param_sha256/0": "ab" * 32})
        if diloco:
            row.update({"diloco/live_replicas": 2.0 if k < 2 else 1.0, "diloco/restarts": float(k >= 2)})
        rows.append(row)
    rows.append({"step": steps, "time": 9.0, **evals, "eval/mean": 0.5})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary:
        s = {
            "steps": steps,
            "start_step": 0,
            "n_states": 4,
            "n_pairs": 2,
            "wall_time_s": 12.0,
            "channel_nonzero_steps": {"loss/grpo": steps},
            "eval_start": evals,
            "eval_end": evals,
        }
        if diloco:
            s.update(restarts={"0": 0, "1": 1}, diloco_events=[{"replica": 1, "kind": "died", "step": 2}])
        (run / "summary.json").write_text(json.dumps(s))
    return run


def _png_height(path: Path) -> int:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    return int.from_bytes(data[20:24], "big")  # IHDR: width at 16..20, height at 20..24


def test_report_draws_every_channel_reward_and_eval(tmp_path):
    run = _run_folder(tmp_path)
    rec = load_run(run)
    assert rec.channels() == ["loss/grpo", "loss/jsd", "loss/dpo", "loss/total"]  # by channel, total last
    assert [r["step"] for r in rec.evals] == [0.0, 4.0]
    assert rec.series("reward/mean") == ([0.0, 1.0, 2.0, 3.0], pytest.approx([0.0, 0.1, 0.2, 0.3]))
    path = write_report(run)
    assert path == run / "report.png" and _png_height(path) > 200


def test_report_uses_the_true_loss_names(tmp_path):
    rec = load_run(_run_folder(tmp_path, distill="taid", replay="simpo"))
    assert rec.channels() == ["loss/grpo", "loss/taid", "loss/simpo", "loss/total"]


def test_diloco_run_gets_its_participants_panel(tmp_path):
    plain = write_report(_run_folder(tmp_path / "a"))
    run = _run_folder(tmp_path / "b", diloco=True)
    rec = load_run(run)
    assert rec.series("diloco/participants") == ([1.0, 3.0], [2.0, 1.0])
    assert all("diloco/param_sha256/0" not in r for r in rec.train)  # digests are strings: not drawn
    assert rec.series("diloco/live_replicas")[1] == [2.0, 2.0, 1.0, 1.0]
    assert _png_height(write_report(run)) > _png_height(plain)  # one more row of panels


def test_run_still_going_draws_without_summary(tmp_path):
    run = _run_folder(tmp_path, summary=False)
    out = tmp_path / "elsewhere.png"
    assert main([str(run), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC and not (run / "report.png").exists()


def test_summary_eval_used_when_metrics_have_no_eval_rows(tmp_path):
    run = _run_folder(tmp_path)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if "loss/total" in r))
    write_report(run)  # eval panel from summary.json's eval_start / eval_end
    assert load_run(run).evals == []


def test_missing_folder_or_metrics_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(ReportError, match="does not exist"):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match=r"metrics.jsonl not found: RUN_DIR must be a run folder"):
        load_run(tmp_path / "empty")
    assert main([str(tmp_path / "empty")]) == 2
    assert "report error:" in capsys.readouterr().err


def test_malformed_metrics_lines_are_skipped_naming_the_line(tmp_path):
    run = _run_folder(tmp_path)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('[1, 2]\n{"step": 5, "loss/tot')
    rec = load_run(run)
    assert len(rec.train) == 4 and any("line 7 skipped: not a metrics row" in w for w in rec.warnings)
    assert any("line 8 skipped: not JSON" in w and "half a line" in w for w in rec.warnings)
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/mean": 0.1}\n')
    with pytest.raises(ReportError, match="no usable training step"):
        load_run(run)


def test_malformed_summary_is_ignored_with_a_warning(tmp_path):
    run = _run_folder(tmp_path)
    (run / "summary.json").write_text("{not json")
    rec = load_run(run)
    assert rec.summary == {} and any("summary.json ignored: not JSON" in w for w in rec.warnings)
    assert write_report(rec).read_bytes()[:8] == PNG_MAGIC


def test_damaged_input_never_tracebacks(tmp_path, capsys):
    """Hostile rows: +-1e308 steps, a deeply nested line, a non-object line, NaN/inf/huge values, a `restarts` and
    events of the wrong type. The report skips or clips each with a warning and still draws (exit 0)."""
    run = _run_folder(tmp_path, diloco=True)
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 1e308, "loss/total": 1.0}) + "\n")
        f.write(json.dumps({"step": -1e308, "loss/total": 1.0}) + "\n")
        f.write("[" * 100_000 + "]" * 100_000 + "\n")
        f.write('{"a": ' * 50_000 + "1" + "}" * 50_000 + "\n")
        f.write('"just a string"\nnull\n')
        f.write('{"step": 7, "loss/total": 0.2, "loss/grpo": NaN, "loss/jsd": Infinity, "reward/mean": 1e308, "diloco/restarts": -1e308}\n')
        f.write('{"step": 99999999999999999999999999999999, "loss/total": 1.0}\n')
    summary = json.loads((run / "summary.json").read_text())
    summary.update(restarts=["1", 2], diloco_events=[{"step": 1e308}, "x", {"step": "2"}], steps="many",
                   channel_nonzero_steps={"loss/grpo": {"deep": 1}}, wall_time_s=float("inf"))
    (run / "summary.json").write_text(json.dumps(summary))
    assert main([str(run)]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("report warning:") >= 8
    assert "'restarts' ignored" in err and "clipped" in err
    assert (run / "report.png").read_bytes()[:8] == PNG_MAGIC
    rec = load_run(run)
    assert all(abs(r["step"]) < 1e12 for r in rec.train) and rec.series("reward/mean")[1][-1] == 1e12


def test_nothing_usable_is_exit_2_with_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1e308, "loss/total": 1}\n' + "[" * 100_000 + "\n")
    assert main([str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("report error:") and "no usable training step" in err[-1]
    assert all(line.startswith("report ") for line in err) and not (run / "report.png").exists()


def test_recipe_report_line_never_raises(tmp_path):
    run = _run_folder(tmp_path)
    assert recipe_report(run) == f"report {run / 'report.png'}"
    assert (run / "report.png").read_bytes()[:8] == PNG_MAGIC
    assert recipe_report(tmp_path / "gone").startswith("no report picture: run folder")
    (run / "metrics.jsonl").open("a").write("[\n")
    assert recipe_report(run).endswith("(1 damaged line(s) or value(s) skipped or clipped)")

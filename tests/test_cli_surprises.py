"""No surprises: a finished run's ``--resume`` says how to extend it, counts below 1 are refused,
a demo folder is not mixed with another demo's runs, a failed start leaves no folder, the demo
says how long it will take, and progress in a log file is a few lines, not thousands."""

import pytest
import yaml

from timlab import cli
from timlab.errors import UsageError
from timlab.experiments.reports import demo


def test_resume_of_a_finished_run_says_so_and_how_to_extend_it(tmp_path, capsys):
    d = tmp_path / "r"
    assert cli.main(["train", "--preset", "smoke", "--run-dir", str(d), "--quiet"]) == 0
    capsys.readouterr()
    assert cli.main(["train", "--run-dir", str(d), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "already finished at step 4 of run.steps=4; nothing to train" in out
    assert "--resume --set run.steps=N (N > 4)" in out and out.startswith("done: step=4,")
    assert cli.main(["train", "--run-dir", str(d), "--resume", "--set", "run.steps=5", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "done: step=5" in out and "already finished" not in out


def test_a_failed_start_leaves_no_run_folder(tmp_path, capsys):
    d = tmp_path / "new"
    assert cli.main(["train", "--preset", "smoke", "--run-dir", str(d), "--set", f"model.path={tmp_path / 'none'}"]) == 2
    assert "not a model folder" in capsys.readouterr().err
    assert not d.exists()
    mine = tmp_path / "mine"  # a folder the user made is kept, without the lock file
    mine.mkdir()
    assert cli.main(["train", "--preset", "smoke", "--run-dir", str(mine), "--set", f"model.path={tmp_path / 'none'}"]) == 2
    assert mine.is_dir() and list(mine.iterdir()) == []


@pytest.mark.parametrize("argv", [["--seeds", "0"], ["--steps", "0"], ["--workers", "0"], ["--steps", "-3"]])
def test_demo_refuses_counts_below_one(tmp_path, capsys, argv):
    out = tmp_path / "demo"
    assert cli.main(["demo", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{argv[0]} must be an integer >= 1, got {int(argv[1])}" in err
    assert not out.exists()


def test_demo_refuses_a_folder_with_another_demo_unless_forced(tmp_path):
    out = tmp_path / "demo"
    (out / "runs" / "some_run").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / demo.SPEC_FILE).write_text(yaml.safe_dump(demo.demo_spec(quick=True)))
    with pytest.raises(UsageError, match=r"holds a demo with other settings \(4 conditions x 2 seeds, 60 steps; "
                                         r"now 4 conditions x 3 seeds, 60 steps\).*--force"):
        demo.run_demo(out, quick=True, seeds=3)
    assert (out / "runs" / "some_run").is_dir()
    demo._claim_folder(out, demo.demo_spec(quick=True, workers=7), force=False)  # same demo (workers aside): continue
    demo._claim_folder(out, demo.demo_spec(quick=True, seeds=3), force=True)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_demo_prints_an_estimate_before_it_starts(monkeypatch, capsys):
    def stop(**_):
        raise UsageError("stopped after the estimate")

    monkeypatch.setattr(demo, "run_demo", stop)
    assert cli.main(["demo", "--workers", "2"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("demo: 45 runs x 150 steps; estimate 7 min-14 min on an idle machine")
    assert demo.estimate_seconds(workers=2) == (45, 150, (405.0, 843.75))  # 0.12-0.25 CPU s per step
    assert demo.estimate_seconds(quick=True, workers=2) == (8, 60, pytest.approx((28.8, 60.0)))
    assert demo.estimate_seconds(seeds=1, steps=10, workers=1)[:2] == (9, 10)


def test_progress_without_a_terminal_prints_a_few_lines(capsys):
    prog = cli.PhaseBars()
    for i in range(1, 201):
        prog("train", i, 200, {"train/reward_mean": 0.5})
    prog.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["train: 1/200  reward=0.5", "train: 200/200  reward=0.5"]
    sweep = cli.SweepProgress()
    for i in range(1, 4):
        sweep("train:a", i, 3, {})
        sweep("sweep", i, 3, {"run_id": f"r{i}", "state": "finished", "mode": "fresh"})
    sweep.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["r1: finished (fresh)", "r2: finished (fresh)", "runs: 2/3  a train 2/3", "r3: finished (fresh)",
                     "runs: 3/3  a train 3/3"]


def test_demo_names_the_torch_and_cpu_capability_it_computed_with(tmp_path, monkeypatch, capsys):
    """Which published table applies: the demo's output and its report's opening say it."""
    import pandas as pd
    import torch

    from timlab.experiments.reports import report

    from timlab.experiments.sweeps import runner as sweep
    from timlab.trainer import pretrain

    seen = {}

    def fake_report(inputs, out_html, **kwargs):
        seen.update(kwargs)
        return report.ReportResult(path=out_html, n_runs=0, missing=[])

    monkeypatch.setattr(pretrain, "pretrain", lambda *a, **k: None)
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: pd.DataFrame())
    monkeypatch.setattr(demo, "summarize", lambda *a: (pd.DataFrame({"a": [1]}), pd.DataFrame({"b": [2]})))
    monkeypatch.setattr(report, "build_report", fake_report)
    monkeypatch.setattr(demo, "format_summary", lambda effects, table: "(tables)")
    assert cli.main(["demo", "--quick", "--quiet", "--out", str(tmp_path / "d")]) == 0
    from timlab.machine import cpu_vendor, fingerprint

    machine = (f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {cpu_vendor()}, "
               f"fingerprint {fingerprint()}")
    out = capsys.readouterr().out
    assert f"\ncomputed with {machine}: runs repeat bit for bit on machines with the same fingerprint" in out
    assert "has the demo's tables for AVX2 and docs/demo.md for AVX512" in out
    assert seen["note"].startswith(f"Computed with {machine}: runs repeat bit for bit")

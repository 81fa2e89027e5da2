"""Reading the model's text: ``run.log_samples`` writes the greedy validation replies of each
evaluation to samples.jsonl (the ones val/accuracy scored, without changing any number of the
run), and ``timlab probe --show N`` prints N replies."""

from __future__ import annotations

import json

import pandas as pd

from timlab.cli import main
from timlab.config import resolve
from timlab.rundir import RunDir
from timlab.rundir.metrics_log import without_timings
from timlab.trainer.run import train

N_VAL = resolve(preset="smoke").task.n_val


def _train(run_dir, **run):
    cfg = resolve(preset="smoke", overrides={"run": run})
    return train(cfg, run_dir)


def test_log_samples_writes_the_replies_val_accuracy_scored_and_changes_nothing(tmp_path):
    _train(tmp_path / "plain")
    _train(tmp_path / "logged", log_samples=N_VAL)
    assert not (tmp_path / "plain" / "samples.jsonl").exists()
    plain = without_timings(pd.read_parquet(tmp_path / "plain" / "metrics.parquet"))
    logged = without_timings(pd.read_parquet(tmp_path / "logged" / "metrics.parquet"))
    pd.testing.assert_frame_equal(plain, logged)  # bit for bit: logging decodes nothing the run uses

    samples = RunDir(tmp_path / "logged").read_samples()
    evals = plain.dropna(subset=["val/accuracy"]).set_index("step")["val/accuracy"]
    assert list(evals.index) == [0, 2, 4]  # smoke: 4 steps, eval_every 2
    assert [s["step"] for s in samples] == [step for step in evals.index for _ in range(N_VAL)]
    for step, acc in evals.items():
        rows = [s for s in samples if s["step"] == step]
        assert sum(s["reward"] == 1.0 for s in rows) / N_VAL == acc  # the very replies val/accuracy counted
        assert [s["prompt"] for s in rows] == [s["prompt"] for s in samples[:N_VAL]]  # the same prompts each time
        for s in rows:
            assert set(s) == {"step", "prompt", "reply", "reference", "reward", "finished"}
            assert s["prompt"].startswith("rev:") and s["reward"] == float(s["finished"] and s["reply"] == s["reference"])


def test_log_samples_resume_keeps_one_line_per_sample(tmp_path):
    d = tmp_path / "r"
    _train(d, log_samples=2)
    cfg = resolve(preset="smoke", overrides={"run": {"log_samples": 2, "steps": 6}})
    train(cfg, d, resume=True)
    assert [s["step"] for s in RunDir(d).read_samples()] == [0, 0, 2, 2, 4, 4, 6, 6]


def test_probe_show_prints_the_replies(tmp_path, capsys):
    from timlab.trainer.pretrain import pretrain

    model = pretrain(resolve(preset="smoke")).path
    capsys.readouterr()
    out = tmp_path / "p.json"
    assert main(["probe", "--model", str(model), "--task", "reverse", "--num-prompts", "3", "--samples-per-prompt",
                 "2", "--max-new-tokens", "8", "--show", "4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    replies = json.loads(out.read_text())["replies"]
    assert len(replies) == 4 and replies[0]["prompt"] == replies[1]["prompt"] != replies[2]["prompt"]
    assert "  replies (the first 4 of 6):" in text
    for x in replies:
        assert x["prompt"].startswith("rev:") and x["max_abs_diff"] == 0.0  # exact vs trainer: bitwise
        assert 1 <= x["tokens"] <= 8 and len(x["reply"]) <= x["tokens"]
        end = "EOS" if x["finished"] else "no EOS"
        assert f"    {x['prompt']!r} -> {x['reply']!r}  ({x['tokens']} tokens, {end}, max |r| 0)" in text
    assert main(["probe", "--model", str(model), "--task", "reverse", "--show", "-1"]) == 2
    assert "show must be an integer >= 0, got -1" in capsys.readouterr().err


def test_a_fresh_run_leaves_a_samples_file_it_did_not_write_alone(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "samples.jsonl").write_text("the user's own file\n")
    assert main(["train", "--preset", "smoke", "--run-dir", str(run), "--quiet"]) == 2
    assert "holds samples.jsonl, which this run did not write" in capsys.readouterr().err
    assert (run / "samples.jsonl").read_text() == "the user's own file\n"

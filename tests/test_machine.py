"""Pinning the CPU instruction set: `timlab --isa avx2`, a sweep spec's `isa`, and the record each
checkpoint keeps of what computed it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from timlab import cli, machine
from timlab.errors import UsageError
from timlab.experiments import sweep
from timlab.experiments.sweep_spec import SweepError, spec_from_dict
from timlab.rundir.checkpoint import latest_checkpoint, load_state

REPO = Path(__file__).resolve().parent.parent


def test_pin_env_asks_for_a_change_only_when_the_pin_is_missing():
    assert machine.pin_env("native", {}) is None
    assert machine.pin_env("avx2", dict(machine.PIN_ENV)) is None
    env = machine.pin_env("avx2", {"HOME": "/h", "MKL_ENABLE_INSTRUCTIONS": "AVX512"})
    assert env == {"HOME": "/h", **machine.PIN_ENV}
    with pytest.raises(UsageError, match=r"--isa 'sse'; valid choices: native, avx2"):
        machine.pin_env("sse", {})


def test_resume_note_names_what_differs_and_stays_quiet_otherwise():
    here = machine.describe()
    assert machine.resume_note(None) is None  # a checkpoint from before the record
    assert machine.resume_note(dict(here)) is None
    other = "AVX512" if here["cpu_capability"] != "AVX512" else "AVX2"
    note = machine.resume_note({**here, "cpu_capability": other})
    assert note.startswith(f"resuming on another instruction set or torch (cpu_capability {other} there, "
                           f"{here['cpu_capability']} here)")
    assert "not bit for bit" in note and "--isa avx2" in note


def test_cli_isa_in_process_after_torch_loaded_is_a_one_line_error(monkeypatch, capsys):
    for k in machine.PIN_ENV:
        monkeypatch.delenv(k, raising=False)
    assert "torch" in sys.modules
    assert cli.main(["--isa", "avx2", "runs", "no_such_dir"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("timlab: error: --isa avx2 must be in the environment before torch loads: ")
    assert "ATEN_CPU_CAPABILITY=avx2" in err and "\n" not in err


def test_cli_isa_avx2_reexecs_pinned_and_the_checkpoint_records_it(tmp_path):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in machine.PIN_ENV}
    env.update(OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "timlab", "--isa", "avx2", "train", "--preset", "smoke", "--run-dir",
                          str(run), "--quiet", "--set", "run.steps=2", "--set", "run.checkpoint_every=2",
                          "--set", "run.eval_every=2"], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    state = load_state(latest_checkpoint(run / "checkpoints"))
    assert state["machine"]["pinned_avx2"] is True
    assert state["machine"]["cpu_capability"] in ("AVX2", "DEFAULT")  # DEFAULT only on a CPU without AVX2
    assert state["machine"]["torch"] == torch.__version__


def test_sweep_spec_isa_is_checked_and_refused_unpinned(monkeypatch, tmp_path):
    spec = {"base": {"preset": "smoke", "set": {"run.steps": 1}}, "isa": "avx2"}
    assert spec_from_dict(spec).isa == "avx2"
    assert spec_from_dict({k: v for k, v in spec.items() if k != "isa"}).isa == "native"
    with pytest.raises(SweepError, match=r"isa 'avx512'; valid choices: native, avx2"):
        spec_from_dict({**spec, "isa": "avx512"})
    with pytest.raises(SweepError, match="isa avx2 needs the local executor"):
        spec_from_dict({**spec, "executor": "ray"})
    monkeypatch.setattr(sweep, "computes_as", lambda isa: isa == "native")
    with pytest.raises(SweepError, match=r"isa avx2, but this process computes with \w+: run it as "
                                         r"`timlab --isa avx2 sweep \.\.\.`"):
        sweep.run_sweep(spec, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is written
    monkeypatch.setattr(sweep, "describe_machine", lambda: {"torch": "x", "cpu_capability": "DEFAULT", "pinned_avx2": True})
    with pytest.raises(SweepError, match=r"computes with DEFAULT even pinned: the spec's bits need an x86 CPU with AVX2"):
        sweep.run_sweep(spec, tmp_path / "out")


def test_resume_under_another_instruction_set_warns_and_goes_on(monkeypatch, tmp_path):
    from timlab.config import resolve
    from timlab.trainer import run as run_mod

    cfg = resolve(preset="smoke", overrides=["run.steps=2", "run.checkpoint_every=2", "run.eval_every=2"])
    here = machine.describe()
    other = "AVX512" if here["cpu_capability"] != "AVX512" else "AVX2"
    monkeypatch.setattr(run_mod, "describe_machine", lambda: {**here, "cpu_capability": other})
    run_mod.train(cfg, tmp_path / "r")
    monkeypatch.undo()
    longer = resolve(preset="smoke", overrides=["run.steps=3", "run.checkpoint_every=2", "run.eval_every=2"])
    with pytest.warns(UserWarning, match=rf"resuming on another instruction set or torch \(cpu_capability {other} "
                                         rf"there, {here['cpu_capability']} here\)"):
        out = run_mod.train(longer, tmp_path / "r", resume=True)
    assert out["step"] == 3


def test_42_12_bits_names_what_a_process_computes(monkeypatch):
    """The label a sweep folder records: equal exactly when two processes compute the same bits."""
    here = {"torch": "2.x", "pinned_avx2": False}
    cases = [("AVX512", False, None, "AVX512"), ("AVX2", True, True, "avx2"), ("AVX2", False, False, "avx2"),
             ("AVX2", False, True, "AVX2 (oneDNN and MKL not capped)"),
             ("AVX2", False, None, "AVX2 (oneDNN and MKL not capped)"), ("DEFAULT", False, False, "DEFAULT")]
    for capability, pinned, avx512, want in cases:
        monkeypatch.setattr(machine, "describe", lambda c=capability, p=pinned: {**here, "cpu_capability": c,
                                                                                "pinned_avx2": p})
        monkeypatch.setattr(machine, "_cpu_has_avx512", lambda a=avx512: a)
        assert machine.bits() == want, (capability, pinned, avx512)

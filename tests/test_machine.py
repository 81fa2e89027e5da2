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
from timlab.experiments.sweeps import runner as sweep
from timlab.experiments.sweeps.spec import SweepError, spec_from_dict
from timlab.rundir.checkpoint import latest_checkpoint, load_state

REPO = Path(__file__).resolve().parent.parent


def test_the_pin_adds_mkl_strict_reproducibility_on_intel_only(tmp_path):
    assert machine.pin_vars("AuthenticAMD") == machine.AVX2_CAPS
    assert machine.pin_vars("GenuineIntel") == {**machine.AVX2_CAPS, "MKL_CBWR": "AVX2,STRICT"}
    assert machine.PIN_ENV == machine.pin_vars(machine.cpu_vendor())
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 avx512f\n")
    assert machine.cpu_vendor(str(info)) == "GenuineIntel" and machine._cpu_has_avx512(str(info)) is True
    assert machine.cpu_vendor(str(tmp_path / "absent")) is None


def test_the_plug_ins_leave_mkl_and_onednn_alone_and_the_model_sets_them():
    """A TRL/verl user's process keeps MKL's and oneDNN's own settings (AMX bf16 is 5-13x faster on the
    Intel machine); importing the exact path's code (timlab.model) applies ``exact_cpu_env``."""
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "ONEDNN_MAX_CPU_ISA")}
    code = ("import os, timlab.integrations.trl, timlab.metrics, timlab.remedies, timlab.schedulers; "
            "a = {k: os.environ.get(k) for k in ('MKL_CBWR', 'ONEDNN_MAX_CPU_ISA')}; import timlab.model; "
            "b = {k: os.environ.get(k) for k in ('MKL_CBWR', 'ONEDNN_MAX_CPU_ISA')}; print(repr((a, b)))")
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    before, after = eval(res.stdout)
    assert before == {"MKL_CBWR": None, "ONEDNN_MAX_CPU_ISA": None}
    want = machine.exact_cpu_env()
    assert after == {k: want.get(k) for k in ("MKL_CBWR", "ONEDNN_MAX_CPU_ISA")}


def test_exact_cpu_env_names_what_intel_and_amx_need_and_prepare_keeps_the_users_settings():
    assert machine.exact_cpu_env("AuthenticAMD", "fpu avx2 avx512f avx512_bf16") == {}
    assert machine.exact_cpu_env("GenuineIntel", "fpu avx2") == {"MKL_CBWR": "AUTO,STRICT"}
    assert machine.exact_cpu_env("GenuineIntel", "avx512f amx_bf16 amx_tile") == {
        "MKL_CBWR": "AUTO,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_FP16"}
    want = machine.exact_cpu_env()
    env = {"MKL_CBWR": "AVX2,STRICT"}  # e.g. the pin: a setting already there stays
    added = machine.prepare_exact_cpu(env)
    assert env == {**want, "MKL_CBWR": "AVX2,STRICT"} and added == {k: v for k, v in want.items() if k != "MKL_CBWR"}
    import timlab.model  # noqa: F401  (importing the exact path's code sets this process's)

    assert all(os.environ.get(k) is not None for k in want)
    env = {machine.KEEP_CPU_ENV: "1"}
    assert machine.prepare_exact_cpu(env) == {} and env == {machine.KEEP_CPU_ENV: "1"}  # the user's opt-out


_ROWS_PROBE = """
from timlab import machine
from timlab.model.ops import row_violations
bad = row_violations()
print(machine.fingerprint(), len(bad), bad[:5])
"""


def _probe(env: dict) -> tuple[str, int, str]:
    res = subprocess.run([sys.executable, "-c", _ROWS_PROBE], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    fp, n_bad, first = res.stdout.strip().split(" ", 2)
    return fp, int(n_bad), first


def test_pinned_fp32_linears_are_row_invariant_and_the_fingerprint_names_the_pin():
    """The exact path's shape rule 1 (a row has the same bits at every row count >= MIN_ROWS) holds
    under the pin on this machine; on an Intel CPU it needs INTEL_STRICT (measured on a Sapphire
    Rapids-class Xeon: 222 of the probe's 565 (K, N, M) cases differ with AVX2_CAPS alone). The fingerprint repeats across processes, and tells the pinned
    process from the native one wherever the pin changes the kernels (an AVX-512 CPU)."""
    base = {k: v for k, v in os.environ.items() if k not in machine.PIN_ENV}
    base.update(OMP_NUM_THREADS="1")
    pinned_fp, n_bad, first = _probe({**base, **machine.PIN_ENV})
    assert n_bad == 0, f"pinned: rows differ at (K, N, M) {first}"
    assert _probe({**base, **machine.PIN_ENV})[0] == pinned_fp
    native_fp, n_bad, first = _probe(base)
    assert n_bad == 0, f"native: rows differ at (K, N, M) {first}"
    assert len(pinned_fp) == 12 and int(pinned_fp, 16) >= 0
    if machine._cpu_has_avx512():
        assert native_fp != pinned_fp
    assert machine.fingerprint() == machine.fingerprint() == machine.describe()["fingerprint"]


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
    amd, intel = "AuthenticAMD", "GenuineIntel"
    cases = [("AVX512", False, None, amd, False, "AVX512"), ("AVX2", True, True, amd, False, "avx2"),
             ("AVX2", False, False, amd, False, "avx2"), ("AVX2", False, True, amd, False, "AVX2 (oneDNN and MKL not capped)"),
             ("AVX2", False, None, amd, False, "AVX2 (oneDNN and MKL not capped)"), ("DEFAULT", False, False, amd, False, "DEFAULT"),
             # MKL dispatches by vendor: an Intel CPU pinned to AVX2 computes other bits than an AMD one
             ("AVX2", True, True, intel, True, "avx2-intel"), ("AVX2", False, False, intel, False, "avx2-intel (MKL not strict)"),
             ("AVX512", False, True, intel, False, "AVX512")]
    for capability, pinned, avx512, vendor, strict, want in cases:
        monkeypatch.setattr(machine, "describe", lambda c=capability, p=pinned: {**here, "cpu_capability": c,
                                                                                "pinned_avx2": p})
        monkeypatch.setattr(machine, "_cpu_has_avx512", lambda a=avx512: a)
        monkeypatch.setattr(machine, "cpu_vendor", lambda v=vendor: v)
        if strict:
            monkeypatch.setenv("MKL_CBWR", machine.INTEL_STRICT["MKL_CBWR"])
        else:
            monkeypatch.delenv("MKL_CBWR", raising=False)
        assert machine.bits() == want, (capability, pinned, avx512, vendor, strict)


def test_version_under_the_pin_prints_the_pinned_bits_fingerprint():
    """`timlab --isa avx2 --version` re-executes pinned first, so its fingerprint is the one a pinned
    run computes with (the one a study block or a sweep folder records)."""
    env = {k: v for k, v in os.environ.items() if k not in machine.PIN_ENV}
    env.update(OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "timlab", "--isa", "avx2", "--version"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    pinned = subprocess.run([sys.executable, "-c", "from timlab.machine import fingerprint, bits; print(fingerprint(), "
                                                   "bits())"], env={**env, **machine.pin_env("avx2")}, cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    fp, label = pinned.stdout.split()
    assert out.stdout.strip().endswith(f"fingerprint {fp})") and "CPU capability AVX2" in out.stdout
    assert label in machine.PINNED_LABELS
    assert cli.main(["--isa", "avx2", "--version"]) == 2  # in-process, torch loaded: the one-line refusal

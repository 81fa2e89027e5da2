"""The CLI explains itself: help without torch, names and defaults read from their one home,
``timlab config`` listing every key, examples that parse, and the options that used to surprise
(``--task`` with a preset, ``--sort -COL``, ``--where`` on an unknown column)."""

import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pandas as pd
import pytest

import timlab
from timlab import catalog, cli
from timlab.config import PRESETS, SECTIONS, resolve

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = sorted(cli.build_parser()._subparsers._group_actions[0].choices)


def _registries() -> dict:
    from timlab.engines import ENGINES
    from timlab.injectors import INJECTORS
    from timlab.remedies.importance import IS_LEVELS, IS_MODES
    from timlab.schedulers import SCHEDULERS
    from timlab.tasks import TASKS
    from timlab.trainer.advantages import ADVANTAGES

    return {"task": TASKS, "engine": ENGINES, "injector": INJECTORS, "scheduler": SCHEDULERS,
            "advantage": ADVANTAGES, "is_level": IS_LEVELS, "is_mode": IS_MODES}


@pytest.mark.parametrize("kind", sorted(catalog.KINDS))
def test_catalog_names_equal_the_live_registries(kind):
    live = set(_registries()[kind].names()) | set(catalog.EXTRA_NAMES.get(kind, ()))
    assert set(catalog.names(kind)) == live


def test_function_defaults_equal_the_signatures():
    import inspect

    from timlab.experiments.diagnostics.probe import run_probe
    from timlab.gradcheck.estimator import gradcheck

    for target, fn in (("timlab.experiments.diagnostics.probe:run_probe", run_probe), ("timlab.gradcheck.estimator:gradcheck", gradcheck)):
        read = catalog.function_defaults(target)
        for name, p in inspect.signature(fn).parameters.items():
            if p.default is not inspect.Parameter.empty and isinstance(p.default, (int, float, str, type(None))):
                assert read[name] == str(p.default), (target, name)


def test_every_help_renders_without_importing_torch():
    code = (f"import sys\nfrom timlab import cli\nfor argv in {[['--help']] + [[c, '--help'] for c in COMMANDS]!r}:\n"
            "    try:\n        cli.main(argv)\n    except SystemExit as e:\n        assert e.code == 0, argv\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "`" not in res.stdout and "{names:" not in res.stdout and "{default}" not in res.stdout
    assert "timlab: a lab for training-inference mismatch" in res.stdout
    assert res.stdout.count("examples:") == len(COMMANDS)


def _help(*argv) -> None:
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args([*argv, "--help"])
    assert e.value.code == 0



def test_helps_list_the_registered_names_and_defaults(capsys):
    _help("pretrain")
    out = capsys.readouterr().out
    assert ", ".join(catalog.names("task")) in " ".join(out.split())
    _help("gradcheck")
    out = " ".join(capsys.readouterr().out.split())
    assert "head_perturb" in out and "weight_rounding" in out and "(default 256)" in out
    _help("probe")
    out = " ".join(capsys.readouterr().out.split())
    assert "rollout engine: exact, fast, hf, vllm (default exact)" in out and "rev:abc=" in out
    _help("train")
    out = capsys.readouterr().out
    assert "--quiet" in out and "no progress bars" in out and "examples:" in out


def test_version_is_the_package_version_and_pyproject_reads_it(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    import torch

    text = capsys.readouterr().out.strip()
    from timlab import machine

    assert text == f"timlab {timlab.__version__} (torch {torch.__version__}, CPU capability " \
                   f"{torch.backends.cpu.get_cpu_capability()}, {machine.cpu_vendor()}, fingerprint {machine.fingerprint()})"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "timlab.__version__"}


@pytest.mark.parametrize("command", sorted(cli.EXAMPLES))
def test_help_examples_parse(command):
    assert command in COMMANDS
    for example in cli.EXAMPLES[command]:
        argv = shlex.split(example)
        assert argv[0] == "timlab"
        args = cli.build_parser().parse_args(cli._join_dash_values(argv[1:]))
        assert args.command == command


def test_config_lists_every_key_with_type_default_and_help(capsys):
    assert cli.main(["config"]) == 0
    out = capsys.readouterr().out
    keys = catalog.config_keys()
    assert len(keys) == sum(len(cls.__dataclass_fields__) for cls in SECTIONS.values())
    for k in keys:
        assert k.help, f"{k.key} has no docstring in timlab/config.py"
        assert f"{k.key}  ({k.type}) = " in out
    assert "optim.lr  (float) = 3e-05" in out
    assert f"Valid: {', '.join(catalog.names('task'))}." in " ".join(out.split())
    assert cli.main(["config", "optim.lr", "--preset", "demo", "--set", "optim.lr=0.5"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "optim.lr  (float) = 0.5  * (default 3e-05)"
    assert cli.main(["config", "nosuch"]) == 2
    assert "valid sections: algorithm, correction" in capsys.readouterr().err
    assert cli.main(["config", "optim.lrr"]) == 2
    assert capsys.readouterr().err == ("timlab: error: unknown config key 'optim.lrr'; valid keys of optim: lr, "
                                       "weight_decay, beta1, beta2, eps, grad_clip\n")


@pytest.mark.parametrize("value", ["correction.rs=bogus", "model.dtype=float64", "run.device=cuda:-1",
                                   "algorithm.loss_agg=nope", "mismatch.injector=nope"])
def test_42_20_config_set_refuses_what_train_refuses_with_the_same_line(value, tmp_path, capsys):
    """Issue 42, finding 20: `timlab config --set` printed values that `train` then refused."""
    assert cli.main(["train", "--preset", "smoke", "--run-dir", str(tmp_path / "r"), "--set", value]) == 2
    train_err = capsys.readouterr().err.strip()
    assert cli.main(["config", "--preset", "smoke", "--set", value]) == 2
    cap = capsys.readouterr()
    assert cap.err.strip() == train_err and train_err.startswith("timlab: error: ") and "\n" not in train_err
    assert cap.out == "" and not (tmp_path / "r").exists()


def test_task_option_drops_another_tasks_preset_kwargs():
    assert PRESETS["smoke"]["task"]["kwargs"]  # the preset sets reverse's kwargs
    assert resolve(preset="smoke", task="countdown").task.kwargs == {}
    assert resolve(preset="smoke", task="countdown").task.name == "countdown"
    assert resolve(preset="smoke", task="reverse").task.kwargs == PRESETS["smoke"]["task"]["kwargs"]
    cfg = resolve(preset="smoke", overrides=["task.kwargs.max_target=50"], task="countdown")
    assert cfg.task.kwargs == {"max_target": 50}  # --set still applies after --task
    # --set task.name keeps the options the new task takes (a YAML or sweep may rely on it) ...
    assert resolve(preset="smoke", overrides=["task.name=sort"]).task.kwargs == PRESETS["smoke"]["task"]["kwargs"]
    # ... and drops the preset's options it does not take (dataset has no min_len/max_len)
    assert PRESETS["smoke"]["task"]["kwargs"] == {"min_len": 2, "max_len": 6}
    assert resolve(preset="smoke", overrides=["task.name=dataset"]).task.kwargs == {}
    assert resolve(preset="smoke", overrides=["task.name=dataset", "task.kwargs.verifier=exact"]).task.kwargs == {
        "verifier": "exact"}
    assert resolve(preset="smoke", overrides={"task": {"name": "countdown"}}).task.kwargs == {}


def _index(tmp_path) -> Path:
    pd.DataFrame({"run_id": ["a", "b", "c"], "final_accuracy": [0.2, 0.9, 0.5],
                  "mismatch.magnitude": [0.0, 1.0, 2.0]}).to_parquet(tmp_path / "index.parquet")
    return tmp_path


def test_runs_sort_descending_with_a_leading_dash(tmp_path, capsys):
    d = _index(tmp_path)
    assert cli.main(["runs", str(d), "--columns", "run_id,final_accuracy", "--sort", "-final_accuracy"]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:4]]
    assert rows == ["b", "c", "a"]
    assert cli._join_dash_values(["--set", "-x", "--sort", "-y", "--sort", "z"]) == ["--set", "-x", "--sort=-y", "--sort", "z"]


def test_where_on_an_unknown_column_lists_the_columns(tmp_path, capsys):
    d = _index(tmp_path)
    assert cli.main(["runs", str(d), "--where", "nosuch > 1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "columns: run_id, final_accuracy, mismatch.magnitude" in err


def test_package_data_matches_the_tree():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for package, patterns in project["tool"]["setuptools"]["package-data"].items():
        for pattern in patterns:
            assert list((ROOT / package).glob(pattern)), f"package data {package}/{pattern} matches no file"

"""The README's commands work as written: every command line of the bash blocks of the README and
of the docs pages its walk-throughs moved to (COMMAND_PAGES) is either run here on a tiny budget
(the smoke preset, a few steps, a two-run sweep) or skipped for a stated reason, and a command this
file does not know fails the test. Also: what those commands write is ignored by git, and the docs
name every preset and task."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from timlab import catalog, cli
from timlab.config import PRESETS, VERL_PRESETS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
COMMAND_PAGES = (README, *(ROOT / "docs" / f"{name}.md" for name in ("cli", "surge", "realistic", "own-data")))
"""The README, then the pages that hold its longer walk-throughs, in the order their commands run."""
CLI_DOC = ROOT / "docs" / "cli.md"
"""The CLI walk-through: it holds the prompt formats."""


def readme_commands(text: str) -> list[str]:
    """Every command of a page's ```bash blocks: continuation lines joined, comments and
    blank lines dropped, whitespace collapsed."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()))
    return commands


def all_commands() -> list[str]:
    """The commands of COMMAND_PAGES in order, each once (the README's short CLI repeats lines of
    docs/cli.md's walk-through)."""
    return list(dict.fromkeys(c for page in COMMAND_PAGES for c in readme_commands(page.read_text())))


@dataclass(frozen=True)
class Step:
    """How the test treats README commands that match ``pattern`` (a regex, matched whole)."""

    pattern: str
    skip: str = ""
    """Why it is not run here (empty: it is run)."""
    replace: tuple[tuple[str, str], ...] = ()
    """Substitutions that shrink it to a tiny budget."""
    add: tuple[str, ...] = ()
    """Options appended for a tiny budget."""


SMOKE = (("--preset default", "--preset smoke"), ("--preset demo", "--preset smoke"))
MODEL = ("--set", "model.path=models/reverse")
"""RL from the model the README's pretrain command made (20 SFT steps here), not a fresh warm start."""
CURRICULUM = ("--set", "model.pretrain_steps=3", "--set", "task.n_val=4", "--quiet")
"""docs/cli.md's two-stage curriculum at 3 SFT steps a stage, validated on 4 prompts."""
PLAN = (
    Step(r"make (demo|test)", skip="installs a venv; `make test` runs this suite, `make demo` the demo (minutes)"),
    Step(r"timlab (--isa avx2 )?sweep docs/examples/(surge_claims|threshold|threshold_d16|erosion)\.yaml .*",
         skip="hours on 2 cores; the results are committed under sweeps/"),
    Step(r"python scripts/findings_tables\.py .*", skip="a script, not the CLI; ~15 s over the committed sweep"),
    Step(r"python scripts/make_tiny_chat_model\.py .*", skip="a script, not the CLI; tests/test_dataset_task.py uses it"),
    Step(r"timlab train wp\.yaml .*", skip="needs docs/own-data.md's wp.yaml and its data file; tests/test_dataset_task.py "
                                           "trains on a dataset"),
    Step(r"timlab demo \[.*", skip="a synopsis; the demo takes minutes (tests/test_cli_surprises.py checks its options)"),
    Step(r"torchrun .*", skip="two processes; tests/test_trainer.py runs data parallel"),
    Step(r"timlab train .* \.\.\.", skip="options elided"),
    Step(r".*(/path/to/|--device cuda|run\.device=cuda).*", skip="needs a GPU and a real model"),
    Step(r"timlab pretrain --task reverse --out models/reverse",
         add=("--preset", "smoke", "--set", "model.pretrain_steps=20", "--quiet")),
    Step(r"timlab pretrain --preset surge --set task\.kwargs\.restate=1 .* --out models/r1", add=CURRICULUM),
    Step(r"timlab pretrain --preset surge --set task\.kwargs\.restate=31 .* --out models/r31",
         replace=(("restate=31", "restate=2"),), add=CURRICULUM),  # restate 31's answers: 13x the SFT step
    Step(r"timlab probe --model models/reverse --task .*", add=("--num-prompts", "2", "--max-new-tokens", "6")),
    Step(r"timlab probe --model models/reverse --prompts .*", add=("--max-new-tokens", "6")),
    Step(r"timlab train --preset (default|demo) --run-dir runs/r[01]( .*)?", replace=SMOKE, add=(*MODEL, "--quiet")),
    Step(r"timlab train --run-dir runs/r1 --resume"),
    Step(r"timlab train --preset surge --run-dir runs/(fp8|async|held|ramp) .*",
         replace=(("--preset surge", "--preset smoke"), ("mismatch.start_step=100", "mismatch.start_step=2")),
         add=(*MODEL, "--quiet")),  # smoke runs 4 steps: a ramp from step 100 would be refused (it would never act)
    Step(r"timlab sweep docs/examples/dose_response\.yaml --out sweeps/dose",
         replace=(("docs/examples/dose_response.yaml", "tiny_dose.yaml"),), add=("--quiet",)),
    Step(r"timlab (runs|report) sweeps/dose .*"),
    Step(r"timlab threshold .*", replace=((" sweeps/surge", ""), (" sweeps/threshold_d16", ""))),
    Step(r"timlab analyze .*"),
    Step(r"timlab gradcheck --preset demo .*", replace=SMOKE + (("--samples 1024", "--samples 64"), ("--buckets 4", "--buckets 1")),
         add=("--model", "models/reverse", "--quiet")),
    Step(r"timlab check --model models/reverse .*", add=("--batch-sizes", "1,8")),
    Step(r"timlab study check docs/examples/study_quickstart\.yaml"),
    Step(r"timlab study run docs/examples/study_quickstart\.yaml",
         skip="~40 CPU-seconds (bench/RESULTS.md); tests/test_study.py runs the engine and the command on planted sweeps"),
    Step(r"timlab study analyze docs/examples/study_quickstart\.yaml", skip="needs the quickstart's runs (study run)"),
    Step(r"timlab study analyze docs/examples/studies/erosion\.yaml",
         skip="~15 s over sweeps/erosion; tests/test_findings.py recomputes the same block (erosion-study)"),
    Step(r"timlab study analyze docs/examples/studies/e3b\.yaml",
         skip="~3 s over sweeps/e3b; tests/test_findings.py recomputes the same block (e3b-study)"),
    Step(r"timlab export runs/r1 --step 100 --out models/learned", replace=(("--step 100", "--step 4"),)),
    Step(r"timlab gradcheck --run-dir runs/r1 --step 100", replace=(("--step 100", "--step 4"),), add=("--quiet",)),
)


def _step(command: str) -> Step:
    matches = [s for s in PLAN if re.fullmatch(s.pattern, command)]
    assert len(matches) == 1, f"README command {command!r} matches {len(matches)} entries of PLAN: add one"
    return matches[0]


def _tiny(command: str, step: Step) -> list[str]:
    written = command
    for old, new in step.replace:
        command = command.replace(old, new)
    assert command != written or not step.replace, f"no substitution of {step.replace} applies to {written!r}"
    return shlex.split(command) + list(step.add)


def test_every_readme_command_is_planned_and_every_plan_is_used():
    commands = all_commands()
    assert len(commands) >= 20
    assert len(readme_commands(README.read_text())) >= 8  # the README keeps a short CLI of its own
    used = {_step(c).pattern for c in commands}
    assert used == {s.pattern for s in PLAN}, "PLAN entries that no README command matches"


def _outputs(argv: list[str]) -> list[str]:
    """The paths a command writes; folders end in '/' (git matches "dir/" patterns only to folders)."""
    flags = ("--out", "--json", "--html", "--plot", "--run-dir")
    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in flags]
    return [p if Path(p).suffix else p + "/" for p in paths]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_what_readme_commands_write_is_gitignored():
    outs = sorted({o for c in all_commands() if not _step(c).skip for o in _outputs(shlex.split(c))})
    outs += ["demo_out/", "demo_out_quick/", ".timlab_cache/"]
    assert "sweeps/dose/" in outs and "models/reverse/" in outs
    res = subprocess.run(["git", "check-ignore", "--no-index", *outs], cwd=ROOT, capture_output=True, text=True)
    assert sorted(res.stdout.split()) == sorted(outs), f"not ignored: {sorted(set(outs) - set(res.stdout.split()))}"


def _prompt_table(text: str) -> dict[str, str]:
    section = text[text.index("**Prompt files**"):]
    return dict(re.findall(r"^\| (\w+) \| `([^`]+)` \|", section, flags=re.M))


def test_readme_prompt_formats_are_the_tasks_own():
    import random

    from timlab.tasks import get_task

    table = _prompt_table(CLI_DOC.read_text())
    file_tasks = {"dataset"}  # prompts come from the user's file (docs name its columns)
    assert sorted(table) == sorted(set(catalog.names("task")) - file_tasks)
    for name, prompt in table.items():
        task = get_task(name)
        real = task.sample(random.Random(0), 1)[0].prompt  # e.g. add:66448162+43=
        prefix = real.split(":")[0] + ":" if ":" in real else ""
        shape = re.escape(prefix) + re.sub(r"\\?[a-z0-9]+", "[a-z0-9]+", re.escape(real[len(prefix):]))
        assert re.fullmatch(shape, prompt), (name, prompt, real)
        assert set(prompt) <= set(task.alphabet), (name, prompt)


def test_docs_name_every_testbed_preset():
    testbeds = [name for name in PRESETS if name not in VERL_PRESETS]
    sweeps_doc = (ROOT / "docs" / "sweeps.md").read_text()
    line = next(line for line in sweeps_doc.splitlines() if "# a preset:" in line)
    assert [p.strip() for p in line.split("# a preset:")[1].split(",")][:len(testbeds)] == testbeds
    assert f"`--preset` ({', '.join(testbeds)}" in " ".join(README.read_text().split())


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A folder laid out like the repository root, where outputs land in the test's tmp dir."""
    for name in ("docs", "timlab"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "sweeps").mkdir()
    for sweep in (ROOT / "sweeps").iterdir():
        (tmp_path / "sweeps" / sweep.name).symlink_to(sweep)
    spec = yaml.safe_load((ROOT / "docs/examples/dose_response.yaml").read_text())
    spec["base"] = {"preset": "smoke", "set": {"run.steps": 2, "model.path": str(tmp_path / "models/reverse")}}
    spec["conditions"] = spec["conditions"][-1:]
    spec["grid"] = {"run.seed": [0]}
    spec["workers"] = 1
    (tmp_path / "tiny_dose.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "prompts.txt").write_text(_prompt_table(CLI_DOC.read_text())["reverse"] + "\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_readme_commands_run_on_a_tiny_budget(workdir, capsys):
    ran = []
    for command in all_commands():
        step = _step(command)
        if step.skip:
            continue
        argv = _tiny(command, step)
        assert argv[0] == "timlab"
        code = cli.main(argv[1:])
        out = capsys.readouterr()
        assert code == 0, f"{' '.join(argv)} exited {code}: {out.err.strip()[-500:]}"
        ran.append(argv[1])
    assert ran.count("train") == 7 and ran.count("probe") == 2 and ran.count("gradcheck") == 2
    assert ran.count("runs") == 2 and (workdir / "models/learned/config.json").is_file()
    assert (workdir / "dose.html").is_file() and (workdir / "threshold.png").is_file()
    assert (workdir / "runs/r1/checkpoints").is_dir() and (workdir / "bias.png").is_file()
    stage2 = json.loads((workdir / "models/r31/pretrain.json").read_text())
    assert stage2["init"]["path"] == "models/r1" and stage2["init"]["pretrain"]["task_kwargs"]["restate"] == 1


def test_the_first_screen_is_what_timlab_is_then_the_two_commands_then_what_they_show():
    lines = README.read_text().splitlines()
    first = "\n".join(lines[:40])
    assert "```bash\nmake demo   #" in first and "\nmake test   #" in first  # the quickstart, whole
    assert first.index("A lab for training-inference mismatch") < first.index("make demo") \
        < first.index("**What you will see.**") < first.index("| `make demo`")
    text = "\n".join(lines)
    assert text.index("| `make test`") < text.index("**What it has found so far**")  # the findings come after
    assert "`$TIMLAB_CACHE` (default `~/.cache/timlab`)" in " ".join(text.split())
    assert (ROOT / "docs" / "timings.md").is_file() and "[docs/timings.md](docs/timings.md)" in first


def test_make_test_ends_on_a_summary_line():
    """Each pytest run in `make test` prints its own "N passed" line: pyproject's addopts already
    say -q, and a second -q (-qq) would end the output on a lone "." from the FINDINGS pass."""
    import tomllib

    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    recipe = re.search(r"^test:\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), flags=re.M).group(1)
    runs = [" ".join(line.split()) for line in recipe.replace("\\\n", " ").splitlines() if "-m pytest" in line]
    assert len(runs) == 2 and "tests/test_findings.py" in runs[1]
    for run in runs:
        quiet = sum(arg.count("q") for arg in (shlex.split(addopts) + run.split()) if re.fullmatch(r"-q+", arg))
        assert quiet <= 1, run
    assert "about 1,750 tests" in " ".join(README.read_text().split())


def test_the_quickstart_study_costs_the_same_everywhere():
    """README, the quickstart's own file, docs/studies.md and docs/timings.md give one measured cost."""
    def costs(text: str) -> set[str]:
        return set(re.findall(r"(\d+) CPU-s", " ".join(text.split())))

    quickstart = ROOT / "docs/examples/study_quickstart.yaml"
    studies = [line for line in (ROOT / "docs/studies.md").read_text().split(". ") if "study_quickstart" in line]
    readme = [line for line in README.read_text().splitlines() if "study run docs/examples/study_quickstart" in line]
    timings = [line for line in (ROOT / "docs/timings.md").read_text().splitlines() if "study_quickstart" in line]
    found = [costs(quickstart.read_text().replace("\n#", "\n")), costs(" ".join(studies)), costs(" ".join(readme)),
             set(re.findall(r"\| (\d+) s \|$", " ".join(timings)))]
    assert found == [{"16"}] * 4

"""The ``timlab`` command line. The only module that parses arguments or prints results.

Each subcommand is a thin wrapper: parse, call one library function, print what it returns.
Bad input (unknown names, missing files, malformed configs: a ``TimlabError``) and errors of the
environment (a full disk, a missing or unwritable path: an ``OSError``) end with one line on
stderr and exit code 2; anything else is a bug and keeps its traceback. ``--debug`` shows the
traceback in every case.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from timlab.errors import TimlabError, one_line
from timlab.files import check_output_file, write_json
from timlab.interrupts import Terminated, handle_sigterm
from timlab.machine import ISAS


class CLIError(TimlabError):
    """A user-facing error: printed as one line, exit code 2."""


QUIET = "no progress bars (results are still printed)"


def _set_threads() -> None:
    # Tiny models run fastest on one thread (measured: bench/RESULTS.md, "Measurements behind code comments").
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Help as the user reads it: descriptions and examples keep their line breaks, and an
    option's help may say ``{names:KIND}`` (the registered names of a kind, e.g. ``task``) or
    ``{default}`` (see ``_defaults_of``). Both are read from the source by ``timlab.catalog``
    when help is printed, so no help imports torch."""

    defaults_from: str | None = None

    def _expand_help(self, action: argparse.Action) -> str:
        import re

        from timlab import catalog

        text = super()._expand_help(action)
        text = re.sub(r"\{names:(\w+)\}", lambda m: ", ".join(catalog.names(m.group(1))), text)
        if "{default}" in text and self.defaults_from:
            text = text.replace("{default}", catalog.function_defaults(self.defaults_from)[action.dest])
        return text


def _defaults_of(target: str) -> type[argparse.HelpFormatter]:
    """A help formatter that fills ``{default}`` in an option's help with the default of the
    keyword argument named like the option's dest in ``target`` ("module:function"), read from
    the function's source when help is printed (nothing is imported)."""
    return type("Formatter", (_Formatter,), {"defaults_from": target})


def _given(args: argparse.Namespace, names) -> dict:
    """The options among ``names`` that the user set (argparse default None), as keyword
    arguments: a library function's own defaults apply to the rest."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _write_json(path: str | None, obj) -> None:
    if path:
        write_json(path, obj)


# ---------------------------------------------------------------------------------- probe
def cmd_probe(args: argparse.Namespace) -> int:
    from timlab.experiments.diagnostics.probe import format_probe, run_probe

    if (args.prompts is None) == (args.task is None):
        raise CLIError("probe needs exactly one of --prompts FILE or --task NAME")
    check_output_file(args.json, "--json")
    check_output_file(args.html, "--html")
    if args.injector is not None:
        return _probe_calibration(args)
    for flag in ("magnitudes", "mismatch", "target_total_k3", "task_kwarg"):
        if getattr(args, flag):
            raise CLIError(f"--{flag.replace('_', '-')} calibrates an injector; give --injector too")
    options = ("num_prompts", "samples_per_prompt", "rollout", "score", "dtype", "max_new_tokens", "seed",
               "temperature", "top_p", "top_k", "device", "show")
    result = run_probe(model_dir=args.model, prompts_file=args.prompts, task=args.task, attribute=args.attribute,
                       **_given(args, options))
    print(format_probe(result))
    _write_json(args.json, result)
    if args.html:
        from timlab.experiments.diagnostics.probe import write_probe_html

        print(f"report: {write_probe_html(result, args.html)}")
    return 0


def _probe_calibration(args: argparse.Namespace) -> int:
    """``timlab probe --injector``: the realized T * k3 of an injector at each magnitude (run_calibration)."""
    from timlab.experiments.diagnostics.probe import format_calibration, run_calibration

    for flag in ("rollout", "score", "dtype", "attribute", "html", "show"):
        if getattr(args, flag):
            raise CLIError(f"--{flag} is for comparing engines; with --injector the rollout is the exact engine "
                           "with the injector, scored by the trainer")
    if not args.magnitudes:
        raise CLIError("--injector needs --magnitudes, e.g. --magnitudes 0.3,0.6,1.2")
    try:
        magnitudes = [float(x) for x in args.magnitudes.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"--magnitudes takes numbers separated by commas, got {args.magnitudes!r}") from None
    from timlab.config import parse_set

    mismatch = parse_set([f"mismatch.{kv}" for kv in args.mismatch or []]).get("mismatch", {})
    task_kwargs = parse_set([f"task.kwargs.{kv}" for kv in args.task_kwarg or []]).get("task", {}).get("kwargs", {})
    options = ("num_prompts", "samples_per_prompt", "max_new_tokens", "seed", "temperature", "top_p", "top_k", "device")
    result = run_calibration(model_dir=args.model, injector=args.injector, magnitudes=magnitudes,
                             mismatch=mismatch, target_total_k3=args.target_total_k3 or 0.0,
                             prompts_file=args.prompts, task=args.task, task_kwargs=task_kwargs, **_given(args, options))
    print(format_calibration(result))
    _write_json(args.json, result)
    return 0


def _add_probe(sub) -> None:
    p = sub.add_parser("probe", help="roll out with one engine, score the same tokens with another, report the mismatch",
                       formatter_class=_defaults_of("timlab.experiments.diagnostics.probe:run_probe"))
    p.add_argument("--model", required=True, help="HF-format model folder")
    p.add_argument("--prompts", help="UTF-8 text file, one prompt per line, written as the model's task writes "
                   "its prompts (e.g. reverse: 'rev:abc='; docs/cli.md, 'Prompt files', lists each task's)")
    p.add_argument("--task", help="built-in task to draw prompts from: {names:task}")
    # defaults are run_probe's ({default} is read from its signature): an option not given is not passed
    p.add_argument("--num-prompts", type=int, help="the file's first N prompts (default all), or N from the task")
    p.add_argument("--samples-per-prompt", type=int, help="default {default}")
    # no argparse choices: run_probe checks the names and lists the valid ones in one line
    p.add_argument("--rollout", help="rollout engine: {names:engine} (default {default})")
    p.add_argument("--score", help="score path: trainer, {names:engine} (default {default})")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default {default}")
    p.add_argument("--max-new-tokens", type=int, help="default {default}")
    p.add_argument("--seed", type=int, help="default {default}")
    p.add_argument("--temperature", type=float, help="default {default}")
    p.add_argument("--top-p", type=float, help="default {default}")
    p.add_argument("--top-k", type=int, help="default {default} (no top-k)")
    p.add_argument("--device", help="default {default}")
    p.add_argument("--attribute", action="store_true", help="also locate the first op where the two paths diverge")
    p.add_argument("--show", type=int, metavar="N", help="print the first N replies as text, with each one's "
                                                          "largest |r| (default {default})")
    p.add_argument("--json", help="write the result as JSON here")
    p.add_argument("--html", help="write a self-contained HTML page with plots here")
    p.add_argument("--injector", help="calibrate this mismatch.injector instead: roll out as the RL loop does (exact "
                   "engine + injector, scored by the trainer) and report k3 and T * k3 per magnitude")
    p.add_argument("--magnitudes", help="--injector: comma-separated magnitudes, e.g. 0.3,0.6,1.2")
    p.add_argument("--mismatch", action="append", metavar="KEY=VALUE",
                   help="--injector: another mismatch setting, e.g. entropy_min=0.5 (repeatable)")
    p.add_argument("--target-total-k3", type=float, help="--injector: the magnitude reaching this T * k3 (interpolated)")
    p.add_argument("--task-kwarg", action="append", metavar="KEY=VALUE",
                   help="--injector: an option of --task, e.g. max_digits=4 (repeatable)")
    p.set_defaults(func=cmd_probe)


# ---------------------------------------------------------------------------------- progress
class LineBar:
    """A progress bar for output that is not a terminal (a log file, a pipe): one line
    ``desc: n/total  postfix`` at most every ``interval`` seconds and one at the end, instead of
    tqdm's redraws (two workers' bars once made an 8,000-line log). The subset of tqdm's
    interface that ``PhaseBars`` and ``SweepProgress`` use."""

    def __init__(self, *, total: int, desc: str = "", initial: int = 0, interval: float = 30.0, file=None, **_):
        import time

        self.total, self.desc, self.n, self.interval = total, desc, initial, interval
        self.file = file or sys.stderr
        self.postfix = ""
        self._clock = time.monotonic
        self._last = float("-inf")  # the first update prints
        self._closed = False

    def set_postfix(self, values: dict | None = None, refresh: bool = True) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in (values or {}).items())

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        self.postfix = text

    def update(self, k: int = 1) -> None:
        self.n += k
        if k and self._clock() - self._last >= self.interval:
            self._print()

    def write(self, text: str, file=None) -> None:
        print(text, file=file or self.file, flush=True)

    def _print(self) -> None:
        self._last = self._clock()
        self.write(f"{self.desc}: {self.n}/{self.total}" + (f"  {self.postfix}" if self.postfix else ""))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._print()


def _bar(**kwargs):
    """A tqdm bar on stderr when it is a terminal, else a ``LineBar``."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(dynamic_ncols=True, file=sys.stderr, **kwargs)
    return LineBar(**kwargs)


class PhaseBars:
    """A tqdm bar per phase (pretrain, train, ...) that a library call reports through its
    ``progress(phase, i, n, metrics)`` callback."""

    KEYS = {"train/reward_mean": "reward", "val/accuracy": "val_acc", "rollout_corr/k3_kl": "k3",
            "train/response_length_mean": "len", "train/lr": "lr", "loss": "loss"}

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.bars: dict = {}
        self.last: dict = {}

    def __call__(self, phase: str, i: int, n: int, metrics: dict) -> None:
        if not self.enabled:
            return
        bar = self.bars.get(phase)
        if bar is None:
            bar = self.bars[phase] = _bar(total=n, desc=phase, initial=max(i - 1, 0))
        last = self.last.setdefault(phase, {})  # per phase: pretraining's loss never shows on an RL bar
        for k, short in self.KEYS.items():
            if k in metrics and metrics[k] == metrics[k]:
                last[short] = metrics[k]
        bar.set_postfix({k: f"{v:.3g}" for k, v in last.items()}, refresh=False)
        bar.update(i - bar.n)
        if i >= n:
            bar.close()

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


def _config_from_args(args: argparse.Namespace):
    from timlab.config import resolve

    return resolve(getattr(args, "config", None), getattr(args, "preset", None), args.set or [])


def _add_config_args(p) -> None:
    from timlab.config import PRESETS

    p.add_argument("--preset", help=f"named preset(s), joined with '+' (e.g. surge+decoupled_k3_rs): {', '.join(PRESETS)}")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override a config key (repeatable; 'timlab config' lists every key)")


# ---------------------------------------------------------------------------------- pretrain
def cmd_pretrain(args: argparse.Namespace) -> int:
    from timlab.config import resolve
    from timlab.trainer.pretrain import pretrain, warm_start_dir
    from timlab.trainer.pretrain_init import init_digest

    cfg = resolve(args.config, args.preset, list(args.set or []), task=args.task)
    prog = PhaseBars(not args.quiet)
    res = pretrain(cfg, args.out, force=args.force, progress=lambda s, n, m: prog("pretrain", s, n, m))
    prog.close()
    print(f"{'reused' if res.cached else 'pretrained'} {res.path}: {res.num_params / 1e6:.2f}M params, "
          f"greedy val accuracy {res.val_accuracy:.3f}, {res.steps} steps in {res.seconds:.1f}s")
    if cfg.model.pretrain_init:
        sums = init_digest(cfg.model.pretrain_init)
        print(f"continued from model.pretrain_init {cfg.model.pretrain_init} "
              f"({', '.join(f'{name} SHA-256 {h[:16]}...' for name, h in sums.items())})")
    if args.out:
        print(f"cached as {warm_start_dir(cfg)} (TIMLAB_CACHE): train and demo runs of these model and task "
              "settings start from it")
    return 0


def _add_pretrain(sub) -> None:
    import textwrap

    p = sub.add_parser("pretrain", help="SFT warm start of a tiny model on a task (cached by config hash)",
                       description=textwrap.fill(
                           "SFT warm start of a tiny model on a task (cached by config hash). With --set "
                           "model.pretrain_init=DIR the SFT continues from that model folder's weights (same "
                           "architecture and alphabet) instead of a random init: a curriculum. The last two examples "
                           "are one: ~31-token answers first, then ~300-token answers continued from that model.", 90))
    p.add_argument("config", nargs="?", help="YAML config (model and task sections are used)")
    p.add_argument("--task", help="task: {names:task} (the preset's and YAML's task.kwargs are dropped "
                                  "when they are another task's)")
    p.add_argument("--out", help="also copy the model to this folder (it is always cached under $TIMLAB_CACHE, "
                                 "default ~/.cache/timlab, keyed by the config hash)")
    p.add_argument("--force", action="store_true", help="retrain even if a cached model exists")
    p.add_argument("--quiet", action="store_true", help=QUIET)
    _add_config_args(p)
    p.set_defaults(func=cmd_pretrain)


# ---------------------------------------------------------------------------------- train
def cmd_train(args: argparse.Namespace) -> int:
    from timlab.config import load_run_config, parse_set
    from timlab.trainer.run import train

    if args.resume:
        if args.config or args.preset:
            raise CLIError("--resume continues with the run's own config.yaml; drop CONFIG and --preset")
        over = parse_set(args.set or [])
        if set(over) - {"run"} or set(over.get("run", {})) - {"steps", "progress", "tensorboard"}:
            raise CLIError("--resume accepts only --set run.steps / run.progress / run.tensorboard")
        cfg = load_run_config(args.run_dir, over)
    else:
        cfg = _config_from_args(args)
    prog = PhaseBars(cfg.run.progress and not args.quiet)
    trained = []

    def progress(phase: str, i: int, n: int, metrics: dict) -> None:
        trained.append(phase == "train")
        prog(phase, i, n, metrics)

    try:
        last = train(cfg, args.run_dir, resume=args.resume, progress=progress)
    finally:
        prog.close()
    keys = ["step", "train/reward_mean", "val/accuracy", "rollout_corr/k3_kl", "mismatch/max_abs_diff", "train/lr"]
    if os.environ.get("RANK", "0") != "0":
        return 0  # data parallel: rank 0 reports
    print("done: " + ", ".join(f"{k}={last[k]:.4g}" for k in keys if k in last) + f"  ({args.run_dir})")
    if (note := _no_surge_note(cfg, last)) is not None:
        print(note)
    if args.resume and not any(trained) and "step" in last:
        print(_finished_note(args.run_dir, int(last["step"]), cfg.run.steps))
    return 0


def _no_surge_note(cfg, last: dict) -> str | None:
    """What a run says when scheduler.name=length_decay in its automatic mode never saw a surge:
    its LR never changed (None for any other run)."""
    s = cfg.scheduler
    if s.name != "length_decay" or s.decay_period or not math.isnan(last.get("scheduler/surge_step", 0.0)):
        return None
    return (f"note: scheduler length_decay never changed the LR ({last.get('train/lr', cfg.optim.lr):.4g}): no "
            f"response-length surge was detected in {int(last.get('step', 0))} steps (the mean length never grew "
            f"{s.surge_ratio:g}x within {s.surge_window} updates); set scheduler.decay_period=P to halve it every P "
            "updates regardless")


def _finished_note(run_dir: str, step: int, steps: int) -> str:
    """What ``--resume`` says when the run had already reached run.steps (nothing was trained)."""
    return (f"{run_dir}: already finished at step {step} of run.steps={steps}; nothing to train. To train it "
            f"further: timlab train --run-dir {run_dir} --resume --set run.steps=N (N > {step})")


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="on-policy RL (GRPO/RLOO/REINFORCE) with the exact engine and optional injected mismatch")
    p.add_argument("config", nargs="?", help="YAML config file")
    p.add_argument("--run-dir", required=True, help="where config.yaml, metrics.parquet and checkpoints/ go")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its latest checkpoint")
    p.add_argument("--quiet", action="store_true", help=QUIET)
    _add_config_args(p)
    p.set_defaults(func=cmd_train)


# ---------------------------------------------------------------------------------- demo
def cmd_demo(args: argparse.Namespace) -> int:
    import pandas as pd

    from timlab.experiments.reports.demo import (CPU_SECONDS_PER_STEP, HEADLINE_RULE, SFT_SECONDS, estimate_seconds,
                                                 format_summary, run_demo)

    n_runs, n_steps, (low, high) = estimate_seconds(quick=args.quick, seeds=args.seeds, steps=args.steps,
                                                    workers=args.workers)
    cpu_low, cpu_high = (n_runs * n_steps * c for c in CPU_SECONDS_PER_STEP)
    print(f"demo: {n_runs} runs x {n_steps} steps; estimate {_minutes(low)}-{_minutes(high)} on an idle machine, "
          f"{_minutes(cpu_low)}-{_minutes(cpu_high)} of CPU time (+ about {SFT_SECONDS} s of SFT the first time; "
          "times vary with the CPU, and load can double the wall time)", flush=True)
    prog = PhaseBars(not args.quiet)
    try:
        res = run_demo(quick=args.quick, seeds=args.seeds, steps=args.steps, workers=args.workers, force=args.force,
                       progress=prog, **_given(args, ("out_dir",)))
    finally:
        prog.close()
    with pd.option_context("display.width", 250, "display.max_columns", 20, "display.max_colwidth", 80):
        print(format_summary(res.effects, res.table))
    from timlab.machine import REPEATS_NOTE

    print(f"\ncomputed with {res.machine}: {REPEATS_NOTE}")
    print(f"\nreport: {res.report}\nruns:   {res.out_dir / 'runs'} (index.parquet; `timlab runs {res.out_dir} "
          f"--rule {HEADLINE_RULE}` lists them, collapses judged as above)")
    return 0


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the VeXact experiment on the CPU: pretrain, sweep (zero vs injected TIM vs remedies), report",
                       formatter_class=_defaults_of("timlab.experiments.reports.demo:run_demo"))
    from timlab.config import PRESETS
    from timlab.experiments.reports import demo

    p.add_argument("--out", dest="out_dir", help="output folder (default: {default})")
    p.add_argument("--quick", action="store_true",
                   help=f"fewer conditions, {demo.QUICK_SEEDS} seeds, {demo.QUICK_STEPS} steps")
    p.add_argument("--seeds", type=int, help=f"seeds per condition (default {demo.SEEDS}, quick {demo.QUICK_SEEDS})")
    p.add_argument("--steps", type=int, help=f"RL steps per run (default {PRESETS['demo']['run']['steps']}, "
                                               f"quick {demo.QUICK_STEPS})")
    p.add_argument("--workers", type=int, help="parallel runs (default: number of cores)")
    p.add_argument("--force", action="store_true",
                   help="--out holds a demo with other settings: delete it and start over (default: refuse)")
    p.add_argument("--quiet", action="store_true", help=QUIET)
    p.set_defaults(func=cmd_demo)


# ---------------------------------------------------------------------------------- sweep
class SweepProgress:
    """A tqdm bar of runs done / total, the active runs' steps as its postfix, a line per finished run."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.bar = None
        self.active: dict[str, str] = {}

    def __call__(self, phase: str, i: int, n: int, info: dict) -> None:
        if not self.enabled:
            return
        if phase == "sweep":
            if self.bar is None:
                self.bar = _bar(total=n, initial=i, desc="runs", unit="run")
            run_id = info.get("run_id")
            if run_id:
                self.active.pop(run_id, None)
                msg = f": {info['message']}" if info.get("message") else ""
                self.bar.write(f"{run_id}: {info.get('state')} ({info.get('mode')}){msg}", file=sys.stderr)
            self.bar.update(i - self.bar.n)
        else:
            kind, _, key = phase.partition(":")
            self.active[key] = f"{kind} {i}/{n}"
        if self.bar is not None:
            self.bar.set_postfix_str("  ".join(f"{k} {v}" for k, v in list(self.active.items())[-3:]), refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def cmd_sweep(args: argparse.Namespace) -> int:
    from timlab.experiments.sweeps.runner import INDEX_FILE, run_sweep

    prog = SweepProgress(not args.quiet)
    try:
        df = run_sweep(args.spec, args.out, workers=args.workers, executor=args.executor, progress=prog)
    finally:
        prog.close()
    counts = ", ".join(f"{n} {s}" for s, n in df["state"].value_counts().items())
    executed = len(df.attrs.get("executed", []))
    print(f"sweep {args.out}: {len(df)} runs ({counts}); ran {executed}, skipped {len(df) - executed}; "
          f"index {Path(args.out) / INDEX_FILE}")
    failed = df.attrs.get("failed", {})
    for run_id, msg in failed.items():
        print(f"  failed {run_id}: {msg}")
    return 1 if failed else 0


def _add_sweep(sub) -> None:
    p = sub.add_parser("sweep", help="run a sweep spec (conditions x grid) in parallel, resumably; see docs/sweeps.md")
    p.add_argument("spec", help="sweep spec YAML")
    p.add_argument("--out", required=True, help="sweep directory: one run directory per run + index.parquet")
    p.add_argument("--workers", type=int, help="parallel runs (default: spec's workers, else the number of cores)")
    p.add_argument("--executor", choices=("local", "ray"), help="local process pool (default) or ray")
    p.add_argument("--quiet", action="store_true", help=QUIET)
    p.set_defaults(func=cmd_sweep)


def cmd_runs(args: argparse.Namespace) -> int:
    from timlab.experiments.sweeps.runner import query_index, read_index
    from timlab.experiments.sweeps.index import find_sweep_dir

    columns = [c.strip() for item in (args.columns or []) for c in item.split(",") if c.strip()]
    sort, desc = args.sort, args.desc
    if sort and sort.startswith("-"):  # --sort=-COL
        sort, desc = sort[1:], True
    from timlab.experiments.studies.collapse import DEFAULT_RULE, rule_options
    from timlab.experiments.reports.demo import HEADLINE_RULE

    from timlab.experiments.sweeps.index import RUNS_WIDTH, compact_runs, format_runs

    rule = rule_options(**_given(args, ("rule", "learned_at")))
    sweep_dir = find_sweep_dir(args.dir)
    df = query_index(sweep_dir, where=args.where, columns=columns or None, sort=sort, descending=desc, rule=rule)
    total = len(read_index(sweep_dir))
    name = rule.get("rule", DEFAULT_RULE)
    judged = f"collapsed: the {name} rule" + ("" if rule else f", the default (the demo's headline and the study "
                                                             f"tables use the {HEADLINE_RULE} rule: --rule {HEADLINE_RULE})")
    if df.empty:
        print(f"no runs match (of {total}; {judged})")
        return 0
    notes = []
    if not (columns or args.wide):
        df, notes = compact_runs(df)
    with __import__("pandas").option_context("display.max_columns", None, "display.max_colwidth", 60):
        print(format_runs(df, name, wide=args.wide))
    import textwrap

    print(textwrap.fill(f"({len(df)} of {total} runs; {judged})", RUNS_WIDTH))
    if notes:
        print(textwrap.fill(f"(not shown: {'; '.join(notes)}; --wide shows them, one line a run)", RUNS_WIDTH))
    return 0


def _add_rule_args(p) -> None:
    """--rule / --learned-at: re-judge collapses with another rule (timlab.experiments.studies.collapse)."""
    p.add_argument("--rule", help="re-judge collapses with this rule: peak (the sweep's default: a fall below half "
                                  "the running peak) or plateau (a fall from the learned level, sustained over >= 2 "
                                  "evaluations; docs/sweeps.md)")
    p.add_argument("--learned-at", type=float, help="plateau rule: a run has learned once val/accuracy reaches "
                                                    "this (default 0.5)")


def _add_runs(sub) -> None:
    p = sub.add_parser("runs", help="list the runs of a sweep directory (filter with SQL over index.parquet)")
    p.add_argument("dir", help="sweep directory (holds index.parquet), or a demo's --out folder")
    p.add_argument("--where", help='SQL condition, e.g. "mismatch.magnitude > 0.5 AND collapsed" (dotted names may be bare)')
    p.add_argument("--columns", action="append", metavar="COL[,COL...]", help="columns to show (repeatable)")
    p.add_argument("--sort", metavar="COL", help="sort by this column (--sort -COL or --desc: descending)")
    p.add_argument("--desc", action="store_true", help="sort descending")
    p.add_argument("--wide", action="store_true", help="one line a run with every default column (the table is "
                                                       "otherwise wrapped at 120 characters, columns that say nothing "
                                                       "new left out and named below it)")
    _add_rule_args(p)
    p.set_defaults(func=cmd_runs)


def cmd_report(args: argparse.Namespace) -> int:
    from timlab.experiments.reports.report import build_report

    check_output_file(args.out, "--out")
    res = build_report(args.inputs, args.out, **_given(args, ("group_by", "rule")))
    print(f"wrote {res.path}: {res.n_runs} runs" + (
        f"; {len(res.missing)} with missing metrics ({', '.join(name for name, _ in res.missing)})" if res.missing else ""))
    return 0


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="one self-contained HTML report of a sweep directory or of run directories",
                       formatter_class=_defaults_of("timlab.experiments.reports.report:build_report"))
    p.add_argument("inputs", nargs="+", metavar="RUN_DIR|SWEEP_DIR", help="one sweep directory, or run directories")
    p.add_argument("--out", required=True, help="HTML file to write")
    p.add_argument("--group-by", help="index column or config key to group runs by (default: {default})")
    p.add_argument("--rule", help="collapse rule: peak (default: a fall below half the running peak) or plateau "
                                  "(a fall from the learned level; docs/sweeps.md)")
    p.set_defaults(func=cmd_report)


# ---------------------------------------------------------------------------------- analyze
def cmd_analyze(args: argparse.Namespace) -> int:
    from timlab.experiments.diagnostics.analyze import analyze_file, format_analysis
    from timlab.experiments.diagnostics.harm_prediction import check_kind

    check_output_file(args.out, "--out")
    check_output_file(args.json, "--json")
    if args.alarm:  # an early-warning rule over a run's logged series, or over the file's per-step metrics
        from timlab.experiments.studies.early_warning import check_analysis, check_file_rule, check_run, format_check
        from timlab.metrics.alarm import ALARMS

        ALARMS.get(args.alarm)  # an unknown name fails before any reading
        if Path(args.file).is_dir():
            print(format_check(check_run(args.file, args.alarm)))
            return 0
        check_file_rule(args.alarm)
    check_kind(args.kind)
    result = analyze_file(args.file, out_html=args.out)
    result["mismatch_kind"] = args.kind
    print(format_analysis(result))
    if args.alarm:
        print(format_check(check_analysis(result, args.alarm)))
    _write_json(args.json, result)
    return 1 if result["num_invalid"] else 0  # analyzed, but some rows were bad and left out


def _add_analyze(sub) -> None:
    p = sub.add_parser("analyze", help="mismatch metrics and an HTML report from a Parquet/JSONL file of "
                                       "per-sequence trainer and rollout log-probs; see docs/analyze.md")
    p.add_argument("file", help="Parquet or JSONL: one row per sequence with trainer_logprobs, rollout_logprobs")
    p.add_argument("--out", metavar="REPORT.html", help="write a self-contained HTML report here")
    p.add_argument("--json", help="write the full result (metrics, per step, distributions, errors) as JSON here")
    p.add_argument("--alarm", metavar="RULE", help="also run an early-warning rule (run.alarm's names, e.g. "
                                                    "grad_norm_change) over the per-step series; FILE may then be "
                                                    "a run directory (docs/metrics.md, Early-warning alarm)")
    _add_kind(p)
    p.set_defaults(func=cmd_analyze)


def _add_kind(p) -> None:
    p.add_argument("--kind", metavar="KIND", help="the kind of mismatch, where you know it: one the lab has measured "
                                                  "(e.g. head, stale, numerical; a wrong name lists them). The answer "
                                                  "to \"is this mismatch a problem?\" then reads only cells of that "
                                                  "kind (docs/metrics.md, harm section)")


# ---------------------------------------------------------------------------------- check
def cmd_check(args: argparse.Namespace) -> int:
    from timlab.experiments.diagnostics.check import format_check, run_check, write_check_html
    from timlab.experiments.diagnostics.harm_prediction import check_kind

    if args.gate_metric is not None and args.fail_above is None:
        raise CLIError(f"--gate-metric {args.gate_metric} needs --fail-above X (the threshold it is compared with); "
                       "without it nothing is gated and the command always exits 0")
    check_output_file(args.json, "--json")
    check_output_file(args.html, "--html")
    check_kind(args.kind)
    options = ("rollout", "score", "dtype", "device", "batch_sizes", "lengths", "decoding", "seed", "fail_above",
               "gate_metric", "n_boot", "decode_loop")
    result = run_check(model_dir=args.model, **_given(args, options))
    result["mismatch_kind"] = args.kind
    print(format_check(result))
    _write_json(args.json, result)
    if args.html:
        print(f"report: {write_check_html(result, args.html)}")
    return 1 if result["gate"]["failed"] else 0  # the CI gate; errors exit with 2


def _add_check(sub) -> None:
    p = sub.add_parser("check", help="model onboarding: the mismatch over batch sizes x lengths x greedy/sampling, "
                                     "with verdicts and a CI gate (exit 1 when --fail-above is exceeded)",
                       formatter_class=_defaults_of("timlab.experiments.diagnostics.check:run_check"))
    p.add_argument("--model", required=True, help="HF-format model folder")
    # defaults are run_check's ({default} is read from its signature): an option not given is not passed
    p.add_argument("--rollout", help="rollout engine: exact, fast, hf, vllm (default {default})")
    p.add_argument("--score", help="score path: trainer, exact, fast, hf (default {default})")
    p.add_argument("--decode-loop", help="the rollout engine's decode loop (exact, fast): host, device, or graphs "
                                         "(CUDA graphs on a GPU) (default {default})")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default {default}")
    p.add_argument("--device", help="default {default}")
    p.add_argument("--batch-sizes", help="comma-separated sequences per rollout batch (default {default})")
    p.add_argument("--lengths", help="name=PROMPT:ANSWER tokens, comma-separated (default {default})")
    p.add_argument("--decoding", help="greedy and/or sampling (default {default})")
    p.add_argument("--seed", type=int, help="default {default}")
    p.add_argument("--fail-above", type=float, metavar="X",
                   help="exit 1 if any cell's gate metric exceeds X (0: demand bitwise-equal log-probs)")
    p.add_argument("--gate-metric", help="the cell number the gate compares (default {default}); one of "
                                         "mean_abs_diff, max_abs_diff, exp_abs_diff_mean, k3_kl, abs_kl, chi2_token, ...")
    p.add_argument("--boot", type=int, dest="n_boot", metavar="N",
                   help="bootstrap resamples for the length-scaling interval (default {default})")
    p.add_argument("--json", help="write the result as JSON here")
    p.add_argument("--html", help="write a self-contained HTML page here")
    _add_kind(p)
    p.set_defaults(func=cmd_check)


# ---------------------------------------------------------------------------------- study
def cmd_study(args: argparse.Namespace) -> int:
    from timlab.experiments.studies import engine as E, registration as R
    from timlab.experiments.studies import predictor as P
    from timlab.experiments.studies.blocks import block_dirs

    if args.trajectories and args.action != "figure":
        raise CLIError(f"study {args.action}: --trajectories is an option of `study figure`")
    if args.markdown and args.action != "analyze":
        raise CLIError(f"study {args.action}: --markdown is an option of `study analyze`")
    from timlab.experiments.studies import heldout as H
    from timlab.experiments.studies.registration import study_from_dict, study_mapping

    path, d = study_mapping(args.file)  # read once; its kind says which engine analyses it
    if P.is_predictor(d):
        return _predictor_study(args, P.predictor_from_dict(d, root=path.parent, source=str(path)))
    if H.is_heldout(d):
        return _heldout_study(args, H.heldout_from_dict(d, root=path.parent, source=str(path)))
    if args.action == "recompute":
        raise CLIError(f"study recompute: {args.file} is not a predictor study (kind: predictor); "
                       "its runs are made by `timlab study run`")
    st = study_from_dict(d, root=path.parent, source=str(path))
    dirs = block_dirs(st, args.out)
    if args.action == "check":
        return _study_check(args, st, dirs)
    if args.action == "run":
        return _study_run(args, st, dirs)
    if args.action == "figure":
        if not args.png:
            raise CLIError("study figure needs --png FILE")
        check_output_file(args.png, "--png")
        print(f"wrote {E.figure(st, args.png, args.out, trajectories=args.trajectories)}")
        return 0
    from dataclasses import replace

    from timlab.experiments.studies.text import plain_text

    terminal = not (args.markdown or args.write)  # the block's own bytes when it is written or asked for
    res = E.analyze(replace(st, clip_bounded=True) if terminal else st, args.out)
    print(plain_text(res.text) if not args.markdown else res.text)
    print(f"\n{st.name}: {res.status}; {res.freeze}")
    if args.write:
        _check_writable(args, res.status, st.findings, "block (findings: {file, block})")
        from timlab.experiments.studies.text import write_blocks
        from timlab.findings import block_file

        path, name = st.findings
        write_blocks(path, {name: res.text})
        for d in dirs.values():  # the amendments this analysis used, recorded at their first use
            R.record_amendments(st, d)
        print(f"wrote block {name} of {block_file(path, name)}")
    return 0 if res.status == "complete" else 1


def _study_check(args: argparse.Namespace, st, dirs: dict) -> int:
    """``timlab study check``: the registration, its hash, its arms, families and verdicts, and each
    block's progress and freeze."""
    from timlab.experiments.studies import engine as E, registration as R
    from timlab.experiments.studies.sweep_runs import seed_ranges

    runs = E.planned_runs(st)
    arms = {}
    for r in runs:
        arms[r.arm] = arms.get(r.arm, 0) + 1
    print(f"study {st.name} ({args.file}): valid registration")
    print(f"  registration hash: {st.hash}")
    print(f"  sweep: {len(runs)} runs, {st.steps} steps each; arms: " + ", ".join(f"{a} ({n})" for a, n in arms.items()))
    if st.groups:
        groups = list(dict.fromkeys(r.group for r in runs))
        print(f"  {st.groups}s: {', '.join(groups)} (each with its own {st.control}, validity check and Holm families)")
    print(f"  endpoints: {', '.join(e.name for e in st.endpoints)}")
    for f in st.families:
        what = (", ".join(f"{a} vs {b}" for a, b, _ in f.comparisons) if f.comparisons else
                f"{', '.join(f.arms) or 'every arm'} vs {f.against}")
        rules = sorted({f.rule_for(e, r) for e in f.endpoints for r in [c[2] for c in f.comparisons] or [""]} - {""})
        print(f"  family {f.name}: {what} on {', '.join(f.endpoints)}; {f.correction}; "
              + (f"rule {', '.join(rules)}" if rules else "no rule (descriptive)"))
    for v in st.verdicts:
        print(f"  verdict {v.name}: per arm of family {v.family}, {len(v.cases)} cases (first that holds), else "
              f"{v.otherwise!r}")
    for o in st.outcomes:
        print(f"  outcome {o.name}: {len(o.cases)} cases (first that holds), else {o.otherwise!r}"
              + (f"; on each scale ({', '.join(s for s, _ in o.scales)}), combined" if o.scales else ""))
    for f in (f for f in st.fits if f.kind == "length_exponent"):
        print(f"  exponent {f.name!r}: {f.arm}'s cost through "
              + (f"{st.groups}s {', '.join(f.groups)}" if f.groups else f"every valid {st.groups}") + "; "
              + (f"tests: {', '.join(t.name for t in f.tests)}" if f.tests else "no test (descriptive)"))
    if st.blocks:
        counts = E.progress(st)
        for b in st.blocks:
            d, (n, m) = dirs[b.name], counts[b.name]
            print(f"  block {b.name} (machine {b.isa}" + (f", fingerprint {b.fingerprint}" if b.fingerprint else "")
                  + f"; seeds {seed_ranges(b.seeds)}; {n} of {m} runs finished): {d}: "
                  + R.check_freeze(st, d, has_runs=R.holds_runs(d)))
        print(f"  runs not finished: {E.missing_runs(st)}")
    else:
        out = dirs[""]
        states = R.holds_runs(out)
        print(f"  {out}: {R.check_freeze(st, out, has_runs=states)}; runs not finished: {E.missing_runs(st, args.out)}")
    if st.predicted_by is not None:
        from timlab.experiments.studies.oos import probe_k3

        pb = st.predicted_by
        print(f"  out-of-sample cells of {pb.study}: " + ", ".join(f"{a} ({k})" for a, k in pb.kinds.items()))
        print(f"  probe {pb.probe}, realized k3 (mean over steps 1-25): "
              + (", ".join(f"{c} {v:.3g}" for c, v in probe_k3(pb.probe).items()) or "no runs yet"))
    return 0


def _study_run(args: argparse.Namespace, st, dirs: dict) -> int:
    """``timlab study run``: freeze the registration, then run or resume this machine's block of the sweep."""
    from timlab.experiments.studies import engine as E, registration as R
    from timlab.experiments.studies.blocks import block_spec, machine_block
    from timlab.experiments.studies.sweep_runs import seed_ranges

    from timlab.experiments.sweeps.runner import INDEX_FILE, run_sweep, spec_from_dict

    spec = spec_from_dict(st.sweep, root=st.sweep_root, source=st.sweep_source)
    planned = E.planned_runs(st)  # every config resolves before anything is written
    out = dirs[""] if not st.blocks else dirs[(block := machine_block(st)).name]
    if st.blocks:
        spec = block_spec(spec, planned, block.name)
        print(f"block {block.name}: this machine ({block.isa}) runs seeds {seed_ranges(block.seeds)} into {out}")
    if st.predicted_by is not None:
        from timlab.experiments.studies.oos import check_predicted

        print(check_predicted(st))  # no out-of-sample run before its prediction
    wrote = R.freeze(st, out)
    print(f"registration {st.hash[:12]} " + (f"frozen in {out / R.FREEZE_FILE}" if wrote
                                              else "matches its freeze"))
    prog = SweepProgress(not args.quiet)
    try:
        df = run_sweep(spec, out, workers=args.workers, progress=prog)
    finally:
        prog.close()
    counts = ", ".join(f"{n} {s}" for s, n in df["state"].value_counts().items())
    print(f"study {st.name}: {len(df)} runs ({counts}) in {out}; index {out / INDEX_FILE}")
    for run_id, msg in df.attrs.get("failed", {}).items():
        print(f"  failed {run_id}: {msg}")
    return 1 if df.attrs.get("failed") else 0


def _predictor_study(args: argparse.Namespace, st) -> int:
    """``timlab study check|recompute|analyze`` of a predictor study (docs/studies.md, "Predictor studies")."""
    from timlab.experiments.studies import predictor as P

    if args.action == "check":
        P.check_frozen(st)
        runs = P.rerun_list(st)
        print(f"predictor study {st.name} ({args.file}): valid registration")
        print(f"  registration hash: {st.hash} ({'frozen' if st.frozen else 'NOT frozen yet'})")
        print(f"  {len(runs)} re-runs of steps 0-{st.last_step} (seeds {', '.join(map(str, st.seeds))}) from "
              + ", ".join(f"{s.name} ({sum(r.source == s.name for r in runs)})" for s in st.sources))
        print(f"  candidates: {', '.join(c.name for c in st.candidates)}; reference {st.reference}")
        print(f"  out of sample: {st.oos or 'none'}")
        return 0
    if args.action == "recompute":
        from timlab.experiments.studies.recompute import recompute

        counts = recompute(st, run_command=main)  # a missing start is rebuilt by its registered timlab commands
        return 1 if counts["differ"] else 0
    if args.action != "analyze":
        raise CLIError(f"study {args.action}: not defined for a predictor study (valid: check, recompute, analyze)")
    from timlab.experiments.studies.oos import analyze_and_write

    from timlab.experiments.studies.text import plain_text

    res = analyze_and_write(st, write=args.write)
    shown = (lambda text: text) if args.markdown else plain_text  # noqa: E731
    print(shown(res.insample))
    print(f"\nOut of sample:\n{shown(res.oos)}")
    print(f"\n{st.name}: {res.status}" + (f"; wrote the blocks of {st.findings[0]}" if args.write and st.findings else ""))
    return 0 if res.status == "complete" else 1


def _check_writable(args: argparse.Namespace, status: str, findings, what: str) -> None:
    """``study analyze --write`` refuses an analysis that is not complete, or a file that names no block."""
    if status != "complete":
        raise CLIError(f"--write: the analysis is {status}; nothing written")
    if findings is None:
        raise CLIError(f"--write: {args.file} names no findings {what}")


def _heldout_study(args: argparse.Namespace, st) -> int:
    """``timlab study check|analyze`` of a held-out predictor study (docs/studies.md, "Held-out predictor
    studies"); its runs are its ``runs`` study file's, run by ``timlab study run RUNS``."""
    from timlab.experiments.studies import heldout as H

    if args.action == "check":
        H.check_frozen(st)
        print(f"held-out study {st.name} ({args.file}): valid registration")
        print("  " + "\n  ".join(H.registration_lines(st)))
        print(f"  runs: {st.runs} (`timlab study check {st.runs}` for their progress)")
        return 0
    if args.action != "analyze":
        raise CLIError(f"study {args.action}: not defined for a held-out study (valid: check, analyze); its runs: "
                       f"timlab study run {st.runs}")
    from timlab.experiments.studies.text import plain_text, write_blocks

    res = H.analyze_heldout(st)
    show = (lambda t: t) if args.markdown else plain_text
    print(show(res.fit_text))
    print(f"\n{show(res.test_text)}")
    print(f"\n{st.name}: {res.status}")
    if args.write:
        _check_writable(args, res.status, st.findings, "blocks (findings: {file, fit, test})")
        write_blocks(st.findings[0], H.blocks(st, res))
        print(f"wrote blocks {st.findings[1]} and {st.findings[2]} of {st.findings[0]}")
        rec = H.calibration_record(st, res, H.policy_params(st))
        if rec is None:
            print("no calibration record shipped: the signal condition did not hold")
        else:
            from timlab.experiments.studies.predictor import write_calibration

            print(f"wrote {write_calibration(H.CALIBRATION, rec)} (winner {rec['winner']})")
    return 0 if res.status == "complete" else 1


def _add_study(sub) -> None:
    p = sub.add_parser("study", help="a pre-registered study from one study file: check it, run its sweep, "
                                     "analyse it into verdicts (docs/studies.md)")
    p.add_argument("action", choices=("check", "run", "analyze", "figure", "recompute"),
                   help="check: validate the file, print its hash and progress; run: freeze the registration and "
                        "run (or resume) its sweep; analyze: the registered analysis and verdicts, refused while "
                        "runs are missing or the registration changed without an amendment; figure: each arm's "
                        "difference from its reference, with its interval (grouped studies: cost against dose or "
                        "length, or an out-of-sample test's measured and predicted loss); recompute (predictor studies): re-run "
                        "the start of the committed runs, bit for bit, into the study's table")
    p.add_argument("file", help="study file (YAML)")
    p.add_argument("--out", help="sweep directory (default: the file's out)")
    p.add_argument("--workers", type=int, help="run: parallel runs (default: the spec's workers, else the cores)")
    p.add_argument("--write", action="store_true", help="analyze: rewrite the file's findings block (Markdown)")
    p.add_argument("--markdown", action="store_true", help="analyze: print the Markdown the findings block holds "
                                                           "(default: the same as plain text, tables aligned)")
    p.add_argument("--png", help="figure: the PNG to write")
    p.add_argument("--trajectories", action="store_true",
                   help="figure: instead, each arm's mean course over training (95%% t band) of every metric its "
                        "endpoints read; per-step metrics smoothed, a k3 on a log axis")
    p.add_argument("--quiet", action="store_true", help=QUIET)
    p.set_defaults(func=cmd_study)


# ---------------------------------------------------------------------------------- threshold
def cmd_threshold(args: argparse.Namespace) -> int:
    from timlab.experiments.studies.threshold import format_threshold, plot_threshold, threshold_study

    check_output_file(args.json, "--json")
    check_output_file(args.plot, "--plot")
    res = threshold_study(args.dirs, **_given(args, ("scale", "min_peak", "rule", "learned_at")))
    print(format_threshold(res))
    _write_json(args.json, {"table": res.table().to_dict("records"), "summary": res.summary().to_dict("records"),
                            "fits": [vars(f) for f in res.fits]})
    if args.plot:
        print(f"plot: {plot_threshold(res, args.plot)}")
    return 0


def _add_threshold(sub) -> None:
    p = sub.add_parser("threshold", help="the collapse threshold k3* against response length, from a sweep "
                                         "(docs/examples/threshold.yaml)")
    p.add_argument("dirs", nargs="+", metavar="SWEEP_DIR", help="sweep directories (each holds index.parquet), read together")
    p.add_argument("--scale", help="index column that sets the response-length scale (default task.kwargs.max_digits)")
    p.add_argument("--min-peak", type=float, help="count only collapses from a running peak of at least this accuracy "
                                                  "(e.g. 0.5: runs that had learned; default: the sweep's own rule)")
    _add_rule_args(p)
    p.add_argument("--json", help="write the per-dose table, k3* intervals and fits as JSON here")
    p.add_argument("--plot", metavar="PNG", help="draw k3* against the response length here")
    p.set_defaults(func=cmd_threshold)


# ---------------------------------------------------------------------------------- gradcheck
def cmd_gradcheck(args: argparse.Namespace) -> int:
    from timlab.config import load_run_config, parse_set, resolve
    from timlab.gradcheck.command import format_gradcheck, plot_gradcheck, run_gradcheck
    from timlab.rundir.checkpoint import run_checkpoint

    check_output_file(args.json, "--json")
    check_output_file(args.plot, "--plot")
    sets = list(args.set or [])
    if args.injector is not None:
        sets.append(f"mismatch.injector={args.injector}")
    if args.magnitude is not None:
        sets.append(f"mismatch.magnitude={args.magnitude}")
    if args.run_dir:
        if args.config or args.preset or args.model:
            raise CLIError("--run-dir takes the run's own config.yaml and checkpoint; drop CONFIG, --preset and --model")
        model_dir = run_checkpoint(args.run_dir, args.step)
        cfg = load_run_config(args.run_dir, parse_set(sets))
    else:
        if args.step is not None:
            raise CLIError("--step needs --run-dir")
        cfg = resolve(args.config, args.preset, sets)
        model_dir = args.model
    prog = PhaseBars(not args.quiet)
    try:
        options = ("samples", "micro_batch", "buckets", "estimator", "seed", "n_boot", "score_seqs", "param_filter")
        res = run_gradcheck(cfg, model_dir=model_dir, group_size=args.group_size, dense_reward=args.dense_reward,
                            progress=prog, **_given(args, options))
    finally:
        prog.close()
    print(format_gradcheck(res))
    _write_json(args.json, res.to_dict())
    if args.plot:
        print(f"plot: {plot_gradcheck(res, args.plot)}")
    return 0


def _add_gradcheck(sub) -> None:
    p = sub.add_parser("gradcheck", help="policy gradient under exact vs mismatched rollouts: cosine, bias, SNR, "
                                         "and the T^2 bound; see docs/gradcheck.md",
                       formatter_class=_defaults_of("timlab.gradcheck.estimator:gradcheck"))
    p.add_argument("config", nargs="?", help="YAML config (task, rollout, model.dtype and mismatch sections are used)")
    p.add_argument("--run-dir", help="a training run: use its config.yaml and a checkpoint (default: the latest)")
    p.add_argument("--step", type=int, help="with --run-dir: the checkpoint of this step (0 = the warm start)")
    p.add_argument("--model", help="an HF model folder to check instead of the config's warm start")
    p.add_argument("--injector", help="mismatch injector: {names:injector}; combine with '+' "
                                      "(same as --set mismatch.injector=NAME)")
    p.add_argument("--magnitude", type=float, help="injector magnitude (same as --set mismatch.magnitude=X)")
    # defaults are gradcheck's ({default} is read from its signature): an option not given is not passed
    p.add_argument("--samples", type=int, help="sequences per side (default {default})")
    p.add_argument("--micro-batch", type=int, help="sequences per gradient micro-batch (default {default})")
    p.add_argument("--buckets", type=int, help="response-length buckets (prompts split by answer length; default {default})")
    p.add_argument("--estimator", help="reinforce (w = R, the bound's setting) or rloo (default {default})")
    p.add_argument("--group-size", type=int, help="rloo: samples per prompt (default rollout.samples_per_prompt)")
    p.add_argument("--dense-reward", action=argparse.BooleanOptionalAction, default=None,
                   help="partial-credit reward (default: task.dense_reward)")
    p.add_argument("--seed", type=int, help="default {default}")
    p.add_argument("--boot", type=int, dest="n_boot", metavar="N",
                   help="bootstrap replicates for the confidence intervals (default {default})")
    p.add_argument("--score-seqs", type=int, help="sequences whose per-token score norms estimate B (default {default})")
    p.add_argument("--params", metavar="REGEX", dest="param_filter",
                   help="only parameters whose name matches (bounds memory on big models)")
    p.add_argument("--json", help="write the full result as JSON here")
    p.add_argument("--plot", help="write a PNG of bias vs the T^2 bound and bias/SNR vs length here")
    p.add_argument("--quiet", action="store_true", help=QUIET)
    _add_config_args(p)
    p.set_defaults(func=cmd_gradcheck)


# ---------------------------------------------------------------------------------- export
def cmd_export(args: argparse.Namespace) -> int:
    from timlab.trainer.export import export_checkpoint

    res = export_checkpoint(args.run_dir, args.out, step=args.step)
    print(f"exported step {res.step} of {args.run_dir} to {res.path} ({', '.join(res.files)}); "
          f"start a run from it with --set model.path={res.path}")
    return 0


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="write a run's checkpoint as a plain HF model folder (start RL from a "
                                      "learned policy with model.path=DIR)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory")
    p.add_argument("--step", type=int, help="the checkpoint of this step (default: the latest that passes its "
                                            "manifest check; a newer one passed over is named in a warning; "
                                            "0 = the warm start)")
    p.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    p.set_defaults(func=cmd_export)


# ---------------------------------------------------------------------------------- config
def _value_text(value) -> str:
    import json

    return json.dumps(value) if isinstance(value, (str, dict)) and not (isinstance(value, str) and value) else str(value)


def format_config_keys(keys, values: dict | None = None, width: int = 100) -> str:
    """One block per key: ``key  type  value`` (the default, or ``values[key]`` marked ``*`` where
    it differs), then its help wrapped and indented."""
    import textwrap

    lines = []
    for k in keys:
        value, mark = k.default, ""
        if values is not None and k.key in values and values[k.key] != k.default:
            value, mark = values[k.key], "  * (default " + _value_text(k.default) + ")"
        lines.append(f"{k.key}  ({k.type}) = {_value_text(value)}{mark}")
        if k.help:
            lines += textwrap.wrap(k.help, width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines)


def cmd_config(args: argparse.Namespace) -> int:
    from timlab.catalog import config_keys

    keys = config_keys()
    if args.key:
        wanted = [k for k in keys if k.key == args.key or k.key.startswith(args.key + ".")]
        if not wanted:
            section = args.key.split(".")[0]
            in_section = [k.key.split(".", 1)[1] for k in keys if k.key.startswith(section + ".")]
            if "." in args.key and in_section:
                raise CLIError(f"unknown config key {args.key!r}; valid keys of {section}: {', '.join(in_section)}")
            sections = sorted({k.key.split(".")[0] for k in keys})
            raise CLIError(f"unknown config key or section {args.key!r}; valid sections: {', '.join(sections)}")
        keys = wanted
    values = None
    if args.config or args.preset or args.set or args.task:
        from timlab.config import resolve, validate

        resolved = resolve(args.config, args.preset, args.set or [], task=args.task)
        validate(resolved)  # what train checks before it starts, so config shows only values train accepts
        cfg = resolved.to_dict()
        values = {k.key: cfg[k.key.split(".")[0]][k.key.split(".", 1)[1]] for k in keys}
    print(format_config_keys(keys, values))
    return 0


def _add_config(sub) -> None:
    p = sub.add_parser("config", help="list every config key --set accepts: its type, default (or the value a "
                                      "preset, YAML file or --set gives it) and what it does")
    p.add_argument("key", nargs="?", help="only this key or section (e.g. optim or optim.lr)")
    p.add_argument("--config", help="YAML config file: show the values it resolves to")
    p.add_argument("--task", help="task: {names:task} (as for pretrain)")
    _add_config_args(p)
    p.set_defaults(func=cmd_config, torch=False)


# ---------------------------------------------------------------------------------- the parser
ABOUT = """\
timlab: a lab for training-inference mismatch (TIM) in RL of language models.

RL samples with an inference engine and computes gradients with a training engine; timlab's
exact engine makes the two agree bit for bit, injects a controlled mismatch back, measures it
(verl's rollout_corr/* metrics) and tests remedies (importance sampling, the length-decay LR)."""

START = """\
start here:
  timlab demo --quick                       the main experiment, small (a few minutes on a CPU)
  timlab train --preset smoke --run-dir runs/smoke
  timlab config --preset demo               every config key --set accepts, with its value
  timlab COMMAND --help                     what a command does, its options and examples

docs: README.md and docs/ in the source tree"""

EXAMPLES: dict[str, list[str]] = {
    "probe": ["timlab probe --model models/reverse --task reverse --rollout exact --score trainer",
              "timlab probe --model models/reverse --prompts prompts.txt --rollout fast --dtype bfloat16 --attribute"],
    "pretrain": ["timlab pretrain --task reverse --out models/reverse",
                 "timlab pretrain --preset smoke --task sort --out models/sort",
                 "timlab pretrain --preset surge --set task.kwargs.restate=1 --set task.kwargs.scratch_frac=1.0 "
                 "--out models/r1",
                 "timlab pretrain --preset surge --set task.kwargs.restate=31 --set task.kwargs.scratch_frac=1.0 "
                 "--set model.pretrain_init=models/r1 --out models/r31"],
    "train": ["timlab train --preset smoke --run-dir runs/smoke",
              "timlab train --preset demo --run-dir runs/r1 --set mismatch.injector=head_perturb "
              "--set mismatch.magnitude=2",
              "timlab train --run-dir runs/r1 --resume --set run.steps=300"],
    "demo": ["timlab demo --quick", "timlab demo --out demo_out --seeds 3"],
    "sweep": ["timlab sweep docs/examples/dose_response.yaml --out sweeps/dose",
              "timlab --isa avx2 sweep docs/examples/erosion_probe.yaml --out sweeps/erosion_probe"],
    "runs": ['timlab runs sweeps/dose --where "collapsed AND mismatch.magnitude >= 1" --sort -final_accuracy'],
    "report": ["timlab report sweeps/dose --out dose.html"],
    "analyze": ["timlab analyze timlab/data/sample_logprobs.jsonl --out analysis.html"],
    "threshold": ["timlab threshold sweeps/threshold --plot threshold.png"],
    "study": ["timlab study check docs/examples/study_quickstart.yaml",
              "timlab study run docs/examples/study_quickstart.yaml",
              "timlab study analyze docs/examples/study_quickstart.yaml",
              "timlab study figure docs/examples/study_quickstart.yaml --png quickstart.png",
              "timlab study analyze docs/examples/studies/erosion.yaml --write"],
    "gradcheck": ["timlab gradcheck --preset demo --injector head_perturb --magnitude 1 --samples 256",
                  "timlab gradcheck --run-dir runs/r1 --step 50"],
    "config": ["timlab config", "timlab config --preset demo --set optim.lr=3e-4"],
    "export": ["timlab export runs/r1 --step 100 --out models/r1_step100"],
    "check": ["timlab check --model /path/to/Qwen3-0.6B --rollout fast --score trainer --dtype bfloat16",
              "timlab check --model models/reverse --lengths short=8:16,long=32:64 --fail-above 0"],
}
"""Examples shown under each command's --help (tests/test_cli_help.py parses every one)."""


def _describe(sub) -> None:
    """Give every subcommand a description (its one-line help, unless it has its own), its
    examples and the user-facing formatter."""
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, p in sub.choices.items():
        if not p.description:
            import textwrap

            p.description = textwrap.fill((helps.get(name) or "").rstrip(".") + ".", 90)
        if name in EXAMPLES and not p.epilog:
            p.epilog = "examples:\n" + "\n".join(f"  {e}" for e in EXAMPLES[name])
        if not issubclass(p.formatter_class, _Formatter):
            p.formatter_class = _Formatter


COMMANDS = [_add_probe, _add_pretrain, _add_train, _add_demo, _add_sweep, _add_runs, _add_report, _add_analyze,
            _add_check, _add_study, _add_threshold, _add_gradcheck, _add_export, _add_config]
"""Each subcommand's registrar, in the order ``timlab --help`` lists them."""


class _Version(argparse.Action):
    """``--version``: timlab's version, and the torch, CPU capability, vendor and fingerprint that
    decide the bits a run computes (importing torch to read them)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from timlab import __version__
        from timlab.machine import summary

        print(f"timlab {__version__} ({summary()})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="timlab", description=ABOUT, epilog=START, formatter_class=_Formatter)
    parser.add_argument("--version", action=_Version, help="show timlab's version, torch's, the CPU capability "
                                                            "torch computes with and the machine's fingerprint (runs "
                                                            "repeat bit for bit only where these agree), and exit")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("--isa", choices=ISAS, default="native",
                        help="CPU instruction set to compute with: native (the machine's own) or avx2 (torch, oneDNN "
                             "and MKL capped at AVX2, so an AVX-512 machine computes the bits of an AVX2 one: runs "
                             "repeat bit for bit across machines; default: native)")
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    for register in COMMANDS:
        register(sub)
    _describe(sub)
    return parser


# ---------------------------------------------------------------------------------- main
def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"timlab: warning: {message}", file=sys.stderr if file is None else file)


DASH_VALUES = ("--sort",)
"""Options whose value may start with '-' (``--sort -final_accuracy``): argparse would read it as an option."""


def _join_dash_values(argv: list[str]) -> list[str]:
    """``["--sort", "-col"]`` -> ``["--sort=-col"]`` for the options in ``DASH_VALUES``."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in DASH_VALUES and i + 1 < len(argv) and argv[i + 1].startswith("-") and len(argv[i + 1]) > 1:
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _pin_isa(isa: str, argv: list[str]) -> str | None:
    """Re-execute this command under ``timlab.machine.PIN_ENV`` when ``--isa`` asks for a pin
    that is not in effect. The pin must be set before torch loads, so an in-process call that
    has already imported torch gets back the one-line error to print instead."""
    from timlab.machine import pin_env

    env = pin_env(isa)
    if env is None:
        return None
    if "torch" in sys.modules:
        return (f"--isa {isa} must be in the environment before torch loads: "
                + " ".join(f"{k}={v}" for k, v in env.items() if os.environ.get(k) != v))
    root = str(Path(__file__).resolve().parent.parent)  # this timlab, whatever the working directory holds
    code = f"import sys; sys.path.insert(0, {root!r}); from timlab.cli import main; sys.exit(main(sys.argv[1:]))"
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-c", code, *argv], env)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = _join_dash_values(sys.argv[1:] if argv is None else list(argv))
    if "--version" in argv:  # --version exits while parsing: pin first, so it prints the pinned bits' fingerprint
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--isa", choices=ISAS, default="native")
        if (error := _pin_isa(pre.parse_known_args(argv)[0].isa, argv)) is not None:
            print(f"timlab: error: {error}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    if (error := _pin_isa(args.isa, argv)) is not None:
        print(f"timlab: error: {error}", file=sys.stderr)
        return 2
    handle_sigterm()  # kill / docker stop: the run records where it stopped, like Ctrl-C
    if getattr(args, "torch", True):  # a command that runs no torch code does not import it
        _set_threads()
    if not args.debug:
        import warnings

        warnings.showwarning = _show_warning  # library warnings (e.g. a checkpoint passed over) as one line
    if args.debug:
        return args.func(args)
    try:
        return args.func(args)
    except (TimlabError, OSError) as e:  # bad input, or the environment (disk full, a path); not a bug
        print(f"timlab: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"timlab: interrupted{' (SIGTERM)' if isinstance(e, Terminated) else ''}", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130


if __name__ == "__main__":
    sys.exit(main())

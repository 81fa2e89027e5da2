"""Attack the CLI as a hostile user would, and count what breaks.

1. kill -9 at random moments: ``timlab train`` (killed and resumed until it finishes),
   ``timlab sweep`` (its main process killed, the sweep rerun) and ``timlab pretrain --out``
   (killed, rerun), each checked bit for bit against an uninterrupted run: the metrics
   (timing columns aside), distributions.jsonl and the final weights.
2. Every bad input of issue 14, each run through the CLI: a traceback on stderr, a non-one-line
   error or a file timlab did not write that changed is a failure.
3. The hostile inputs and process faults of issue 22 (``attack_hostile``): code planted in a
   checkpoint, SQL in ``runs --where``, files and symlinks of the user's in a run directory and
   beside ``pretrain --out``, YAML bombs, non-finite and huge config values, bad model config.json
   values, two sweeps into one folder, SIGTERM and Ctrl-C, an edited config on resume. Each check
   is classed (security, loss, corruption, hang, wrong, traceback) and the summary counts the
   failures per class.
4. Issue 42's round 2 (``attack_issue42``): ``timlab export`` (files planted in a checkpoint,
   the user's folder beside ``--out``, two exports racing to one ``--out``, a damaged latest
   checkpoint), the dataset task (a catastrophic regex verifier, a 20 MB line, deep JSON, lone
   surrogates, CSV rows longer than the header, float32 Parquet answers), chat templates with
   nested loops, MoE config.json fields, a sweep folder of another instruction set,
   ``mismatch.start_step`` past the last step, and ``timlab config --set`` values ``train`` refuses.
5. Issue 59's findings outside the study engine (``attack_issue59a``): ``scripts/keep_runs.py``
   through symlinks and with folders the index does not name, safetensors index shards outside the
   model folder (or a FIFO, or /dev/zero), a regex compile bomb, 60 million Parquet rows, a chat
   template printing 3e8 characters, an unreachable ``mismatch.target_k3``, a negative
   ``run.alarm_threshold``, ``analyze RUN_DIR`` and a run resumed after its last checkpoint.

6. Issue 59's study-engine findings (``attack_issue59_study``): a FINDINGS write past a file-size
   limit, study text holding a block marker, huge format widths, a base.config changed after the
   freeze, a sweep whose index and freeze were deleted, a block of no seed, steps the runs do not
   train, names and arms given twice, an amendment dated before the freeze, a fingerprint YAML
   reads as a number, a study that names itself.

Usage: ``OMP_NUM_THREADS=1 python bench/attack.py [--kills N] [--seed S] [--out DIR] [--only hostile|issue42|issue59a|issue59-study]``;
prints one line per attack and a summary, exit code 1 if anything failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
TIMLAB = [sys.executable, "-m", "timlab"]
SNAPSHOT: Path | None = None  # a frozen copy of the package: every run of one attack sees the same code
TRAIN_SETS = ["--set", "run.steps=12", "--set", "run.checkpoint_every=3", "--set", "run.eval_every=3"]
TIMING = ("train/step_time_s", "train/tokens_per_s")


def sh(args: list[str], *, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*TIMLAB, *args], capture_output=True, text=True, timeout=timeout, cwd=SNAPSHOT)


_BATCH = r"""
import contextlib, io, json, sys, traceback
from timlab import cli
out = []
for args in json.loads(sys.argv[1]):
    err, so = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(so):
        try:
            rc = cli.main(args)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            rc = 1
    out.append({"rc": rc, "stdout": so.getvalue(), "stderr": err.getvalue()})
print(json.dumps(out))
"""


def sh_batch(cases: list[list[str]], *, timeout: float = 900) -> list[subprocess.CompletedProcess]:
    """``sh`` for many commands that each end in well under a second once timlab is imported: one
    Python process runs them through ``cli.main`` in turn (a traceback is printed as the CLI would)."""
    p = subprocess.run([sys.executable, "-c", _BATCH, json.dumps(cases)], capture_output=True, text=True,
                       timeout=timeout, cwd=SNAPSHOT)
    assert p.returncode == 0, p.stderr[-2000:]
    return [subprocess.CompletedProcess(args, r["rc"], r["stdout"], r["stderr"])
            for args, r in zip(cases, json.loads(p.stdout.strip().splitlines()[-1]))]


def kill_at_random(args: list[str], rng: random.Random, lo: float, hi: float) -> bool:
    """Start ``timlab args``, kill -9 it after a random delay; True if it was still running."""
    p = subprocess.Popen([*TIMLAB, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=SNAPSHOT,
                         start_new_session=True)
    try:
        p.wait(timeout=rng.uniform(lo, hi))
        return False
    except subprocess.TimeoutExpired:
        os.kill(p.pid, signal.SIGKILL)  # the main process only: its workers must follow by themselves
        p.wait()
        return True


def metrics(run: Path) -> pd.DataFrame:
    df = pd.read_parquet(run / "metrics.parquet")
    return df.drop(columns=[c for c in df.columns if c in TIMING or c.startswith("time/")])


def same_run(a: Path, b: Path) -> str | None:
    """None when run b ended bit for bit like run a, else what differs."""
    try:
        pd.testing.assert_frame_equal(metrics(a), metrics(b))
    except AssertionError as e:
        return f"metrics differ: {str(e).splitlines()[0]}"
    if (a / "distributions.jsonl").read_bytes() != (b / "distributions.jsonl").read_bytes():
        return "distributions.jsonl differs"
    wa = sorted((a / "checkpoints").glob("step_*"))[-1] / "model.safetensors"
    wb = sorted((b / "checkpoints").glob("step_*"))[-1] / "model.safetensors"
    if wa.read_bytes() != wb.read_bytes():
        return "final weights differ"
    if json.loads((b / "status.json").read_text())["state"] != "finished":
        return "status is not finished"
    return None


class Tally:
    def __init__(self):
        self.results: list[tuple[str, bool, str]] = []
        self.kind = "other"  # the class of the checks being added (issue 22's classes)
        self.kinds: list[str] = []

    def add(self, name: str, ok: bool, detail: str = "") -> None:
        self.results.append((name, ok, detail))
        self.kinds.append("traceback" if "TRACEBACK" in detail else self.kind)
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)

    def one_line(self, name: str, p: subprocess.CompletedProcess, *, rc: tuple = (2,)) -> None:
        err = p.stderr.strip()
        if "Traceback" in p.stderr:
            self.add(name, False, "TRACEBACK " + err.splitlines()[-1][:160])
        elif p.returncode not in rc:
            self.add(name, False, f"rc {p.returncode}: {err[-160:]}")
        elif p.returncode != 0 and len([ln for ln in err.splitlines() if ln.startswith("timlab: error")]) != 1:
            self.add(name, False, f"not one error line: {err[-160:]}")
        else:
            self.add(name, True, (err.splitlines() or [""])[-1][:140])


# ------------------------------------------------------------------------------------ kills
def attack_train(t: Tally, work: Path, rng: random.Random, kills: int) -> None:
    ref = work / "train_ref"
    p = sh(["train", "--preset", "smoke", "--run-dir", str(ref), "--quiet", *TRAIN_SETS])
    assert p.returncode == 0, p.stderr
    for k in range(kills):
        run = work / f"train_{k}"
        fresh = ["train", "--preset", "smoke", "--run-dir", str(run), "--quiet", *TRAIN_SETS]
        args = fresh
        n = 0
        while kill_at_random(args, rng, 1.0, 7.0 + n):  # kill, then resume, until a session finishes
            if (run / "status.json").exists() and json.loads((run / "status.json").read_text())["state"] == "finished":
                break  # killed while exiting, after the run had finished: not a kill of the run
            n += 1
            # what a user does: --resume once the run wrote its config.yaml; killed before that
            # (while Python and torch load), nothing was started, so the same command again
            args = ["train", "--run-dir", str(run), "--resume", "--quiet"] if (run / "config.yaml").exists() else fresh
        if not (run / "metrics.parquet").exists():  # a session that exited on its own without a run
            p = sh(args)
            t.one_line(f"train session {k} exited before writing a run", p, rc=(0,))
            continue
        diff = same_run(ref, run)
        t.add(f"train killed {n}x then resumed", diff is None, diff or "bitwise equal to the uninterrupted run")


def attack_sweep(t: Tally, work: Path, rng: random.Random, kills: int) -> None:
    spec = work / "spec.yaml"
    spec.write_text("base: {preset: smoke, set: {run.steps: 8, run.checkpoint_every: 2}}\n"
                    "conditions: [{name: a}, {name: b, set: {optim.lr: 1e-3}}]\ngrid: {run.seed: [0, 1]}\nworkers: 2\n")
    ref = work / "sweep_ref"
    p = sh(["sweep", str(spec), "--out", str(ref), "--quiet"])
    assert p.returncode == 0, p.stderr
    for k in range(kills):
        out = work / f"sweep_{k}"
        n = 0
        while n < 2 and kill_at_random(["sweep", str(spec), "--out", str(out), "--quiet"], rng, 4.0, 14.0):
            n += 1
            time.sleep(1.5)  # the workers' parent-death watch fires within a second
        p = sh(["sweep", str(spec), "--out", str(out), "--quiet"])
        diffs = [f"{r.name}: {d}" for r in sorted(ref.iterdir()) if r.is_dir()
                 for d in [same_run(r, out / r.name)] if d]
        ok = p.returncode == 0 and not diffs and "Traceback" not in p.stderr
        t.add(f"sweep killed {n}x then rerun", ok, "; ".join(diffs) or p.stderr.strip()[-160:] or "4 runs bitwise equal")


def attack_pretrain(t: Tally, work: Path, rng: random.Random, kills: int) -> None:
    env_cache = os.environ["TIMLAB_CACHE"]
    sets = ["--set", "model.pretrain_steps=150", "--set", "task.n_train=200"]
    ref = work / "pre_ref"
    p = sh(["pretrain", "--preset", "smoke", "--out", str(ref), "--quiet", *sets])
    assert p.returncode == 0, p.stderr
    for k in range(kills):
        out = work / f"pre_{k}"
        n = 0
        while n < 3 and kill_at_random(["pretrain", "--preset", "smoke", "--out", str(out), "--quiet", *sets], rng,
                                       2.0, 6.0):
            n += 1
        if not (out / "pretrain.json").exists():
            p = sh(["pretrain", "--preset", "smoke", "--out", str(out), "--quiet", *sets])
        same = (out / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
        t.add(f"pretrain killed {n}x then rerun", same, "weights bitwise equal" if same else "weights differ")
    os.environ["TIMLAB_CACHE"] = env_cache


# ------------------------------------------------------------------------------------ bad inputs
def attack_inputs(t: Tally, work: Path) -> None:
    w = work / "bad"
    w.mkdir()
    ok_run = work / "train_ref"

    # 1. a folder of the user's own: refused, untouched
    mine = w / "mymodels"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    (mine / "sub" / "data.csv").write_text("a,b\n")
    t.one_line("pretrain --out a folder of the user's", sh(["pretrain", "--preset", "smoke", "--out", str(mine)]))
    t.add("  ... its files kept", (mine / "notes.txt").exists() and (mine / "sub" / "data.csv").exists())

    # 2. two trains on one fresh run dir, two resumes on one run dir
    for what in ("fresh", "resume"):
        run = w / f"concurrent_{what}"
        if what == "fresh":
            cmd = ["train", "--preset", "smoke", "--run-dir", str(run), "--quiet", *TRAIN_SETS]
        else:
            shutil.copytree(ok_run, run)
            shutil.rmtree(run / "checkpoints" / "step_000012")
            cmd = ["train", "--run-dir", str(run), "--resume", "--quiet"]
        procs = [subprocess.Popen([*TIMLAB, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=SNAPSHOT)
                 for _ in range(2)]
        outs = [p.communicate() + (p.returncode,) for p in procs]
        rcs = sorted(o[2] for o in outs)
        lines = len((run / "distributions.jsonl").read_text().splitlines())
        tb = any("Traceback" in o[1] for o in outs)
        busy = any("in use by process" in o[1] for o in outs)
        t.add(f"two concurrent trains ({what})", not tb and lines == 12 and (rcs == [0, 0] or (rcs == [0, 2] and busy)),
              f"rcs {rcs}, {lines} distribution lines, busy error: {busy}")

    # 3-5. killed before the first checkpoint, damaged checkpoints, a cut line
    def damaged(name: str, fn, *, expect: str | None = None) -> None:
        run = w / name
        shutil.copytree(ok_run, run)
        fn(run)
        p = sh(["train", "--run-dir", str(run), "--resume", "--quiet"])
        t.one_line(f"resume: {name}", p, rc=(0,))
        if p.returncode == 0:
            d = same_run(ok_run, run)
            t.add(f"  ... {name} bitwise equal", d is None, d or (expect or ""))

    def no_ckpt(r):
        shutil.rmtree(r / "checkpoints")

    def trunc(r, f="model.safetensors", keep=1000):
        p = r / "checkpoints" / "step_000012" / f
        p.write_bytes(p.read_bytes()[:keep])

    def garbage(r):
        p = r / "checkpoints" / "step_000012" / "model.safetensors"
        p.write_bytes(os.urandom(p.stat().st_size))

    def cut_line(r):
        shutil.rmtree(r / "checkpoints" / "step_000012")
        with open(r / "distributions.jsonl", "a") as f:
            f.write('{"step": 13, "histogram": {"ed')

    damaged("killed before the first checkpoint", no_ckpt)
    damaged("truncated model.safetensors", trunc)
    damaged("random-bytes model.safetensors", garbage)
    damaged("truncated trainer_state.pt", lambda r: trunc(r, "trainer_state.pt", 100))
    damaged("deleted config.json", lambda r: (r / "checkpoints" / "step_000012" / "config.json").unlink())
    damaged("cut last line of distributions.jsonl", cut_line)

    # 6. malformed config.yaml; 7. a run dir that is a file
    run = w / "badyaml"
    shutil.copytree(ok_run, run)
    (run / "config.yaml").write_text("run: [steps: 3\n")
    t.one_line("resume with malformed config.yaml", sh(["train", "--run-dir", str(run), "--resume"]))
    (w / "afile").write_text("mine")
    t.one_line("--run-dir is a file", sh(["train", "--preset", "smoke", "--run-dir", str(w / "afile")]))

    # 8. config values
    for s in ["model.hidden_size=0", "model.num_heads=0", "model.pretrain_steps=0", "run.device=cuda",
              "task.kwargs.max_len=100000", "task.n_train=0", "optim.lr=nan", "model.num_layers=0"]:
        t.one_line(f"--set {s}", sh(["train", "--preset", "smoke", "--run-dir", str(w / "cfg"), "--set", s]))
    spec = work / "spec.yaml"
    t.one_line("sweep --workers -1", sh(["sweep", str(spec), "--out", str(w / "sw"), "--workers", "-1"]))

    # 9. model folders
    src = sorted((ok_run / "checkpoints").glob("step_*"))[-1]
    for name, fn in [("config.json a list", lambda m: (m / "config.json").write_text("[1]")),
                     ("corrupt tokenizer.json", lambda m: (m / "tokenizer.json").write_text("{oops")),
                     ("truncated model.safetensors", lambda m: (m / "model.safetensors").write_bytes(
                         (m / "model.safetensors").read_bytes()[:300])),
                     ("garbage model.safetensors", lambda m: (m / "model.safetensors").write_bytes(os.urandom(3000)))]:
        m = w / ("model_" + name.replace(" ", "_"))
        shutil.copytree(src, m)
        fn(m)
        t.one_line(f"probe --model with {name}", sh(["probe", "--model", str(m), "--task", "reverse", "--num-prompts", "2"]))
        t.one_line(f"train model.path with {name}", sh(["train", "--preset", "smoke", "--run-dir", str(w / "mp"),
                                                        "--set", f"model.path={m}"]))
        t.add("  ... a retry is a fresh start", not (w / "mp" / "config.yaml").exists())

    # 10. outputs that are folders; 11. -1e308 log-probs
    data = w / "inf.jsonl"
    data.write_text("".join(json.dumps({"trainer_logprobs": [-0.1, -1e308], "rollout_logprobs": [-0.2, -0.3]}) + "\n"
                            for _ in range(4)))
    (w / "outdir").mkdir()
    t.one_line("analyze --json DIR", sh(["analyze", str(data), "--json", str(w / "outdir")]))
    t.one_line("analyze --out DIR", sh(["analyze", str(data), "--out", str(w / "outdir")]))
    t.one_line("report --out DIR", sh(["report", str(ok_run), "--out", str(w / "outdir")]))
    t.one_line("probe --json DIR", sh(["probe", "--model", str(src), "--task", "reverse", "--json", str(w / "outdir")]))
    t.add("  ... no .tmp left", not list(w.glob("*.tmp")) and not list((w / "outdir").iterdir()))
    p = sh(["analyze", str(data), "--out", str(w / "inf.html"), "--json", str(w / "inf.json")])
    t.one_line("analyze -1e308 log-probs (refused: its means would overflow)", p)
    t.add("  ... the error names the column", "column trainer_logprobs" in p.stderr, p.stderr.strip()[-160:])
    with data.open("a") as f:  # the same rows after good ones: those are analyzed, with finite means
        f.write("".join(json.dumps({"trainer_logprobs": [-0.1, -0.2], "rollout_logprobs": [-0.2, -0.3]}) + "\n"
                        for _ in range(4)))
    p = sh(["analyze", str(data), "--out", str(w / "inf.html"), "--json", str(w / "inf.json")])
    t.one_line("analyze -1e308 rows among good ones", p, rc=(1,))
    try:
        json.loads((w / "inf.json").read_text(), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        t.add("  ... --json is standard JSON", True)
    except (ValueError, OSError) as e:
        t.add("  ... --json is standard JSON", False, str(e))
    t.add("  ... the means are finite", "inf" not in p.stdout, p.stdout[:160])

    # 13. a full disk (needs permission to mount a small tmpfs)
    mnt = w / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mnt)], capture_output=True).returncode == 0:
        try:
            p = sh(["train", "--preset", "smoke", "--run-dir", str(mnt / "run"), "--quiet", *TRAIN_SETS])
            t.one_line("train on a full disk", p)
            st = json.loads((mnt / "run" / "status.json").read_text()).get("state")
            t.add("  ... status failed, no .tmp left", st == "failed" and not list((mnt / "run").glob("*.tmp")), f"state {st}")
        finally:
            subprocess.run(["umount", str(mnt)])
    else:
        print("skip train on a full disk: cannot mount a tmpfs here", flush=True)

    # 14. smaller ones
    bad = w / "prompts.txt"
    bad.write_bytes(b"abc\n\xff\xfe\n")
    p = sh(["probe", "--model", str(src), "--prompts", str(bad)])
    t.one_line("probe --prompts non-UTF-8", p)
    t.add("  ... names the file", str(bad) in p.stderr)
    p = sh(["train", "--run-dir", str(ok_run), "--resume", "--quiet"])
    t.add("resume a finished run reports its last row", p.returncode == 0 and "done: step=12," in p.stdout, p.stdout.strip())


# ------------------------------------------------------------------------------------ issue 22
def _wait_for(pred, timeout: float) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        try:
            if pred():
                return True
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    return False


def _status(run: Path) -> dict:
    return json.loads((run / "status.json").read_text())


def attack_hostile(t: Tally, work: Path) -> None:
    w = work / "hostile"
    w.mkdir()
    ref = work / "train_ref"
    if not ref.exists():
        assert sh(["train", "--preset", "smoke", "--run-dir", str(ref), "--quiet", *TRAIN_SETS]).returncode == 0
    marker = w / "PWNED"

    # ---- security
    t.kind = "security"
    run = w / "pickle"
    shutil.copytree(ref, run)
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    code = (f"import os, torch\nclass P:\n    def __reduce__(self): return (os.mkdir, ({str(marker)!r},))\n"
            f"torch.save({{'step': 12, 'p': P()}}, {str(ckpt / 'trainer_state.pt')!r})\n"
            "from timlab.rundir.checkpoint import _write_manifest\n"
            f"_write_manifest(__import__('pathlib').Path({str(ckpt)!r}), 12)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=SNAPSHOT, capture_output=True)
    nomanifest = w / "nomanifest"
    shutil.copytree(ref, nomanifest)
    (sorted((nomanifest / "checkpoints").glob("step_*"))[-1] / "manifest.json").unlink()
    ps = sh_batch([["train", "--run-dir", str(run), "--resume", "--quiet"],
                   ["train", "--run-dir", str(nomanifest), "--resume", "--quiet"]])
    t.add("resume with a pickle planted in the latest checkpoint (manifest matching)",
          not marker.exists() and "Traceback" not in ps[0].stderr, f"rc {ps[0].returncode}, code ran: {marker.exists()}")
    p = ps[1]
    t.add("resume: a checkpoint without manifest.json is passed over", p.returncode == 0 and "manifest" in p.stderr,
          p.stderr.strip().splitlines()[0][:140] if p.stderr.strip() else "no warning")
    sweep = w / "sw_where"
    (sweep / "r").mkdir(parents=True)
    pd.DataFrame({"run_id": ["r"], "run_dir": ["r"], "state": ["finished"], "mismatch.magnitude": [1.0]}).to_parquet(
        sweep / "index.parquet")
    wheres = [f"1=1; COPY (SELECT 'x') TO '{w / 'copied.csv'}'", "1=1 UNION SELECT * FROM read_text('/etc/passwd')",
              "run_id IN (SELECT content FROM read_text('/etc/passwd'))", "1=1 --", "length(run_id) > 0", "nope > 1"]
    for where, p in zip(wheres, sh_batch([["runs", str(sweep), "--where", where] for where in wheres])):
        t.one_line(f"runs --where {where[:50]!r}", p)
    t.add("  ... COPY wrote nothing", not (w / "copied.csv").exists())

    # ---- data loss
    t.kind = "loss"
    cases, checks = [], []
    for name in ("status.json", "run.lock", "distributions.jsonl"):
        for link in (False, True):
            run = w / f"foreign_{name}_{'link' if link else 'file'}"
            run.mkdir()
            target = w / f"outside_{name}_{link}.txt"
            target.write_text("precious\n")
            (run / name).symlink_to(target) if link else (run / name).write_text("precious\n")
            cases.append(["train", "--preset", "smoke", "--run-dir", str(run), "--quiet", *TRAIN_SETS])
            checks.append((f"fresh train beside the user's {name}{' (a symlink)' if link else ''}",
                           lambda run=run, name=name, target=target: target.read_text() == "precious\n"
                           and (run / name).read_text() == "precious\n"))
    for (name, kept), p in zip(checks, sh_batch(cases)):
        t.one_line(name, p)
        t.add("  ... left untouched", kept())
    (w / "m.lock").write_text("precious\n")
    (w / "m2.partial").mkdir()
    (w / "m2.partial" / "config.json").write_text("precious\n")
    ps = sh_batch([["pretrain", "--preset", "smoke", "--out", str(w / "m")], ["pretrain", "--preset", "smoke", "--out",
                                                                             str(w / "m2")]])
    t.one_line("pretrain --out X beside the user's X.lock", ps[0])
    t.add("  ... X.lock untouched", (w / "m.lock").read_text() == "precious\n")
    t.one_line("pretrain --out X beside the user's X.partial/", ps[1])
    t.add("  ... X.partial untouched", (w / "m2.partial" / "config.json").read_text() == "precious\n")
    (w / "demo2").mkdir()
    (w / "demo2" / "sweep.yaml").write_text("precious: 1\n")
    demos = [["--seeds", "0"], ["--steps", "0"], ["--workers", "0"]]
    ps = sh_batch([["demo", "--out", str(w / "demo"), *args] for args in demos]
                  + [["demo", "--out", str(w / "demo2"), "--steps", "1"]])
    for args, p in zip(demos, ps):
        t.one_line(f"demo {' '.join(args)}", p)
    t.add("  ... wrote nothing", not (w / "demo").exists())
    t.one_line("demo --out D with the user's D/sweep.yaml", ps[-1])
    t.add("  ... sweep.yaml untouched", (w / "demo2" / "sweep.yaml").read_text() == "precious: 1\n")

    # ---- corruption and hangs
    t.kind = "corruption"
    spec = w / "two.yaml"
    spec.write_text("base: {preset: smoke, set: {run.steps: 6}}\ngrid: {run.seed: [0, 1]}\nworkers: 1\n")
    procs = [subprocess.Popen([*TIMLAB, "sweep", str(spec), "--out", str(w / "two"), "--quiet"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=SNAPSHOT) for _ in range(2)]
    outs = [pr.communicate(timeout=600) + (pr.returncode,) for pr in procs]
    rcs = sorted(o[2] for o in outs)
    busy = sum("in use by process" in o[1] for o in outs)
    states = pd.read_parquet(w / "two" / "index.parquet")["state"].tolist()
    t.add("two sweeps into one --out", rcs == [0, 2] and busy == 1 and states == ["finished"] * 2
          and not any("Traceback" in o[1] for o in outs), f"rcs {rcs}, busy {busy}, index states {states}")
    t.add("  ... no index temporary file left", not list((w / "two").glob("*.tmp")))
    t.kind = "hang"
    bombs = [w / f"bomb{i}.yaml" for i in range(3)]
    bombs[0].write_text("\n".join(["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] + [
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]) + "\n")
    bombs[1].write_text("base: &b\n  set: *b\n")
    bombs[2].write_text("base: {preset: smoke}\ngrid:\n  run.seed: " + json.dumps(list(range(1000)))
                        + "\n  mismatch.seed: " + json.dumps(list(range(1000))) + "\n")
    t0 = time.time()
    ps = sh_batch([["sweep", str(b), "--out", str(w / "bomb")] for b in bombs], timeout=300)
    took = time.time() - t0
    for what, p in zip(("a YAML alias bomb spec (10^10 nodes)", "a recursive YAML alias", "a 10^6-run grid"), ps):
        t.one_line(f"{what} ({len(p.stderr)} bytes of stderr)", p)
    t.add(f"  ... the three refused in {took:.1f}s with Python's start", took < 120 and not (w / "bomb").exists())
    model = w / "hugemodel"
    shutil.copytree(sorted((ref / "checkpoints").glob("step_*"))[-1], model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1000000}))
    t.one_line("probe a model of 10^6 layers", sh(["probe", "--model", str(model), "--task", "reverse"], timeout=120))
    (model / "config.json").write_text(json.dumps(cfg))
    (model / "model.safetensors").unlink()
    os.mkfifo(model / "model.safetensors")
    t.one_line("probe a model whose model.safetensors is a FIFO", sh(["probe", "--model", str(model), "--task", "reverse"],
                                                                     timeout=120))

    t.kind = "corruption"
    run = w / "term"
    pr = subprocess.Popen([*TIMLAB, "train", "--preset", "smoke", "--run-dir", str(run), "--quiet", *TRAIN_SETS],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=SNAPSHOT)
    _wait_for(lambda: _status(run)["step"] >= 5, 120)
    pr.send_signal(signal.SIGTERM)
    err = pr.communicate(timeout=60)[1]
    st = _status(run)
    t.add("SIGTERM: status.json failed at the step reached", pr.returncode == 143 and st["state"] == "failed"
          and 5 <= st["step"] < 12 and "SIGTERM" in st["message"], f"rc {pr.returncode}, {st}, {err.strip()[-80:]}")
    p = sh(["train", "--run-dir", str(run), "--resume", "--quiet"])
    d = same_run(ref, run) if p.returncode == 0 else p.stderr.strip()[-120:]
    t.add("  ... resumed bitwise equal to the uninterrupted run", d is None, d or "")
    spec = w / "ctrlc.yaml"
    spec.write_text("base: {preset: smoke, set: {run.steps: 40, run.checkpoint_every: 5}}\ngrid: {run.seed: [0, 1, 2, 3]}\n"
                    "workers: 1\n")
    pr = subprocess.Popen([*TIMLAB, "sweep", str(spec), "--out", str(w / "ctrlc"), "--quiet"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, cwd=SNAPSHOT, start_new_session=True)
    _wait_for(lambda: any(_status(r)["step"] >= 3 for r in (w / "ctrlc").iterdir() if (r / "status.json").exists()), 180)
    t0 = time.time()
    os.killpg(pr.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
    err = pr.communicate(timeout=120)[1]
    started = [r.name for r in (w / "ctrlc").iterdir() if (r / "status.json").exists()]
    t.add(f"Ctrl-C on a sweep stops in {time.time() - t0:.1f}s", time.time() - t0 < 30 and len(started) == 1
          and "Traceback" not in err, f"{len(started)} of 4 runs started, rc {pr.returncode}")

    t.kind = "wrong"
    run = w / "edited"
    shutil.copytree(ref, run)
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("lr: 0.0003", "lr: 0.003"))
    cos = w / "cos"
    abc = w / "stepabc"
    shutil.copytree(ref, abc)
    (abc / "checkpoints" / "step_abc").mkdir()
    ps = sh_batch([["train", "--preset", "smoke", "--run-dir", str(cos), "--quiet", "--set", "scheduler.name=cosine"],
                   ["train", "--run-dir", str(run), "--resume"],
                   ["train", "--run-dir", str(cos), "--resume", "--set", "run.steps=8"],
                   ["train", "--run-dir", str(abc), "--resume", "--quiet"]])
    t.one_line("resume after editing config.yaml (optim.lr)", ps[1])
    t.one_line("resume --set run.steps=8 on a 4-step cosine run", ps[2])
    t.one_line("resume beside a step_abc checkpoint folder", ps[3], rc=(0,))
    sets = ["mismatch.magnitude=.nan", "mismatch.magnitude=.inf", "algorithm.clip_low=.nan", "rollout.temperature=.nan",
            "rollout.temperature=1e-40", "rollout.samples_per_prompt=1", "correction.threshold=.inf"]
    dup = w / "dup.yaml"
    dup.write_text("optim:\n  lr: 1e-3\n  lr: 1e-4\n")
    src = sorted((ref / "checkpoints").glob("step_*"))[-1]
    models = [("tie_word_embeddings 'false'", {"tie_word_embeddings": "false"}),
              ("vocab_size 'abc'", {"vocab_size": "abc"}), ("vocab_size null", {"vocab_size": None}),
              ("hidden_size -8", {"hidden_size": -8}), ("pad_token_id 10^6", {"pad_token_id": 10**6}),
              ("rope_parameters 'x'", {"rope_parameters": "x"}),
              ("rope factor 'abc'", {"rope_parameters": {"rope_type": "linear", "factor": "abc"}})]
    for i, (name, change) in enumerate(models):
        shutil.copytree(src, w / f"cfgmodel{i}")
        (w / f"cfgmodel{i}" / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()),
                                                                    **change}))
    raw = [b'{"model_type": "llama", "\xff": 1}', ("[" * 50000 + "]" * 50000).encode(),
           ('{"vocab_size": ' + "9" * 5000 + "}").encode()]
    for i, text in enumerate(raw):
        shutil.copytree(src, w / f"rawmodel{i}")
        (w / f"rawmodel{i}" / "config.json").write_bytes(text)
    bad = w / "badindex"
    bad.mkdir()
    (bad / "index.parquet").write_bytes(b"PAR1 damaged")
    tb_sets = ["run.steps=.inf", "run.steps=.nan", "run.seed=1e20", "run.seed=" + "9" * 400, "run.device=meta",
               "mismatch.magnitude=" + "9" * 400]
    cases = ([["train", "--preset", "smoke", "--run-dir", str(w / "cfg"), "--set", x] for x in sets]
             + [["train", str(dup), "--preset", "smoke", "--run-dir", str(w / "cfg")]]
             + [["probe", "--model", str(w / f"cfgmodel{i}"), "--task", "reverse"] for i in range(len(models))]
             + [["train", "--preset", "smoke", "--run-dir", str(w / "cfg"), "--set", x] for x in tb_sets]
             + [["probe", "--model", str(w / f"rawmodel{i}"), "--task", "reverse"] for i in range(len(raw))]
             + [["runs", str(bad)]])
    ps = iter(sh_batch(cases))
    for x in sets:
        t.one_line(f"--set {x}", next(ps))
    t.one_line("duplicate YAML key", next(ps))
    for name, _ in models:
        t.one_line(f"probe a model with {name}", next(ps))

    # ---- one-line errors
    t.kind = "traceback"
    for x in tb_sets:
        t.one_line(f"--set {x[:40]}", next(ps))
    for name in ("a non-UTF-8 config.json", "a deeply nested config.json", "a 5000-digit number in config.json"):
        t.one_line(f"probe a model with {name}", next(ps))
    t.one_line("runs on a damaged index.parquet", next(ps))


# ------------------------------------------------------------------------------------ issue 42
def _py(code: str, *, timeout: float = 300) -> subprocess.CompletedProcess | None:
    """Run Python code against the snapshot's timlab (the attacks a CLI call cannot aim); None when
    it ran past ``timeout``."""
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                              cwd=SNAPSHOT)
    except subprocess.TimeoutExpired:
        return None


def _timed(t: Tally, name: str, args: list[str], limit: float) -> None:
    """A CLI call that must end with a one-line error within ``limit`` seconds (Python's start included)."""
    t0 = time.time()
    try:
        p = sh(args, timeout=limit)
    except subprocess.TimeoutExpired:
        t.add(name, False, f"still running after {limit:.0f}s")
        return
    t.one_line(f"{name} ({time.time() - t0:.1f}s)", p)


def _dataset_args(run: Path, model: Path, *sets: str) -> list[str]:
    """``timlab train`` of the dataset task on ``model``, a tiny budget."""
    base = ["task.name=dataset", f"model.path={model}", "task.n_val=4", "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "run.steps=1", "run.eval_every=1", *sets]
    return ["train", "--run-dir", str(run), "--quiet", *[x for s in base for x in ("--set", s)]]


def attack_issue42(t: Tally, work: Path) -> None:
    """Issue 42's findings 1-6, 8, 10-17 and 20 (its `timlab check` findings: ``attack_issue42_check``)."""
    w = work / "issue42"
    w.mkdir()
    ref = work / "train_ref"
    if not ref.exists():
        assert sh(["train", "--preset", "smoke", "--run-dir", str(ref), "--quiet", *TRAIN_SETS]).returncode == 0
    prev, last = sorted((ref / "checkpoints").glob("step_*"))[-2:]
    secret = w / "secret.txt"
    secret.write_text("SECRET outside the run\n")

    def run_copy(name: str) -> Path:
        shutil.copytree(ref, w / name, symlinks=True)
        return w / name

    def leaked(folder: Path) -> bool:
        return folder.exists() and any(p.is_symlink() or "SECRET" in p.read_text(errors="ignore")
                                       for p in folder.iterdir())

    def sha(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    # ---- security: files from outside the run (finding 1)
    t.kind = "security"
    planted = run_copy("exp_planted")
    for name in ("vocab.json", "merges.txt"):
        (planted / "checkpoints" / last.name / name).symlink_to(secret)
    listed = run_copy("exp_listed")
    ck = listed / "checkpoints" / last.name
    (ck / "vocab.json").symlink_to(secret)
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"]["vocab.json"] = {"size": secret.stat().st_size, "sha256": sha(secret)}
    (ck / "manifest.json").write_text(json.dumps(manifest))
    outside = w / "outside_ckpt"  # a checkpoint that verifies, with the secret among its files
    shutil.copytree(last, outside)
    shutil.copyfile(secret, outside / "vocab.json")
    manifest = json.loads((outside / "manifest.json").read_text())
    manifest["files"]["vocab.json"] = {"size": secret.stat().st_size, "sha256": sha(secret)}
    (outside / "manifest.json").write_text(json.dumps(manifest))
    linked = run_copy("exp_linked")
    (linked / "checkpoints" / "step_000099").symlink_to(outside)
    ps = sh_batch([["export", str(planted), "--out", str(w / "o_planted")],
                   ["export", str(listed), "--step", str(int(last.name.split("_")[1])), "--out", str(w / "o_listed")],
                   ["export", str(linked), "--step", "99", "--out", str(w / "o_linked")]])
    t.one_line("export: symlinks planted as tokenizer files in the checkpoint", ps[0], rc=(0,))
    t.add("  ... nothing from outside the run exported", not leaked(w / "o_planted"),
          ", ".join(sorted(p.name for p in (w / "o_planted").iterdir())) if (w / "o_planted").exists() else "")
    t.one_line("export --step N: the manifest rewritten to name a planted symlink", ps[1])
    t.add("  ... nothing written", not (w / "o_listed").exists())
    t.one_line("export --step N: step_N a symlink to a checkpoint outside the run", ps[2])
    t.add("  ... nothing written", not leaked(w / "o_linked") and not (w / "o_linked").exists())

    # ---- data loss: the user's folder beside --out (finding 2)
    t.kind = "loss"
    mine = w / ".tmp_o_loss"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious\n")
    t.one_line("export beside the user's .tmp_OUT folder", sh(["export", str(ref), "--out", str(w / "o_loss")]), rc=(0,))
    t.add("  ... the user's folder untouched", (mine / "notes.txt").read_text() == "precious\n")

    # ---- corruption: two exports to one --out (finding 3), a damaged latest checkpoint (finding 16)
    t.kind = "corruption"
    want = {int(c.name.split("_")[1]): json.loads((c / "manifest.json").read_text())["files"]["model.safetensors"]["sha256"]
            for c in (prev, last)}
    for k in range(2):
        out = w / f"o_race{k}"
        procs = [subprocess.Popen([*TIMLAB, "export", str(ref), "--step", str(step), "--out", str(out)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=SNAPSHOT)
                 for step in sorted(want)]
        outs = [pr.communicate(timeout=300) + (pr.returncode,) for pr in procs]
        info = json.loads((out / "timlab_export.json").read_text()) if (out / "timlab_export.json").exists() else {}
        consistent = info.get("step") in want and sha(out / "model.safetensors") == want[info["step"]] \
            == info.get("model.safetensors sha256")
        scratch = [p.name for p in w.glob(f".{out.name}.export-*")] + [p.name for p in w.glob(f".tmp_{out.name}")]
        t.add(f"two exports (steps {' and '.join(map(str, sorted(want)))}) into one --out, round {k}",
              consistent and sorted(o[2] for o in outs) == [0, 2] and not scratch
              and not any("Traceback" in o[1] for o in outs),
              f"rcs {sorted(o[2] for o in outs)}, step {info.get('step')}, weights match it: {consistent}, "
              f"scratch left: {scratch}")
    t.kind = "wrong"
    damaged = run_copy("exp_damaged")
    weights = damaged / "checkpoints" / last.name / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    p = sh(["export", str(damaged), "--out", str(w / "o_damaged")])
    t.one_line("export without --step, the latest checkpoint fails its checksum", p, rc=(0,))
    t.add("  ... the older step exported, and a warning names the one passed over",
          f"exported step {int(prev.name.split('_')[1])}" in p.stdout and f"checkpoint {weights.parent} is unusable" in p.stderr,
          p.stderr.strip()[-160:])

    # ---- hangs: a backtracking regex (4), a nested-loop chat template (5), a 20 MB line (6), 10^9 experts (8)
    t.kind = "hang"
    t0 = time.time()
    p = _py("from timlab.tasks.verifiers import build_verifier\nfrom timlab.errors import TimlabError\n"
            "v = build_verifier('regex', pattern='(a|aa)+b')\ntry:\n    v.extract('a' * 40)\n    print('no error')\n"
            "except TimlabError as e:\n    print('timlab: error:', e)\n", timeout=60)
    took = time.time() - t0
    t.add(f"regex verifier (a|aa)+b on 40 a's ({took:.1f}s with Python's start)",
          p is not None and p.stdout.startswith("timlab: error: task.kwargs.pattern") and took < 30,
          "still running after 60s" if p is None else (p.stdout + p.stderr).strip()[-160:])
    qwen = w / "qwen"
    mk = subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_chat_model.py"), str(qwen)],
                        capture_output=True, text=True, cwd=SNAPSHOT)
    if mk.returncode != 0:
        t.add("make_tiny_chat_model (needs transformers) for the dataset-task attacks", False, mk.stderr.strip()[-160:])
        return
    loop = w / "qwen_loop"
    shutil.copytree(qwen, loop)
    (loop / "chat_template.jinja").write_text("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
                                              "{% endfor %}{{ messages[0]['content'] }}")
    _timed(t, "a chat template with range(99999) inside range(99999)", _dataset_args(w / "t_loop", loop), 180)
    huge = w / "huge.jsonl"
    with huge.open("w") as f:
        f.write(json.dumps({"question": "What is 1+2?", "answer": "3"}) + "\n")
        f.write(json.dumps({"question": "x" * 20_000_000 + " 3", "answer": "3"}) + "\n")
    _timed(t, "a 20 MB one-line prompt in a JSONL file", _dataset_args(w / "t_huge", qwen, f"task.kwargs.path={huge}"), 120)
    src = json.loads((last / "config.json").read_text())
    moe = {**src, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    models = [("num_experts 10^9", {"num_experts": 10**9}, "hang"),
              ("num_experts 'abc'", {"num_experts": "abc"}, "traceback"),
              ("num_experts null", {"num_experts": None}, "traceback"),
              ("mlp_only_layers 'ab'", {"mlp_only_layers": "ab"}, "traceback"),
              ("mlp_only_layers 5", {"mlp_only_layers": 5}, "traceback"),
              ("norm_topk_prob 'false'", {"norm_topk_prob": "false"}, "wrong"),
              ("num_experts 4.9", {"num_experts": 4.9}, "wrong")]
    for i, (name, change, kind) in enumerate(models):
        m = w / f"moe{i}"
        shutil.copytree(last, m)
        (m / "config.json").write_text(json.dumps({**moe, **change}))
        t.kind = kind
        _timed(t, f"probe an MoE config.json with {name}", ["probe", "--model", str(m), "--task", "reverse"], 120)

    # ---- tracebacks and wrong answers in dataset files (findings 11, 13, 14)
    t.kind = "traceback"
    deep = w / "deep.jsonl"
    deep.write_text('{"question": "q", "answer": "1"}\n{"question": "r", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    sur = w / "sur.jsonl"
    sur.write_text('{"question": "ab\\ud800c=", "answer": "1"}\n{"question": "q", "answer": "2"}\n')
    extra = w / "extra.csv"
    extra.write_text("question,answer\nabc0=,1,5,7\nq2,3\n")
    ps = sh_batch([_dataset_args(w / "t_deep", qwen, f"task.kwargs.path={deep}"),
                   _dataset_args(w / "t_sur", qwen, f"task.kwargs.path={sur}"),
                   _dataset_args(w / "t_extra", qwen, f"task.kwargs.path={extra}")])
    t.one_line("dataset: an answer nested 100,000 arrays deep", ps[0])
    t.one_line("dataset: a prompt with a lone surrogate", ps[1])
    t.kind = "wrong"
    t.one_line("dataset: a CSV row with more fields than the header", ps[2])
    t.add("  ... the error names the row", "row 2: 4 fields" in ps[2].stderr, ps[2].stderr.strip()[-120:])
    p = _py("import pyarrow as pa, pyarrow.parquet as pq\nfrom timlab.tasks import get_task\n"
            f"pq.write_table(pa.table({{'question': ['q'], 'answer': pa.array([1.1], pa.float32())}}), {str(w / 'f32.parquet')!r})\n"
            f"task = get_task('dataset', path={str(w / 'f32.parquet')!r}, verifier='exact')\n"
            "ex = task.examples()[0]\nprint(repr(ex.answer), task.reward(ex, '1.1'))\n")
    t.add("dataset: a float32 Parquet answer 1.1 scores a reply '1.1'",
          p is not None and p.stdout.strip() == "'1.1' 1.0", (p.stdout + p.stderr).strip()[-120:] if p else "timeout")

    # ---- wrong: sweep folders of two instruction sets (12), start_step past the end (17), config --set (20)
    here = _py("from timlab.machine import bits; print(bits())").stdout.strip()
    other = "AVX512" if here != "AVX512" else "avx2"
    spec = w / "isa.yaml"
    spec.write_text("base: {preset: smoke, set: {run.steps: 2}}\nworkers: 1\n")
    (w / "sw_isa").mkdir()
    (w / "sw_isa" / "sweep_isa.json").write_text(json.dumps({"isa": other}))
    sets = ["correction.rs=bogus", "model.dtype=float64", "run.device=cuda:-1"]
    ps = sh_batch([["sweep", str(spec), "--out", str(w / "sw_isa"), "--quiet"],
                   ["train", "--preset", "smoke", "--run-dir", str(w / "t_start"), "--set", "run.steps=4",
                    "--set", "mismatch.injector=head_perturb", "--set", "mismatch.start_step=100"],
                   *[["config", "--preset", "smoke", "--set", x] for x in sets]])
    t.one_line(f"sweep into a folder whose runs computed with {other} (this process: {here})", ps[0])
    t.add("  ... no run started", [p.name for p in (w / "sw_isa").iterdir() if p.is_dir()] == [])
    t.one_line("mismatch.start_step=100 on a 4-step run", ps[1])
    for x, p in zip(sets, ps[2:]):
        t.one_line(f"config --set {x}", p)
    if "avx512f" in Path("/proc/cpuinfo").read_text():
        both = w / "isa2.yaml"
        both.write_text("base: {preset: smoke, set: {run.steps: 2}}\ngrid: {run.seed: [0, 1]}\nworkers: 1\n")
        first = sh(["--isa", "avx2", "sweep", str(spec), "--out", str(w / "sw_mixed"), "--quiet"])
        p = sh(["sweep", str(both), "--out", str(w / "sw_mixed"), "--quiet"])
        t.add("an unpinned sweep after an AVX2-pinned one, one folder", first.returncode == 0 and p.returncode == 2
              and "never mixes instruction sets" in p.stderr, f"rcs {first.returncode}, {p.returncode}: {p.stderr[-120:]}")
    else:
        print("skip a real pinned-then-unpinned sweep: this CPU has no AVX-512 (the planted record above stands in)",
              flush=True)


def attack_issue42_check(t: Tally, work: Path) -> None:
    """Issue 42's `timlab check` findings 7, 9, 18 and 19: sizes bounded, an overflowing seed, a
    repeated length name and a gate metric without a threshold, each one line and exit 2, fast."""
    model = work / "issue42_check_model"
    if not model.exists():
        assert sh(["pretrain", "--preset", "smoke", "--out", str(model)]).returncode == 0
    base = ["check", "--model", str(model), "--lengths", "s=4:4", "--batch-sizes", "1"]
    t.kind = "hang"
    _timed(t, "check --boot 1000000000", [*base, "--boot", "1000000000"], 60)
    _timed(t, "check --batch-sizes 99999999", [*base[:-2], "--batch-sizes", "99999999"], 60)
    t.kind = "traceback"
    _timed(t, "check --seed 100000000000000000000000", [*base, "--seed", "100000000000000000000000"], 60)
    t.kind = "wrong"
    _timed(t, "check --lengths a=1:1,a=2:2 (a repeated name)", [*base[:3], "--batch-sizes", "1", "--lengths", "a=1:1,a=2:2"], 60)
    _timed(t, "check --gate-metric k3_kl without --fail-above", [*base, "--gate-metric", "k3_kl"], 60)


# ------------------------------------------------------------------------------------ issue 59 (a)
def _sharded_model(src: Path, out: Path) -> Path:
    """A copy of the model folder ``src`` with its weights split into two shards and an index."""
    shutil.copytree(src, out)
    p = _py("import json, sys\nfrom pathlib import Path\nfrom safetensors.torch import load_file, save_file\n"
            f"d = Path({str(out)!r})\nw = load_file(str(d / 'model.safetensors'))\nkeys = sorted(w)\n"
            "names = {k: f'model-0000{1 + i % 2}-of-00002.safetensors' for i, k in enumerate(keys)}\n"
            "for s in sorted(set(names.values())):\n    save_file({k: w[k].contiguous() for k in keys if names[k] == s}, str(d / s))\n"
            "(d / 'model.safetensors').unlink()\n"
            "(d / 'model.safetensors.index.json').write_text(json.dumps({'weight_map': names}))\n")
    assert p is not None and p.returncode == 0, (p.stderr if p else "timeout")[-500:]
    return out


def _point_shard(folder: Path, name: str) -> None:
    """The index's second shard named ``name`` instead."""
    index = folder / "model.safetensors.index.json"
    wm = json.loads(index.read_text())["weight_map"]
    first = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps({"weight_map": {k: v if v == first else name for k, v in wm.items()}}))


def attack_issue59a(t: Tally, work: Path) -> None:
    """Issue 59's findings 1, 2, 5-8, 10 and 21-25 (keep_runs, model-folder shards, the regex
    verifier's compile, Parquet rows, chat-template output, the k3 controller's cap, the alarm
    threshold, analyze on a folder, a resumed run's columns). The other findings (the study engine)
    are attacked in their own section."""
    w = work / "issue59a"
    w.mkdir()
    ref = work / "train_ref"
    if not ref.exists():
        assert sh(["train", "--preset", "smoke", "--run-dir", str(ref), "--quiet", *TRAIN_SETS]).returncode == 0
    last = sorted((ref / "checkpoints").glob("step_*"))[-1]

    # ---- security: keep_runs through symlinks (1), folders that are not the index's runs (21)
    t.kind = "security"
    (SNAPSHOT / "scripts").mkdir(exist_ok=True)
    shutil.copy(REPO / "scripts" / "keep_runs.py", SNAPSHOT / "scripts" / "keep_runs.py")
    keep = [sys.executable, str(SNAPSHOT / "scripts" / "keep_runs.py")]
    src, dst, outside = w / "work_sweep", w / "repo_sweep", w / "outside"
    src.mkdir()
    outside.mkdir()
    victim, secret = outside / "victim.txt", outside / "secret.txt"
    victim.write_text("precious\n")
    secret.write_text("SECRET\n")
    for name in ("a_s0__x", "b_s0__x"):
        shutil.copytree(ref, src / name, ignore=shutil.ignore_patterns("checkpoints", "*.jsonl", "run.lock"))
    pd.DataFrame({"run_id": ["a_s0__x", "b_s0__x", "c\nfake__x"]}).to_parquet(src / "index.parquet", index=False)
    shutil.copytree(src / "a_s0__x", src / "stray__x")  # a finished run the index does not name
    (src / "other__x").symlink_to(ref)  # another sweep's run, linked in
    dst.mkdir()
    (dst / "a_s0__x").symlink_to(outside)
    (outside / "config.yaml").symlink_to(victim)
    p = subprocess.run([*keep, str(src), str(dst)], capture_output=True, text=True, cwd=SNAPSHOT)
    t.add("keep_runs: a repository run folder that is a symlink out of it", p.returncode != 0
          and "is a symlink" in p.stderr and victim.read_text() == "precious\n" and "Traceback" not in p.stderr,
          f"rc {p.returncode}: {p.stderr.strip()[-140:]}")
    (dst / "a_s0__x").unlink()
    (src / "b_s0__x" / "config.yaml").unlink()
    (src / "b_s0__x" / "config.yaml").symlink_to(secret)
    p = subprocess.run([*keep, str(src), str(dst)], capture_output=True, text=True, cwd=SNAPSHOT)
    leaked = [f.name for f in dst.rglob("*") if f.is_file() and "SECRET" in f.read_text(errors="ignore")]
    t.add("keep_runs: a work-sweep config.yaml that is a symlink to a secret", p.returncode != 0
          and "is a symlink" in p.stderr and not leaked, f"rc {p.returncode}, leaked {leaked}: {p.stderr.strip()[-120:]}")
    (src / "b_s0__x" / "config.yaml").unlink()
    shutil.copy(ref / "config.yaml", src / "b_s0__x" / "config.yaml")
    p = subprocess.run([*keep, str(src), str(dst)], capture_output=True, text=True, cwd=SNAPSHOT)
    t.kind = "wrong"
    kept = sorted(x.name for x in dst.iterdir())
    t.add("keep_runs: keeps only the index's runs, a newline in a name is escaped",
          p.returncode == 0 and kept == ["a_s0__x", "b_s0__x", "index.parquet"] and p.stdout == "a_s0__x\nb_s0__x\n"
          and "'c\\nfake__x'" in p.stderr, f"kept {kept}, out {p.stdout!r}, err {p.stderr.strip()[-100:]!r}")

    # ---- security and hangs: safetensors index shards (2, 5, 6)
    t.kind = "security"
    other = _sharded_model(last, w / "m_other")
    cases = [("../m_other/model-00002-of-00002.safetensors", "security"),
             (str(other / "model-00002-of-00002.safetensors"), "security"), ("/dev/zero", "hang")]
    models = []
    for i, (name, kind) in enumerate(cases):
        m = _sharded_model(last, w / f"m_shard{i}")
        _point_shard(m, name)
        models.append((m, name, kind))
    fifo = _sharded_model(last, w / "m_fifo")
    os.mkfifo(fifo / "fifo.safetensors")
    _point_shard(fifo, "fifo.safetensors")
    models.append((fifo, "a FIFO", "hang"))
    for m, name, kind in models:
        t.kind = kind
        _timed(t, f"probe --model: an index shard {name[:50]}", ["probe", "--model", str(m), "--task", "reverse"], 120)
    t.kind = "hang"
    zero = w / "m_shard2"
    _timed(t, "train: model.pretrain_init whose index names /dev/zero",
           ["train", "--preset", "smoke", "--run-dir", str(w / "t_zero"), "--set", f"model.pretrain_init={zero}"], 120)

    # ---- hangs and memory: a regex compile bomb (7), 60 million Parquet rows (8)
    t0 = time.time()
    p = _py("import resource\nfrom timlab.tasks.verifiers import build_verifier\nfrom timlab.errors import TimlabError\n"
            "try:\n    build_verifier('regex', pattern='((((a{100}){100}){100}){100})')\n    print('no error')\n"
            "except TimlabError as e:\n    print('timlab: error:', e)\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)\n", timeout=120)
    out = p.stdout.strip().splitlines() if p is not None else []
    t.add(f"regex verifier ((((a{{100}}){{100}}){{100}}){{100}}) ({time.time() - t0:.1f}s with Python's start)",
          len(out) == 2 and out[0].startswith("timlab: error: task.kwargs.pattern") and int(out[1]) < 1000,
          "still running after 120s" if p is None else f"{(p.stdout + p.stderr).strip()[-140:]} MB")
    t0 = time.time()
    many = w / "many.parquet"
    p = _py("import numpy as np, pyarrow as pa, pyarrow.parquet as pq, resource\n"
            "from timlab.tasks import get_task\nfrom timlab.errors import TimlabError\n"
            "idx = pa.array(np.zeros(60_000_000, dtype=np.int32))\n"
            "pq.write_table(pa.table({'question': pa.DictionaryArray.from_arrays(idx, pa.array(['What is 1+2?'])),"
            "'answer': pa.DictionaryArray.from_arrays(idx, pa.array(['3']))}), " + repr(str(many)) + ")\n"
            "del idx\nbase = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "try:\n    get_task('dataset', path=" + repr(str(many)) + ")\n    print('no error')\n"
            "except TimlabError as e:\n    print('timlab: error:', e)\n", timeout=300)
    t.add(f"dataset: a {many.stat().st_size // 1024 if many.exists() else '?'} KB Parquet file of 60 million repeated "
          f"rows ({time.time() - t0:.1f}s)", p is not None and "60,000,000 rows; the limit for a dataset file is" in p.stdout,
          "still running after 300s" if p is None else (p.stdout + p.stderr).strip()[-160:])

    # ---- crash: a chat template printing 3e8 characters (10)
    qwen = w / "qwen"
    mk = subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_chat_model.py"), str(qwen)],
                        capture_output=True, text=True, cwd=SNAPSHOT)
    if mk.returncode != 0:
        t.add("make_tiny_chat_model (needs transformers) for the chat-template attack", False, mk.stderr.strip()[-160:])
    else:
        (qwen / "chat_template.jinja").write_text("{% for i in range(99999) %}{{ 'x' * 3000 }}{% endfor %}"
                                                  "{{ messages[0]['content'] }}")
        _timed(t, "a chat template printing 3e8 characters", _dataset_args(w / "t_print", qwen), 180)

    # ---- wrong: an unreachable k3 target (22), a negative alarm threshold (23), analyze on a run folder (24)
    t.kind = "wrong"
    run = w / "t_k3"
    p = sh(["train", "--preset", "smoke", "--run-dir", str(run), "--quiet", "--set", "run.steps=3", "--set",
            "run.checkpoint_every=3", "--set", "run.eval_every=3", "--set", "mismatch.injector=logit_noise", "--set",
            "mismatch.target_k3=1e6", "--set", "mismatch.magnitude=60"])
    st = _status(run) if (run / "status.json").exists() else {}
    mags = pd.read_parquet(run / "metrics.parquet")["mismatch/magnitude"].max() if (run / "metrics.parquet").exists() else None
    t.add("mismatch.target_k3=1e6 (unreachable): finished, magnitude capped, 'target not reached'",
          p.returncode == 0 and st.get("state") == "finished" and mags == 100.0
          and st.get("message", "").startswith("target not reached"), f"rc {p.returncode}, {st}, max magnitude {mags}")
    ps = sh_batch([["train", "--preset", "smoke", "--run-dir", str(w / "t_alarm"), "--set", "run.alarm=grad_norm_change",
                    "--set", "run.alarm_threshold=-1"],
                   ["train", "--preset", "smoke", "--run-dir", str(w / "t_alarm1"), "--set", "run.alarm=grad_norm_change",
                    "--set", "run.alarm_threshold=0.5"],
                   ["analyze", str(ref)]])
    t.one_line("run.alarm_threshold=-1", ps[0])
    t.one_line("run.alarm_threshold=0.5 on a change rule (a fold change below 1)", ps[1])
    t.one_line("analyze RUN_DIR without --alarm", ps[2])
    t.add("  ... says it is a folder and what a run folder needs", "is a folder" in ps[2].stderr
          and "--alarm" in ps[2].stderr, ps[2].stderr.strip()[-140:])

    # ---- wrong: a run resumed at its last checkpoint writes the columns of an uninterrupted one (25)
    resumed = w / "t_resumed"
    shutil.copytree(ref, resumed)
    st = _status(resumed)
    (resumed / "status.json").write_text(json.dumps({**st, "state": "running"}))  # kill -9 after the last checkpoint
    p = sh(["train", "--run-dir", str(resumed), "--resume", "--quiet"])
    a, b = (pd.read_parquet(r / "metrics.parquet").columns.tolist() for r in (ref, resumed))
    t.add("a run resumed after its last checkpoint: the columns of the uninterrupted run",
          p.returncode == 0 and a == b, f"rc {p.returncode}, missing {sorted(set(a) - set(b))}")


# ------------------------------------------------------------------------------------ issue 59: studies
_STUDY59 = r"""
import json, sys
from pathlib import Path
import numpy as np, pandas as pd
from timlab.experiments.studies.engine import planned_runs
from timlab.experiments.studies.registration import freeze, load_study
from timlab.rundir import RunDir
path, out = Path(sys.argv[1]), Path(sys.argv[2])
st = load_study(path)
freeze(st, out)
rows = []
for p in planned_runs(st):
    arm, seed = p.name.rsplit("_s", 1)
    steps = np.arange(st.steps + 1)
    acc = 0.9 - (0.1 if arm != "control" else 0.0) * (steps > 0) + 1e-3 * int(seed) * (steps > 0)
    k3 = np.where(steps > 0, 0.0 if arm == "control" else 0.05, np.nan)
    m = pd.DataFrame({"step": steps, "val/accuracy": acc, "val/gold_logprob": -0.3, "rollout_corr/k3_kl": k3,
                      "mismatch/frac_bitwise_equal": np.where(steps > 0, 1.0 if arm == "control" else 0.4, np.nan)})
    rd = RunDir(out / p.run_id)
    rd.path.mkdir(parents=True)
    m.to_parquet(rd.metrics_file, index=False)
    rd.config.write_text("run: {steps: %d}\n" % st.steps)
    rd.write_status("finished", step=st.steps, total_steps=st.steps)
    rows.append({"run_id": p.run_id, "run_dir": p.run_id, "spec_condition": p.name, "condition": p.name,
                 "state": "finished", "last_step": st.steps})
pd.DataFrame(rows).to_parquet(out / "index.parquet", index=False)
"""


def _study59(**over) -> dict:
    """A small study (control and head, 3 seeds, 4 steps on the smoke preset) as a mapping, with ``over``."""
    conds = [{"name": f"{a}_s{s}", "set": {"mismatch.injector": "none" if a == "control" else "head_perturb",
                                           "run.seed": s, "mismatch.seed": s}} for s in range(3) for a in ("control", "head")]
    d = {"study": "s59", "sweep": {"base": {"preset": "smoke", "set": {"run.steps": 4}}, "conditions": conds},
         "steps": 4, "endpoints": [{"name": "acc", "metric": "val/accuracy", "stat": "level", "window": [1, None]}],
         "families": [{"name": "cost", "endpoints": ["acc"], "rule": "lowers"}],
         "rules": [{"name": "lowers", "test": "below"}],
         "findings": {"file": "FINDINGS.md", "block": "s59"}}
    d.update(over)
    return d


def attack_issue59_study(t: Tally, work: Path) -> None:
    """Issue 59's study-engine findings (3, 4, 9, 11-20): hostile or careless study files and sweep
    folders, each refused in one line (exit 2) without a traceback or a file written, and a FINDINGS
    write under a file-size limit that leaves the file whole."""
    import yaml

    w = work / "issue59_study"
    w.mkdir()

    def study(name: str, d: dict) -> str:
        (w / name).write_text(yaml.safe_dump(d, sort_keys=False))
        return str(w / name)

    done = study("done.yaml", _study59())
    p = _py(_STUDY59.replace("sys.argv[1]", repr(done)).replace("sys.argv[2]", repr(str(w / "sw"))))
    assert p is not None and p.returncode == 0, p.stderr[-2000:] if p else "timed out"
    findings = w / "FINDINGS.md"
    findings.write_text("# F\n<!-- findings:s59 -->\nold\n<!-- /findings:s59 -->\n"
                        + "".join(f"hand-written prose, line {i}\n" for i in range(80)))

    # ---- loss: a FINDINGS write past a file-size limit (finding 3)
    t.kind = "loss"
    before = findings.read_bytes()
    limit = len(before) + 100
    p = _py("import resource, signal, sys\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\nfrom timlab import cli\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
            f"sys.exit(cli.main(['study', 'analyze', {done!r}, '--out', {str(w / 'sw')!r}, '--write']))\n")
    t.add("study analyze --write past a file-size limit: FINDINGS left whole, one line says so",
          p is not None and p.returncode == 2 and findings.read_bytes() == before
          and "the file is unchanged" in p.stderr and "Traceback" not in p.stderr,
          (p.stderr.strip().splitlines() or [""])[-1][:140] if p else "timed out")

    # ---- corruption, hangs and wrong results: each a one-line refusal (findings 4, 9, 13-20)
    fam = _study59()["families"][0]
    place = {"kind": "place", "study": "self.yaml", "endpoint": ["acc"], "k3": "acc", "arms": "head"}
    intel = [{"name": "amd", "isa": "avx2", "seeds": [0, 1, 2]}, {"name": "intel", "isa": "avx2-intel", "seeds": [7]}]
    fp = [{"name": "amd", "isa": "avx2", "seeds": [0, 1]}, {"name": "intel", "isa": "avx2-intel", "seeds": [2],
                                                            "fingerprint": 0}]
    bad = [  # (class, what, study file, command, words the error must hold)
        ("corruption", "a note holding the block's end marker (4)", study("marker.yaml", _study59(
            notes=["x <!-- /findings:s59 --> y"])), "check", "notes[0]: holds a FINDINGS block marker"),
        ("hang", "a family label {arm:>10000000000} (9)", study("wide.yaml", _study59(
            families=[{**fam, "label": "{arm:>10000000000}"}])), "check", "above the limit of 100"),
        ("hang", "a paragraph field {runs[acc].max:.999999999f} (9)", study("prec.yaml", _study59(
            paragraphs=["{runs[acc].max:.999999999f}"])), "check", "above the limit of 100"),
        ("wrong", "a block holding none of the sweep's seeds, study run (13)", study("noseed.yaml", _study59(
            blocks=intel, out=str(w / "sw13"))), "run", "holds none of the sweep's seeds"),
        ("wrong", "steps 5 over runs of run.steps 4 (14)", study("steps.yaml", _study59(steps=5)), "check",
         "every run must train the study's steps"),
        ("wrong", "two rules of one name (15)", study("rules.yaml", _study59(
            rules=[{"name": "lowers"}, {"name": "lowers", "test": "above"}])), "check", "two named 'lowers'"),
        ("wrong", "two families of one name (15)", study("fams.yaml", _study59(families=[fam, fam])), "check",
         "two named 'cost'"),
        ("wrong", "a family's arms [head, head] (16)", study("twice.yaml", _study59(
            families=[{**fam, "arms": ["head", "head"]}])), "check", "listed twice"),
        ("wrong", "a family's arms [control] (16)", study("self_arm.yaml", _study59(
            families=[{**fam, "arms": ["control"]}])), "check", "is the reference"),
        ("wrong", "a block fingerprint 000000000000 (YAML: 0) (18)", study("fp.yaml", _study59(blocks=fp)), "check",
         "fingerprint: expected text"),
        ("wrong", "a place fit naming its own study (19)", study("self.yaml", _study59(fits=[place])), "check",
         "references this study itself"),
        ("traceback", "study check of a block holding no run (20)", str(w / "noseed.yaml"), "check",
         "holds none of the sweep's seeds"),
    ]
    # (11, 12, 17): changes after the freeze, against the frozen sweep
    conf = w / "cfg.yaml"
    conf.write_text("run: {eval_every: 1}\n")
    based = _study59(out=str(w / "sw11"))
    based["sweep"]["base"]["config"] = "cfg.yaml"
    p = _py(_STUDY59.replace("sys.argv[1]", repr(study("based.yaml", based))).replace("sys.argv[2]", repr(str(w / "sw11"))))
    assert p is not None and p.returncode == 0, p.stderr[-2000:] if p else "timed out"
    conf.write_text("run: {eval_every: 2}\n")
    bad.append(("wrong", "a change inside the sweep's base.config after the freeze (11)", str(w / "based.yaml"),
                "analyze", "sweep.base.config.run.eval_every: 1 -> 2"))
    gone = w / "sw12"
    shutil.copytree(w / "sw", gone)
    (gone / "study.json").unlink()
    (gone / "index.parquet").unlink()
    changed = _study59(out=str(gone))
    changed["endpoints"][0]["window"] = [2, None]
    bad.append(("wrong", "study run of a changed registration over runs whose index and freeze were deleted (12)",
                study("gone.yaml", changed), "run", "holds runs but no frozen registration"))
    moved = _study59()
    moved["endpoints"][0]["window"] = [2, None]
    h = _py(f"from timlab.experiments.studies import study_from_dict\nimport yaml\n"
            f"print(study_from_dict(yaml.safe_load(open({study('moved.yaml', moved)!r}))).hash)")
    bad.append(("wrong", "an amendment dated 1990 over a freeze of today (17)", study("old.yaml", {
        **moved, "amendments": [{"date": "1990-01-01", "reason": "r", "hash": h.stdout.strip()}]}), "analyze",
        "before the registration was frozen"))
    cases = [["study", cmd, f] + (["--out", str(w / "sw")] if cmd != "run" and "out" not in yaml.safe_load(
        open(f)) and "blocks" not in yaml.safe_load(open(f)) else []) + (["--quiet"] if cmd == "run" else [])
             for _, _, f, cmd, _ in bad]
    t0 = time.time()
    ps = sh_batch(cases, timeout=600)
    for (kind, what, _, cmd, words), p in zip(bad, ps):
        t.kind = kind
        t.one_line(f"study {cmd}: {what}", p)
        if words not in p.stderr:
            t.add(f"  ... names it ({words})", False, p.stderr.strip()[-160:])
    t.kind = "wrong"
    t.add("  ... nothing frozen over the runs of finding 12, nothing trained for finding 13",
          not (gone / "study.json").exists() and not (w / "sw13").exists())
    print(f"  ({len(bad)} study files in {time.time() - t0:.1f}s)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5, help="kill-and-resume attacks per command (train; sweep and "
                                                          "pretrain get about half)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="work folder (default: a temporary one, removed)")
    ap.add_argument("--only", choices=("hostile", "issue42", "issue59a", "issue59-study"),
                    help="run only issue 22's hostile-input attacks, only issue 42's, only issue 59's findings "
                         "outside the study engine (issue59a), or only its study-engine findings (issue59-study)")
    args = ap.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="timlab-attack-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TIMLAB_CACHE", str(work / "cache"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    global SNAPSHOT
    SNAPSHOT = work / "src"
    shutil.copytree(REPO / "timlab", SNAPSHOT / "timlab", ignore=shutil.ignore_patterns("__pycache__"))
    os.environ["PYTHONPATH"] = str(SNAPSHOT)
    rng = random.Random(args.seed)
    t = Tally()
    t0 = time.time()
    if args.only is None:
        attack_train(t, work, rng, args.kills)
        attack_sweep(t, work, rng, max(1, args.kills // 2))
        attack_pretrain(t, work, rng, max(1, args.kills // 2))
        attack_inputs(t, work)
    if args.only in (None, "hostile"):
        attack_hostile(t, work)
    if args.only in (None, "issue42"):
        attack_issue42(t, work)
        attack_issue42_check(t, work)
    if args.only in (None, "issue59a"):
        attack_issue59a(t, work)
    if args.only in (None, "issue59-study"):
        attack_issue59_study(t, work)
    failed = [r for r in t.results if not r[1]]
    tracebacks = sum("TRACEBACK" in r[2] for r in t.results)
    by_kind = {k: sum(1 for kind, r in zip(t.kinds, t.results) if kind == k and not r[1])
               for k in ("security", "loss", "corruption", "hang", "wrong", "traceback")}
    print(f"\n{len(t.results)} checks, {len(failed)} failed, {tracebacks} tracebacks, {time.time() - t0:.0f}s; "
          "failed by class: " + ", ".join(f"{k} {n}" for k, n in by_kind.items()))
    if not args.out:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

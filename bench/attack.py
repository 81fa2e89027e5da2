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

Usage: ``OMP_NUM_THREADS=1 python bench/attack.py [--kills N] [--seed S] [--out DIR] [--only hostile]``;
prints one line per attack and a summary, exit code 1 if anything failed.
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5, help="kill-and-resume attacks per command (train; sweep and "
                                                          "pretrain get about half)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="work folder (default: a temporary one, removed)")
    ap.add_argument("--only", choices=("hostile",), help="run only issue 22's hostile-input attacks")
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
    if args.only != "hostile":
        attack_train(t, work, rng, args.kills)
        attack_sweep(t, work, rng, max(1, args.kills // 2))
        attack_pretrain(t, work, rng, max(1, args.kills // 2))
        attack_inputs(t, work)
    attack_hostile(t, work)
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

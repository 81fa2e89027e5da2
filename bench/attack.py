"""Attack the CLI as a hostile user would, and count what breaks.

1. kill -9 at random moments: ``timlab train`` (killed and resumed until it finishes),
   ``timlab sweep`` (its main process killed, the sweep rerun) and ``timlab pretrain --out``
   (killed, rerun), each checked bit for bit against an uninterrupted run: the metrics
   (timing columns aside), distributions.jsonl and the final weights.
2. Every bad input of issue 14, each run through the CLI: a traceback on stderr, a non-one-line
   error or a file timlab did not write that changed is a failure.

Usage: ``OMP_NUM_THREADS=1 python bench/attack.py [--kills N] [--seed S] [--out DIR]``; prints one
line per attack and a summary, exit code 1 if anything failed.
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

    def add(self, name: str, ok: bool, detail: str = "") -> None:
        self.results.append((name, ok, detail))
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
    t.one_line("analyze -1e308 log-probs", p, rc=(0,))
    try:
        json.loads((w / "inf.json").read_text(), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        t.add("  ... --json is standard JSON", True)
    except (ValueError, OSError) as e:
        t.add("  ... --json is standard JSON", False, str(e))

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5, help="kill-and-resume attacks per command (train; sweep and "
                                                          "pretrain get about half)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="work folder (default: a temporary one, removed)")
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
    attack_train(t, work, rng, args.kills)
    attack_sweep(t, work, rng, max(1, args.kills // 2))
    attack_pretrain(t, work, rng, max(1, args.kills // 2))
    attack_inputs(t, work)
    failed = [r for r in t.results if not r[1]]
    tracebacks = sum("TRACEBACK" in r[2] for r in t.results)
    print(f"\n{len(t.results)} checks, {len(failed)} failed, {tracebacks} tracebacks, {time.time() - t0:.0f}s")
    if not args.out:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

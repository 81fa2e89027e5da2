"""Sweep executors: the worker-process side of a sweep (``_worker_init``, the warm-start and run
jobs, progress forwarding) and the two pools that run the jobs, a local spawn-context process
pool and ray. A job never raises for a run that fails; it returns the run's state and message.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any, Callable, Iterator

from timlab.config import Config
from timlab.errors import TimlabError, one_line
from timlab.experiments.sweeps.spec import SweepError
from timlab.interrupts import Terminated, interrupt_once
from timlab.rundir import FAILED, RunDir, RunDirBusyError

_EVENTS = None  # the worker's progress queue (set by _worker_init)
_STOPPED = False  # set once a job in this worker was interrupted: later jobs do not start


def _die_with_parent(parent: int) -> None:
    """End this worker when the sweep's process dies, even by kill -9: the kernel sends SIGKILL
    on the parent's exit (Linux prctl PR_SET_PDEATHSIG), and a thread polls the parent pid where
    that is not available (a re-parented worker sees another ppid)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="timlab-parent-watch", daemon=True).start()


def _worker_init(events=None, parent: int | None = None) -> None:
    """Runs once in each worker process: die with the sweep, one thread (tiny models), the
    progress queue."""
    global _EVENTS
    if parent is not None:
        _die_with_parent(parent)
    interrupt_once()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    _EVENTS = events


def _emit(key: str):
    if _EVENTS is None:
        return None
    keys = ("train/reward_mean", "val/accuracy", "rollout_corr/k3_kl")

    def cb(phase: str, i: int, n: int, metrics: dict) -> None:
        small = {k: float(metrics[k]) for k in keys if k in metrics}
        try:
            _EVENTS.put_nowait((key, phase, int(i), int(n), small))
        except Exception:  # progress is best effort; never fail a run over it
            pass

    return cb


def _warm_job(cfg: Config) -> dict:
    """Build (or reuse) the cached SFT warm start of a config."""
    _worker_init(_EVENTS)
    from timlab.trainer.pretrain import ensure_warm_start, warm_start_dir

    cb = _emit(warm_start_dir(cfg).name)
    res = ensure_warm_start(cfg, progress=(lambda s, n, m: cb("pretrain", s, n, m)) if cb else None)
    return {"path": str(res.path), "cached": bool(res.cached)}


def _run_job(run_id: str, cfg: Config, run_dir: str, mode: str) -> dict:
    """Train one run in a worker; never raises for a run that fails (returns its state). After
    an interrupt (Ctrl-C, SIGTERM) the worker starts no further run."""
    global _STOPPED
    if _STOPPED:
        return {"state": RunDir(run_dir).state(), "message": "not started: the sweep was interrupted"}
    _worker_init(_EVENTS)
    from timlab.trainer.run import NonFiniteError, ZeroMismatchViolation, train

    rd = RunDir(run_dir)
    try:
        if mode == "restart":
            with rd:
                rd.clear()  # only what timlab wrote; anything else in the folder stays
        train(cfg, rd.path, resume=mode == "resume", progress=_emit(run_id))
        return {"state": "finished", "message": ""}
    except (NonFiniteError, ZeroMismatchViolation) as e:  # an outcome (collapse / broken exactness)
        return {"state": rd.read_status().get("state", "diverged"), "message": one_line(e, with_type=True)}
    except RunDirBusyError as e:  # another process owns the run: leave its status alone
        return {"state": FAILED, "message": one_line(e, with_type=True)}
    except KeyboardInterrupt as e:  # the trainer recorded where it stopped
        _STOPPED = True
        return {"state": FAILED, "message": f"interrupted ({'SIGTERM' if isinstance(e, Terminated) else 'SIGINT'})"}
    except Exception as e:
        msg = one_line(e, with_type=True)
        status = rd.read_status()
        if status.get("state") != FAILED:  # raised before the trainer could record it
            try:
                with rd:
                    rd.write_status(FAILED, step=status.get("step", 0), total_steps=cfg.run.steps, message=msg)
            except (TimlabError, OSError):
                pass  # the message still reaches the index
        return {"state": FAILED, "message": msg}


class _LocalExecutor:
    """A spawn-context process pool (kept across phases: workers import torch once); ``map``
    yields (key, result or exception) as calls finish, forwarding progress events meanwhile."""

    def __init__(self, workers: int, on_event):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.on_event = on_event
        self.events = ctx.Queue() if on_event is not None else None
        self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init,
                                        initargs=(self.events, os.getpid()))
        self._futures: set = set()

    def _drain(self) -> None:
        while self.events is not None:
            try:
                ev = self.events.get_nowait()
            except Exception:  # queue.Empty
                return
            self.on_event(*ev)

    def map(self, calls: list[tuple[str, Callable, tuple]]) -> Iterator[tuple[str, Any]]:
        futures = {self.pool.submit(fn, *args): key for key, fn, args in calls}
        self._futures = set(futures)
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            self._drain()
            for f in done:
                exc = f.exception()
                yield futures[f], (exc if exc is not None else f.result())
        self._drain()

    def interrupt(self) -> None:
        """Stop promptly: cancel the queued runs and interrupt the running ones (each records its
        status and its worker starts nothing more)."""
        for f in list(self._futures):
            f.cancel()
        for proc in list((getattr(self.pool, "_processes", None) or {}).values()):
            try:
                os.kill(proc.pid, signal.SIGINT)
            except (ProcessLookupError, AttributeError):
                pass

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.events is not None:
            self.events.close()
            self.events.join_thread()


def _require_ray():
    try:
        import ray
    except ImportError:
        raise SweepError("executor 'ray' needs the ray package: pip install 'timlab[ray]'") from None
    return ray


class _RayExecutor:
    """Ray tasks of one CPU each; per-step progress is not forwarded."""

    def __init__(self, workers: int, on_event):
        self.ray = _require_ray()
        if not self.ray.is_initialized():
            self.ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)

    def map(self, calls: list[tuple[str, Callable, tuple]]) -> Iterator[tuple[str, Any]]:
        ray = self.ray
        refs = {ray.remote(num_cpus=1)(fn).remote(*args): key for key, fn, args in calls}
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1)
            key = refs.pop(done[0])
            try:
                yield key, ray.get(done[0])
            except Exception as e:  # a task that died (the run functions themselves never raise)
                yield key, e

    def interrupt(self) -> None:
        pass

    def close(self) -> None:
        pass

"""Per-step metrics that survive a crash: metrics.parquet rewritten atomically every step.

Each step's row is appended in memory and the whole table written to a temporary file that
then replaces ``metrics.parquet`` (``os.replace`` is atomic), so pandas or DuckDB can read the
file at any moment and a killed run loses at most the step in flight. Non-scalar per-step data
(histograms, mismatch by position) go to ``distributions.jsonl``, one JSON object per line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from timlab.errors import UsageError, disk_full, is_disk_full
from timlab.files import atomic_write_text, atomic_write_with, open_append
from timlab.rundir import RunDir

TIMING_KEYS = ("train/step_time_s", "train/tokens_per_s", "time/rollout_s", "time/train_s", "time/eval_s", "time/metrics_s")
"""Wall-clock columns: the only ones that differ between two runs of the same config and seed."""


def is_timing(column: str) -> bool:
    """A wall-clock column: one of TIMING_KEYS or any other ``time/*``."""
    return column in TIMING_KEYS or column.startswith("time/")


def without_timings(df: pd.DataFrame) -> pd.DataFrame:
    """A metrics table without its wall-clock columns: what two runs of the same config and seed
    must log bit for bit."""
    return df.drop(columns=[c for c in df.columns if is_timing(c)])


def first_difference(a: pd.DataFrame, b: pd.DataFrame) -> str | None:
    """None when two metrics tables are bitwise equal (NaN equal to NaN) in the columns both hold,
    wall-clock columns left out (``without_timings``); else where they first differ."""
    import numpy as np

    a, b = without_timings(a), without_timings(b)
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} rows"
    for col in [c for c in a.columns if c in b.columns]:
        x, y = a[col].to_numpy(), b[col].to_numpy()
        if x.dtype != y.dtype:
            return f"{col}: dtype {x.dtype} vs {y.dtype}"
        if x.dtype.kind == "f":
            same = (x.view(f"i{x.itemsize}") == y.view(f"i{y.itemsize}")) | (np.isnan(x) & np.isnan(y))
        else:
            same = x == y
        if not np.all(same):
            i = int(np.argmin(same))
            return f"step {a['step'].iloc[i]} {col}: {x[i]!r} vs {y[i]!r}"
    return None


class MetricsLog:
    """Rows of ``{metric: float}`` keyed by ``step``, persisted to ``metrics.parquet``."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = False):
        self.run_dir = RunDir(run_dir)
        self.path = self.run_dir.metrics_file
        self.dist_path = self.run_dir.distributions_file
        self.samples_path = self.run_dir.samples_file
        self.rows: list[dict] = []
        self.columns: list[str] = []
        """The columns of the file a resume kept: written even where no row holds a value (a column
        that is NaN at every step, such as mismatch/persistence_* at zero mismatch), so a resumed run's
        file has the columns of an uninterrupted one."""
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UsageError("run.tensorboard=true needs tensorboard: pip install timlab[tensorboard]") from None
            self._tb = SummaryWriter(str(self.run_dir.tensorboard))

    def load(self, up_to_step: int) -> None:
        """On resume: keep the rows of steps <= up_to_step (later ones will be recomputed) and cut
        both files back to them (``up_to_step=-1``: a resume from the warm start keeps nothing). The
        file's columns are kept too (``columns``), even one that is NaN in every kept row."""
        df = self.run_dir.read_metrics()
        self.columns = [] if df is None or up_to_step < 0 else list(df.columns)
        self.rows = [] if df is None else [
            {k: v for k, v in r.items() if not (isinstance(v, float) and math.isnan(v))}
            for r in df[df["step"] <= up_to_step].to_dict("records")
        ]
        if self.dist_path.exists():
            kept = self.run_dir.read_distributions(up_to_step)
            atomic_write_text(self.dist_path, "".join(line + "\n" for line in kept))
        if self.samples_path.exists():
            kept = self.run_dir.read_samples(up_to_step)
            atomic_write_text(self.samples_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
        if self.rows:
            self._flush()
        elif self.path.exists():
            self.path.unlink()  # ours: the rows of steps a resume from step 0 recomputes

    def append(self, row: dict) -> None:
        self.rows.append(row)
        self._flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, row["step"])
            self._tb.flush()

    def append_distribution(self, step: int, payload: dict) -> None:
        self._append_lines(self.dist_path, [{"step": step, **payload}])

    def append_samples(self, step: int, samples: list[dict]) -> None:
        """One line per sample (``{"step", **sample}``) in samples.jsonl."""
        self._append_lines(self.samples_path, [{"step": step, **s} for s in samples])

    @staticmethod
    def _append_lines(path: Path, records: list[dict]) -> None:
        try:
            with open_append(path) as f:
                f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        except OSError as e:
            if is_disk_full(e):
                raise disk_full(path) from None
            raise

    def _flush(self) -> None:
        if not self.rows:
            return
        df = pd.DataFrame(self.rows)
        for c in self.columns:
            if c not in df.columns:  # NaN in every kept row (the rows hold no NaN), as the file had it
                df[c] = float("nan")
        cols = ["step"] + sorted(c for c in df.columns if c != "step")
        atomic_write_with(self.path, lambda tmp: df[cols].to_parquet(tmp, index=False))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


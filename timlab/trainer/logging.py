"""Per-step metrics that survive a crash: metrics.parquet rewritten atomically every step.

Each step's row is appended in memory and the whole table written to a temporary file that
then replaces ``metrics.parquet`` (``os.replace`` is atomic), so pandas or DuckDB can read the
file at any moment and a killed run loses at most the step in flight. Non-scalar per-step data
(histograms, mismatch by position) go to ``distributions.jsonl``, one JSON object per line.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pandas as pd

TIMING_KEYS = ("train/step_time_s", "train/tokens_per_s", "time/rollout_s", "time/train_s", "time/eval_s", "time/metrics_s")
"""Wall-clock columns: the only ones that differ between two runs of the same config and seed."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


class MetricsLog:
    """Rows of ``{metric: float}`` keyed by ``step``, persisted to ``metrics.parquet``."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = False):
        self.path = Path(run_dir) / "metrics.parquet"
        self.dist_path = Path(run_dir) / "distributions.jsonl"
        self.rows: list[dict] = []
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError("run.tensorboard=true needs tensorboard: pip install timlab[tensorboard]") from None
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def load(self, up_to_step: int) -> None:
        """On resume: keep the rows of steps <= up_to_step (later ones will be recomputed)."""
        if self.path.exists():
            df = pd.read_parquet(self.path)
            self.rows = [
                {k: v for k, v in r.items() if not (isinstance(v, float) and math.isnan(v))}
                for r in df[df["step"] <= up_to_step].to_dict("records")
            ]
        if self.dist_path.exists():
            kept = [
                line for line in self.dist_path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= up_to_step
            ]
            atomic_write_text(self.dist_path, "".join(line + "\n" for line in kept))
        self._flush()

    def append(self, row: dict) -> None:
        self.rows.append(row)
        self._flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, row["step"])
            self._tb.flush()

    def append_distribution(self, step: int, payload: dict) -> None:
        with open(self.dist_path, "a") as f:
            f.write(json.dumps({"step": step, **payload}) + "\n")

    def _flush(self) -> None:
        if not self.rows:
            return
        df = pd.DataFrame(self.rows)
        cols = ["step"] + sorted(c for c in df.columns if c != "step")
        tmp = self.path.with_name(self.path.name + ".tmp")
        df[cols].to_parquet(tmp, index=False)
        os.replace(tmp, self.path)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | Path) -> pd.DataFrame:
    """The metrics table of a run (empty DataFrame if none yet)."""
    p = Path(run_dir) / "metrics.parquet"
    return pd.read_parquet(p) if p.exists() else pd.DataFrame()

"""The predicted accuracy cost of a mismatch, from Study H's calibration record, for ``timlab check``
and ``timlab analyze``.

Used by ``timlab.experiments.analyze.format_analysis`` and ``timlab.experiments.check.format_check``.
The record (``CALIBRATION``, written by ``timlab study analyze docs/examples/studies/harm.yaml
--write``; ``timlab.experiments.study.predictor.calibration_record``) holds each candidate's
through-origin slope b, its variance, its leave-one-kind-out error, the range of its values over
the fitted cells, the range of their answer lengths and of their policies' parameter counts, the
regime, and, once the out-of-sample test has decided it, the winner. The prediction is b S with the
interval of ``predictor.prediction``; a statistic, or an answer length, outside the fitted range
gives "outside the calibrated range", never an extrapolation. The model's size, where the caller
knows it, is printed beside the calibrated sizes (not a gate: the regime says what was calibrated).
Until a winner exists, one line says why there is no prediction.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

CALIBRATION = Path(__file__).resolve().parents[1] / "data" / "harm_calibration.json"
"""The committed calibration record."""

NO_RECORD = ("predicted accuracy cost: none (no calibration yet: Study H, docs/FINDINGS.md, has not finished its "
             "in-sample fit, so no statistic is calibrated, and k3 alone does not give the cost)")
NO_WINNER = ("predicted accuracy cost: none (Study H's out-of-sample test has not yet named the statistic that "
             "predicts the cost; docs/FINDINGS.md)")


def load_calibration(path: str | Path = CALIBRATION) -> dict | None:
    p = Path(path)
    return json.loads(p.read_text(encoding="utf-8")) if p.exists() else None


def predicted_cost_line(metrics: dict, *, calibration: dict | None = None, path: str | Path | None = None,
                        lacks: str = "", length: float | None = None, params: int | None = None) -> str:
    """One line: the predicted accuracy cost of a mismatch whose statistics are ``metrics`` (metric name
    -> value), with its 95% interval and the calibrated regime; or why there is none. ``lacks`` says
    why a missing statistic is missing (e.g. "this file has no advantage column"); ``length`` is the
    mean answer length in tokens and ``params`` the model's parameter count, where known."""
    from timlab.experiments.study.predictor import prediction

    rec = load_calibration(CALIBRATION if path is None else path) if calibration is None else calibration
    if rec is None:
        return NO_RECORD
    name = rec.get("winner")
    if not name:
        return NO_WINNER
    c = rec["candidates"][name]
    v = metrics.get(c["metric"])
    if v is None or not math.isfinite(v):
        return f"predicted accuracy cost: none ({name} = {c['metric']} is not measured here" + (f": {lacks})" if lacks else ")")
    S = abs(v) if c["absolute"] else v
    where = f"calibrated on {rec['regime']}{size_text(params, rec.get('params'))}"
    lo, hi = c["range"]
    if not lo <= S <= hi:
        return f"predicted accuracy cost: outside the calibrated range ({name} {S:.3g} is not in [{lo:.3g}, {hi:.3g}], {where})"
    lengths = rec.get("lengths")
    if length is not None and lengths and not lengths[0] <= length <= lengths[1]:
        return (f"predicted accuracy cost: outside the calibrated range (answers of {length:.0f} tokens, calibrated "
                f"lengths {lengths[0]:.0f}-{lengths[1]:.0f}; {where})")
    pred, a, b = prediction(c["b"], c["b_var"], c["loko"], S)
    caveat = "; miscalibrated out of sample" if (rec.get("oos") or {}).get("miscalibrated") else ""
    return f"predicted accuracy cost: {pred:.3f} [95% {a:.3f}, {b:.3f}] from {name} {S:.3g} ({where}{caveat})"


def size_text(params: int | None, calibrated: list | None) -> str:
    """"; this model 7.2M parameters (calibrated 0.15M-0.48M)", or "" when the size is not known."""
    if not params:
        return ""
    return f"; this model {params / 1e6:.3g}M parameters" + (
        f" (calibrated {calibrated[0] / 1e6:.2g}M-{calibrated[1] / 1e6:.2g}M)" if calibrated else "")

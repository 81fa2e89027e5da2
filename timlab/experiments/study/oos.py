"""The out-of-sample part of a predictor study: the probe's dose rule, the predictions written before
any out-of-sample run, and the decision rule applied once after them.

Used by ``timlab.experiments.study.predictor`` (the ``oos`` block of ``timlab study analyze FILE
--write``) and ``timlab study run|check`` of the out-of-sample study file that a predictor study
names in ``oos`` (docs/studies.md, "Predictor studies"; Study H's part (b) in docs/FINDINGS.md).
"""

from __future__ import annotations

import math


def round_sig(x: float, digits: int = 2) -> float:
    """``x`` rounded to ``digits`` significant digits (0.03147 -> 0.031)."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def dose_for(magnitudes, k3s, target: float, *, digits: int = 2) -> float:
    """The magnitude that realizes k3 ``target``: log magnitude interpolated linearly against log k3
    between the two probed magnitudes whose realized k3 bracket the target (in magnitude order);
    where no pair brackets it, the line through the two probed points nearest the target in log k3,
    extrapolated. Rounded to ``digits`` significant digits. Every k3 must be > 0."""
    pts = sorted((float(m), float(k)) for m, k in zip(magnitudes, k3s))
    if len(pts) < 2 or any(m <= 0 or k <= 0 or not math.isfinite(k) for m, k in pts):
        raise ValueError(f"dose_for: needs >= 2 probed magnitudes with realized k3 > 0, got {pts}")
    lt = math.log(target)
    pair = next(((a, b) for a, b in zip(pts, pts[1:])
                 if min(a[1], b[1]) <= target <= max(a[1], b[1]) and a[1] != b[1]), None)
    if pair is None:
        near = sorted(pts, key=lambda p: abs(math.log(p[1]) - lt))
        pair = next(((near[0], q) for q in near[1:] if q[1] != near[0][1]), None)
        if pair is None:
            raise ValueError(f"dose_for: every probed magnitude realized the same k3 {pts[0][1]}; no slope")
    (m0, k0), (m1, k1) = pair
    t = (lt - math.log(k0)) / (math.log(k1) - math.log(k0))
    return round_sig(math.exp(math.log(m0) + t * (math.log(m1) - math.log(m0))), digits)

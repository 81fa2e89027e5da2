"""The progress callback that long library calls take (training, sweeps, gradcheck).

``progress(phase, i, n, info)``: ``phase`` names the work (``"train"``, ``"sweep"``,
``"train:<run_id>"``, ``"pretrain:<name>"``, ...), ``i`` of ``n`` units are done, and ``info`` holds
the latest values (a step's metrics, a finished run's state). Library callers pass any such
function; the CLI passes tqdm bars (``cli.PhaseBars``).
"""

from __future__ import annotations

from typing import Callable

Progress = Callable[[str, int, int, dict], None]

__all__ = ["Progress"]

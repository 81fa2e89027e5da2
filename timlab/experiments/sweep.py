"""Deprecated alias (for one release): ``read_index`` moved to ``timlab.experiments.sweeps.index``
(sweeps run from ``timlab.experiments.sweeps.runner``); import it from there."""

import warnings

from timlab.experiments.sweeps.index import read_index

__all__ = ["read_index"]

warnings.warn("timlab.experiments.sweep is deprecated: import read_index from timlab.experiments.sweeps.index",
              DeprecationWarning, stacklevel=2)

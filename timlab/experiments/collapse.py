"""Deprecated alias (for one release): the collapse rule and its tables moved to
``timlab.experiments.studies.collapse``; import them from there."""

import warnings

from timlab.experiments.studies.collapse import condition_table

__all__ = ["condition_table"]

warnings.warn("timlab.experiments.collapse is deprecated: import from timlab.experiments.studies.collapse",
              DeprecationWarning, stacklevel=2)

"""Deprecated alias (for one release): the offline analysis moved to
``timlab.experiments.diagnostics.analyze``; import it from there."""

import warnings

from timlab.experiments.diagnostics.analyze import (analyze_file, analyze_records, format_analysis, from_trl_inputs,
                                                    from_verl_batch, write_rows)

__all__ = ["analyze_file", "analyze_records", "format_analysis", "from_trl_inputs", "from_verl_batch", "write_rows"]

warnings.warn("timlab.experiments.analyze is deprecated: import from timlab.experiments.diagnostics.analyze",
              DeprecationWarning, stacklevel=2)

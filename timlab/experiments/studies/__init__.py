"""Studies as data: a registration (a YAML study file) and the one engine that analyses it, with
the statistics pre-registered analyses use.

Used by ``timlab study check|run|analyze|figure`` (``timlab.cli``) and by
scripts/findings_tables.py for the FINDINGS blocks of the studies written as study files
(docs/examples/studies/). docs/studies.md describes the file format.

- ``registration``: the study file as frozen dataclasses, one-line ``StudyError`` for bad input,
  the registration hash, the freeze at the first run and its amendments; the file's format in
  ``schema`` (its choices and dataclasses), ``sections`` (one parser per top-level section) and
  ``entries`` (the parsers of one entry of a section);
- ``engine``: the analysis (refusal of an incomplete sweep, validity, endpoints, comparison
  families, verdicts, tables, fits) rendered as a FINDINGS block; a figure (``figures``: a
  grouped study's cost against the answer length, where it has a ``length_exponent`` fit);
- ``endpoints``: per-run statistics over step windows; ``fits``: the dose law, the length fit
  and the threshold test;
- ``sweep_runs``: reading a study's runs from a sweep directory; ``blocks``: where a study's runs
  live (its directory, or one per machine block) and which of them this machine may make;
  ``text``: the cell formats;
- ``predictor``, ``recompute`` and ``oos``: predictor studies (which statistic predicts a mismatch's
  cost), the bit-for-bit re-runs behind their candidate values, and their out-of-sample part;
  ``heldout`` and ``evidence``: held-out predictor tests and the lab's measured cells;
- the statistics: ``stats`` (permutation tests, intervals, Holm), ``effects`` (effects between
  conditions), ``collapse`` (the collapse rule and per-run / per-condition summaries),
  ``threshold`` (the collapse threshold against response length) and ``early_warning`` (the
  alarm rules' lead time and false alarms).

The package imports nothing on import: take names from their modules (``studies.engine``,
``studies.registration``, ...).
"""

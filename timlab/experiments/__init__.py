"""Experiments built on the engines, the trainer and the metrics, in four subpackages by role.
Each is a library function that takes keyword arguments and returns a JSON-ready result (the CLI
prints it; nothing here prints).

- ``diagnostics``: what a user runs on their own stack: ``check`` (the onboarding matrix and CI
  gate), ``analyze`` (offline metrics from logged per-token log-probs), ``probe`` (roll out with
  one engine, score with another, find the first op where they diverge), ``exactness`` (the
  randomized search for exact-engine failures), ``harm_prediction`` ("is my mismatch a problem?");
- ``reports``: HTML pages and figures: ``report`` (one self-contained page of runs or a sweep),
  ``page`` (the pieces every page is built from), ``demo`` (pretrain + the VeXact sweep + report);
- ``studies``: pre-registered analysis: study files and their engine (``registration``,
  ``engine``, ...; see its docstring) and the statistics they use: ``stats``, ``effects``,
  ``collapse`` (the collapse rule), ``threshold``, ``early_warning``;
- ``sweeps``: running many runs and indexing them: ``runner`` (``run_sweep``), ``spec``,
  ``workers``, ``index`` (index.parquet, ``read_index``), ``tables``.

Imports run one way: diagnostics -> reports -> studies -> sweeps (diagnostics draw with
``reports.page`` and answer with ``studies.predictor``; nothing imports a role above it). The one
exception is two leaves of ``studies``, ``stats`` and ``collapse``, which import nothing else of
``timlab.experiments``: sweeps use them too (the index summarises each run by the collapse rule;
the tables fit lines). tests/test_layout.py checks this order, and that no package folder has an
import cycle.

``timlab export`` (a run's checkpoint as a model folder to start new runs from) is not an
experiment: it lives beside the trainer that writes the checkpoints, ``timlab.trainer.export``.
"""

"""Sweeps: a YAML spec expanded into runs (``spec``), run in worker processes (``workers``,
driven by ``runner.run_sweep``), resumable, each run's config and summary in ``DIR/index.parquet``
(``index``), and per-condition markdown tables of sweep directories (``tables``). Below the
studies and the reports: nothing here imports them, except the statistics leaves
``studies.collapse`` (each index row's summary) and ``studies.stats``."""

"""Experiments built on the engines, the trainer and the metrics. Each is a library function
that takes keyword arguments and returns a JSON-ready result (the CLI prints it; nothing here
prints).

- ``probe``: roll out with one engine, score the same tokens with another numeric path, report
  the mismatch and, with ``attribute=True``, the first op where the two paths diverge;
- ``sweep``: a grid of runs in parallel worker processes, resumable, indexed in index.parquet;
- ``collapse``: the collapse rule and per-run / per-condition statistics;
- ``report``: one self-contained HTML report of runs or a sweep;
- ``demo``: pretrain + the VeXact sweep + report, the main job;
- ``analyze``: offline metrics and a report from logged per-token log-probs.
"""

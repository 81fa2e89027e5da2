"""Experiments built on the engines, the trainer and the metrics. Each is a library function
that takes keyword arguments and returns a JSON-ready result (the CLI prints it; nothing here
prints). One module per experiment, e.g. ``probe``: roll out with one engine, score the same
tokens with another numeric path, report the mismatch and, with ``attribute=True``, the first
op where the two paths diverge.
"""

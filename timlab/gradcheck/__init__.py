"""gradcheck: the policy gradient estimated from exact and from mismatched rollouts, in one home.

- ``timlab.gradcheck.estimator``: ``gradcheck()`` itself (draw paired rollouts, accumulate
  micro-batch gradients, summarize into cosine / bias / SNR per length bucket and the T^2 bound),
  ``GradcheckResult``, ``GradcheckError``, ``ESTIMATORS``;
- ``timlab.gradcheck.command``: ``timlab gradcheck`` (``run_gradcheck`` from a config, a run's
  checkpoint or a model folder; ``format_gradcheck``, ``plot_gradcheck``);
- ``timlab.gradcheck.in_run``: the trainer's periodic check (``run.gradcheck_every``): its
  micro-batch size and the ``gradcheck/*`` metric keys (``GRADCHECK_KEYS``); its config checks are
  ``timlab.config.check_gradcheck``;
- ``timlab.gradcheck.tables``: FINDINGS' markdown tables from ``timlab gradcheck --json`` files and
  a gradcheck sweep (``python scripts/gradcheck_tables.py``).

The statistics (Gram matrices, bootstrap intervals, the power-law fit) are pure tensor functions in
``timlab.metrics.gradients``, the pure layer a TRL or verl user can take alone. See docs/gradcheck.md.
"""

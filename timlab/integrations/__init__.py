"""Plug-ins that bring timlab's pure layer into other RL stacks.

- ``timlab.integrations.trl``: for TRL's ``GRPOTrainer``: ``TimlabCallback`` drives the
  length-decay LR (Beyond-Precision Algorithm 1, automatic surge mode included) from TRL's logged
  mean completion length; ``TimlabMetricsMixin`` / ``TimlabGRPOTrainer`` log timlab's mismatch
  metrics whenever TRL holds the sampler's per-token log-probs (vLLM with importance-sampling
  correction, or a ``rollout_func`` that returns ``logprobs``), the persistence of its bias
  across generation batches included.
- ``timlab.integrations.verl``: for verl: ``compute_metrics(batch)`` (verl's ``rollout_corr/*``
  names plus timlab's ``mismatch/*``), ``MismatchPersistence`` (the persistence of the bias
  across steps, ``mismatch/persistence_*``) and ``LengthDecayHook``, the length-decay LR for verl's
  driver loop, with the few lines of patch that carry its factor to the actor workers.

Each module imports only timlab's pure layer (``timlab.metrics``, ``timlab.remedies``,
``timlab.schedulers``) and its host library, never timlab's trainer or engines. Nothing is
imported here, so ``import timlab.integrations`` needs neither TRL nor verl. Worked examples,
patches and what was tested: ``docs/integrations.md``.
"""

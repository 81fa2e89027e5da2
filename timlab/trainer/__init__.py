"""The RL trainer: the step (rollout -> score -> metrics -> correction -> loss -> update) in
``run``, the SFT warm start in ``pretrain``, advantage estimators, the PPO loss, trainer
precision, atomic checkpoints and metrics, and data parallelism."""

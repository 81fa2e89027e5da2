"""The RL trainer: the step (rollout -> score -> metrics -> correction -> loss -> update) in
``run``, the SFT warm start in ``pretrain``, advantage estimators, the PPO loss, trainer
precision (and loading the policy into it), scoring (the task, rewards, validation accuracy),
and data parallelism. Checkpoints and the metrics log live in ``timlab.rundir``."""

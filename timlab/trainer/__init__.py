"""The RL trainer: the step (rollout -> score -> metrics -> correction -> loss -> update) in
``run``, the SFT warm start in ``pretrain``, advantage estimators, the PPO loss, trainer
precision (and loading the policy into it), scoring (the task, rewards, validation accuracy),
and data parallelism; ``export`` (``timlab export``) writes a checkpoint as a plain model folder to start
new runs from (it reads ``timlab.rundir``'s checkpoints and ``pretrain``'s warm start, so it sits here,
not with the experiments). Checkpoints and the metrics log live in ``timlab.rundir``."""

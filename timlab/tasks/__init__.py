"""Tasks with verifiable rewards and variable-length answers.

``get_task("reverse", max_len=30)`` builds a registered task (``build_task(cfg)`` the configured one); ``make_splits`` draws seeded,
prompt-disjoint train/val lists. Registered: the synthetic addition, copy, countdown, reverse,
scratch_add and sort, and ``dataset`` (rows of a local file, scored by a verifier from
``timlab.tasks.verifiers.VERIFIERS``).
"""

from timlab.tasks import arithmetic, countdown, dataset, scratchpad, strings  # noqa: F401  (registers the tasks)
from timlab.tasks.arithmetic import AdditionTask
from timlab.tasks.base import TASKS, Example, Task, build_task, get_task, make_splits, positional_match
from timlab.tasks.countdown import CountdownTask, evaluate_expression, parse_prompt
from timlab.tasks.dataset import DatasetTask
from timlab.tasks.scratchpad import ScratchAddTask
from timlab.tasks.strings import CopyTask, ReverseTask, SortTask
from timlab.tasks.verifiers import VERIFIERS, build_verifier

__all__ = [
    "TASKS", "Example", "Task", "build_task", "get_task", "make_splits", "positional_match",
    "AdditionTask", "CopyTask", "DatasetTask", "ScratchAddTask", "CountdownTask", "ReverseTask", "SortTask",
    "evaluate_expression", "parse_prompt", "VERIFIERS", "build_verifier",
]

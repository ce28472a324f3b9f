"""Studies built on the library (not part of it): the demo on the embedded model, the quality studies.

finetune.py    `DemoSettings` and `finetune_embedded`, the fine-tuning run the others share
demo.py        `run_demo` (`occult-ft demo`) and `run_quality_study` (`occult-ft study`)
task_study.py  the multi-seed task study (`occult-ft study --task months`)
tasks.py       synthetic tasks with checkable answers (`months`, `dates`) and exact match
"""

from .demo import format_rows, run_demo, run_quality_study
from .finetune import DemoSettings, finetune_embedded
from .task_study import run_task_study
from .tasks import TASKS, exact_match, task_split

__all__ = [
    "DemoSettings",
    "TASKS",
    "exact_match",
    "finetune_embedded",
    "format_rows",
    "run_demo",
    "run_quality_study",
    "run_task_study",
    "task_split",
]

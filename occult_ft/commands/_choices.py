"""The names the command-line parsers offer as choices and defaults, without importing the library.

Building a parser must not import torch (`occult-ft --help` and argument errors answer at once), and
the library modules that own these names import it. The values here are copies; `tests/test_cli.py`
checks each against its owner, so a name added there fails the test until it is added here.

    owner                                  names
    occult_ft.routing                      CRITERIA, GATE_WEIGHT_POLICIES
    occult_ft.placement                    PLACEMENT_ALGORITHMS, DEFAULT_ALGORITHM
    occult_ft.bench / bench.costmodel      BENCH_BACKENDS, BENCH_DTYPES, CLUSTER_PRESETS
    occult_ft.studies.tasks                TASK_INFO
    occult_ft.embedded                     EMBEDDED_SPLITS
    occult_ft.trainer.OccultConfig         DEFAULT_CRITERION (its `criterion` default)
"""

from __future__ import annotations

__all__ = [
    "CRITERIA",
    "DEFAULT_CRITERION",
    "GATE_WEIGHT_POLICIES",
    "PLACEMENT_ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "BENCH_BACKENDS",
    "BENCH_DTYPES",
    "CLUSTER_PRESETS",
    "TASK_INFO",
    "EMBEDDED_SPLITS",
]

CRITERIA = ("score", "similarity", "device_max", "device_topk_sum")
# one default everywhere (train, recipes, demo, prune, analyze): the criterion the paper reports better
DEFAULT_CRITERION = "similarity"
GATE_WEIGHT_POLICIES = ("model", "preserve_mass")
PLACEMENT_ALGORITHMS = ("sequential", "occult", "greedy_pairs", "search", "solver")
DEFAULT_ALGORITHM = "solver"
BENCH_BACKENDS = (
    "deepspeed_classic",
    "deepspeed_classic_nodrop",
    "per_expert",
    "hf_native_ep",
    "occult_dedup",
    "occult_dedup_capacity",
)
BENCH_DTYPES = ("bfloat16", "float16", "float32")
CLUSTER_PRESETS = ("8xH100-nvlink", "4xA6000-pcie", "2x8-ib", "4x8-ib")
TASK_INFO = {
    "months": "ISO date -> its month's name (a 12-way lookup), exact match of the answer",
    "dates": "ISO date -> 'Month day, year' (month lookup + copying), exact match of the answer",
}
EMBEDDED_SPLITS = ("train", "eval", "instructions")

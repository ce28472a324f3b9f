"""Fine-tuning throughput (tokens/s) of the embedded model with and without pruning, side by side.

    python benchmarks/train_throughput.py [--steps 60] [--rounds 2]

Each round fine-tunes the embedded OLMoE (MoE blocks, 4 devices, search placement) once per budget
(none, 2, 1) with `OccultTrainer`, in alternating order, and the median tokens/s per budget is
reported. On one process pruning saves no compute (every token still runs k experts); its saving is
in the all-to-all of expert parallelism, which `occult-ft bench` measures. This shows what the pruned
router costs on top of the plain one.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from occult_ft.studies.demo import _finetune, _prepare
from occult_ft.studies.finetune import DemoSettings


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    out = tempfile.mkdtemp(prefix="occult-throughput-")
    s = DemoSettings(
        output_dir=out, steps=args.steps, profile_tokens=8192, eval_tokens=1024, criterion="score"
    )
    _prepare(s)  # profile + placements saved under out/
    speeds: dict[str, list[float]] = {"no pruning": [], "budget 2": [], "budget 1": []}
    budgets = {"no pruning": None, "budget 2": 2, "budget 1": 1}
    for r in range(args.rounds):
        order = list(budgets) if r % 2 == 0 else list(reversed(budgets))
        for name in order:
            _, run = _finetune(s, f"{out}/placement-search.json", f"{out}/ft-{r}", budgets[name], "score")
            speeds[name].append(run["train_tokens_per_second"])
    base = statistics.median(speeds["no pruning"])
    for name, values in speeds.items():
        med = statistics.median(values)
        print(f"{name:>11}: {med:8.0f} tokens/s (median of {len(values)}; {med / base:.3f}x of no pruning)")


if __name__ == "__main__":
    main()

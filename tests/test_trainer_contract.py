"""The private `transformers.Trainer` methods `OccultTrainerMixin` (the Occult behaviour of `OccultTrainer`
and `occult_ft.trl.OccultSFTTrainer`) overrides still exist, take the arguments
ours take, and are still called by Trainer itself: a transformers release that renames one would
otherwise silently switch off what the override does (e.g. global expert-parallel gradient clipping,
expert shards in checkpoints)."""

from __future__ import annotations

import inspect
import re

import pytest
import transformers
from packaging.version import Version
from transformers import Trainer

from occult_ft.trainer import OccultTrainerMixin

#: private Trainer hook -> what occult_ft's override does
PRIVATE_HOOKS = {
    "_save": "writes the pruned checkpoint (block, similarity tables, gathered expert shards)",
    "_load_from_checkpoint": "loads per-expert Hub weights into fused experts, sharded adapters",
    "_save_optimizer_and_scheduler": "writes every expert-parallel position's optimizer state",
    "_load_optimizer_and_scheduler": "reads this rank's expert optimizer state",
    "_load_best_model": "loads the best checkpoint like a resumed one",
    "_clip_grad_norm": "clips by the norm of the whole expert-parallel model",
    "_get_grad_norm": "reports that norm, and stops the run at a non-finite loss or norm",
    "_load_rng_state": "names the file when a checkpoint's RNG state cannot be read",
    "_run_epoch": "takes no step when resumed from a checkpoint already at max_steps",
}


def _trainer_source() -> str:
    return inspect.getsource(inspect.getmodule(Trainer))


def test_occult_trainer_mixin_overrides_exactly_the_listed_private_hooks():
    overridden = {
        name
        for name, value in vars(OccultTrainerMixin).items()
        if name.startswith("_") and not name.startswith("__") and callable(value) and hasattr(Trainer, name)
    }
    assert overridden == set(PRIVATE_HOOKS), "update PRIVATE_HOOKS when an override is added or removed"


@pytest.mark.parametrize("name", sorted(PRIVATE_HOOKS))
def test_the_hook_exists_and_takes_our_arguments(name):
    theirs = getattr(Trainer, name, None)
    assert theirs is not None, (
        f"transformers {transformers.__version__} has no Trainer.{name}: {PRIVATE_HOOKS[name]}"
    )
    ours = inspect.signature(getattr(OccultTrainerMixin, name)).parameters
    params = inspect.signature(theirs).parameters
    assert list(params) == list(ours), f"Trainer.{name}{inspect.signature(theirs)} changed its arguments"


@pytest.mark.parametrize("name", sorted(PRIVATE_HOOKS))
def test_trainer_still_calls_the_hook(name):
    calls = re.findall(rf"self\.{re.escape(name)}\(", _trainer_source())
    assert calls, f"transformers {transformers.__version__}'s Trainer no longer calls self.{name}(...)"


def test_the_installed_transformers_is_inside_the_tested_range():
    import pathlib

    try:
        import tomllib
    except ImportError:  # Python 3.10: the same parser, as the `tomli` package (a dev dependency there)
        import tomli as tomllib

    pyproject = tomllib.loads((pathlib.Path(__file__).parent.parent / "pyproject.toml").read_text())
    spec = next(d for d in pyproject["project"]["dependencies"] if d.startswith("transformers"))
    lower, upper = re.findall(r">=([\d.]+)", spec)[0], re.findall(r"<([\d.]+)", spec)
    assert upper, f"{spec!r}: transformers needs an upper bound (its private Trainer hooks are used)"
    assert Version(lower) <= Version(transformers.__version__) < Version(upper[0])

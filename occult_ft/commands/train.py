"""`occult-ft train [RECIPE] [--field value ...]`: Occult fine-tuning from a recipe and/or flags.

Every `OccultConfig` field (the Occult fields and all of `transformers.TrainingArguments`) can be set in
the YAML recipe and on the command line; command-line values win. `occult-ft train --help` lists them.
RECIPE is a YAML file or the name of a shipped recipe (`tiny`, `olmoe-1b-7b`, ...: the files of the
repository's `recipes/`, installed with the package as `occult_ft/recipes/`).

    occult-ft train tiny
    occult-ft train recipes/olmoe-1b-7b.yaml --learning_rate 1e-5 --max_steps 200
    occult-ft train --model_name_or_path embedded --dataset embedded --max_devices_per_token 2

Launchers work as with any Trainer script (they set the environment Trainer reads); the module
`occult_ft.cli` and this one (`occult_ft.commands.train`) both accept the `--local_rank=N` that the
`deepspeed` launcher inserts:

    torchrun --nproc_per_node 4 -m occult_ft.cli train recipe.yaml
    accelerate launch --num_processes 4 -m occult_ft.commands.train recipe.yaml
    deepspeed --num_gpus 4 --module occult_ft.commands.train recipe.yaml --deepspeed ds.json
"""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path

from ._common import standalone

__all__ = [
    "add_parser",
    "run",
    "parse_config",
    "config_parser",
    "split_recipe",
    "load_recipe",
    "main",
    "shipped_recipes",
    "find_recipe",
    "missing_extras",
]

_RECIPE_SUFFIXES = (".yaml", ".yml", ".json")


def add_parser(sub):
    # '+' as the option prefix lets every --field reach HfArgumentParser untouched
    p = sub.add_parser(
        "train",
        help="fine-tune an MoE under a device budget per token (Occult)",
        description=__doc__,
        prefix_chars="+",
        add_help=False,
    )
    p.add_argument(
        "argv", nargs="*", help="RECIPE.yaml and/or --field value overrides (any OccultConfig field)"
    )
    p.set_defaults(func=run)
    return p


def config_parser():
    """The `HfArgumentParser` of `OccultConfig` behind `occult-ft train` (errors raise ValueError)."""
    from transformers import HfArgumentParser

    from ..trainer import OccultConfig

    class _Parser(HfArgumentParser):
        def error(self, message):  # one line through the CLI's error handling, not a usage dump
            raise ValueError(message)

    return _Parser(
        OccultConfig,
        prog="occult-ft train",
        allow_abbrev=False,
        description="Fine-tune an MoE with Occult placement and collaboration pruning.",
    )


def _field_names(parser) -> list[str]:
    return sorted({a.dest for a in parser._actions if a.dest not in ("help",)})


def _unknown(name: str, names: list[str], where: str) -> ValueError:
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else "; `occult-ft train --help` lists the fields"
    return ValueError(f"unknown field {name!r} {where}{hint}")


def shipped_recipes() -> dict[str, Path]:
    """Recipe name -> file of the shipped recipes: `occult_ft/recipes/` in an installed package, the
    repository's `recipes/` in a checkout (`models.yaml` is the model-facts table, not a recipe)."""
    package = Path(__file__).resolve().parents[1]
    for folder in (package / "recipes", package.parent / "recipes"):
        found = {p.stem: p for p in sorted(folder.glob("*.yaml")) if p.stem != "models"}
        if found:
            return found
    return {}


def find_recipe(token: str) -> str | None:
    """The recipe file `token` names: an existing file, a shipped recipe's name (`tiny`), or a missing
    `recipes/NAME.yaml` path (run outside the repository) that a shipped recipe answers; else None."""
    if os.path.isfile(token):
        return token
    shipped = shipped_recipes()
    if token in shipped:
        return str(shipped[token])
    path = Path(token)
    if path.suffix.lower() in (".yaml", ".yml") and path.parent.name == "recipes" and path.stem in shipped:
        return str(shipped[path.stem])
    return None


def split_recipe(argv: list[str]) -> tuple[str | None, list[str]]:
    """The recipe (first positional, after any launcher-inserted --local_rank) and the rest."""
    rest = list(argv)
    for i, token in enumerate(rest):
        if token.startswith(("--local_rank", "--local-rank")):
            continue
        if not token.startswith("-"):
            found = find_recipe(token)
            if found is not None:
                return found, rest[:i] + rest[i + 1 :]
            if token.lower().endswith(_RECIPE_SUFFIXES):
                return token, rest[:i] + rest[i + 1 :]  # load_recipe names the missing file
            names = sorted(shipped_recipes())
            close = difflib.get_close_matches(token, names, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(
                f"{token!r} is neither a recipe file (.yaml/.yml/.json) nor a shipped recipe; {hint}shipped: "
                f"{', '.join(names) or 'none'}; fields are given as --field value"
            )
        break
    return None, rest


def load_recipe(path: str, parser) -> dict:
    import yaml

    if not os.path.isfile(path):
        raise ValueError(
            f"recipe {path!r} does not exist; pass a YAML file of OccultConfig fields or a shipped recipe "
            f"name ({', '.join(sorted(shipped_recipes()))})"
        )
    from ..fileio import read_text

    text = read_text(path)  # one line naming the recipe when it is not UTF-8 text
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"recipe {path!r} is not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise ValueError(f"recipe {path!r} holds a {type(data).__name__}; expected a mapping of field: value")
    actions = {a.dest: a for a in parser._actions}
    names = _field_names(parser)
    values = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in actions or name == "help":
            raise _unknown(name, names, f"in recipe {path!r}")
        convert = actions[name].type
        if isinstance(value, str) and convert in (int, float):
            try:
                value = convert(value)  # YAML reads 1e-4 (no dot) as a string
            except ValueError:
                raise ValueError(
                    f"recipe {path!r}: {name}={value!r} is not a valid {convert.__name__}"
                ) from None
        if convert in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            if value is not None or actions[name].default is not None:
                raise ValueError(
                    f"recipe {path!r}: {name}={value!r} is not a {'number' if convert is float else 'whole number'}; "
                    f"write one value, e.g. {name}: {actions[name].default!r}"
                )
        values[name] = value
    return values


def parse_config(argv: list[str]):
    """An `OccultConfig` from `[RECIPE] [--field value ...]`, or None after printing --help.

    Raises:
        ValueError: one line naming an unknown field (with the closest valid one) or a bad value.
    """
    parser = config_parser()
    if any(token in ("-h", "--help") for token in argv):
        parser.print_help()
        return None
    parser.set_defaults(disable_tqdm=False)  # progress bars by default (the CLI quiets library logging)
    recipe, rest = split_recipe(argv)
    if recipe is not None:
        parser.set_defaults(**load_recipe(recipe, parser))
    try:
        config, remaining = parser.parse_args_into_dataclasses(args=rest, return_remaining_strings=True)
    except ImportError as err:  # TrainingArguments imports deepspeed itself when --deepspeed is set
        import importlib.util

        if "deepspeed" in str(err).lower() and importlib.util.find_spec("deepspeed") is None:
            raise ImportError(
                "--deepspeed needs deepspeed, which is not installed: pip install 'occult-ft[deepspeed]'"
            ) from None
        raise
    if remaining:
        flag = next((t for t in remaining if t.startswith("-")), remaining[0])
        name = flag.lstrip("-").split("=", 1)[0].replace("-", "_")
        raise _unknown(name, _field_names(parser), "on the command line")
    return config


def missing_extras(config) -> list[str]:
    """One line per optional dependency `config` needs but this install lacks (checked before any model loads)."""
    import importlib.util

    needs = []
    if config.train_mode == "lora":
        needs.append(("peft", "peft", "train_mode=lora"))
    if config.deepspeed:
        needs.append(("deepspeed", "deepspeed", "--deepspeed"))
    return [
        f"{why} needs {module}, which is not installed: pip install 'occult-ft[{extra}]'"
        for module, extra, why in needs
        if importlib.util.find_spec(module) is None
    ]


def run(args) -> int:
    from ..trainer import train

    config = parse_config(list(args.argv))
    if config is None:
        return 0
    missing = missing_extras(config)
    if missing:
        raise ImportError("; ".join(missing))
    finished = False
    try:
        trainer, metrics = train(config)
        if trainer.is_world_process_zero():
            print(f"saved the pruned model to {config.output_dir}")
            for key in sorted(metrics):
                value = metrics[key]
                print(f"  {key}: {value:.4f}" if isinstance(value, float) else f"  {key}: {value}")
        finished = True
    finally:
        _close_process_group(wait_for_others=finished)
    return 0


def _close_process_group(wait_for_others: bool) -> None:
    """Leave torch.distributed cleanly: without it a rank can abort at exit under torchrun
    ('terminate called without an active exception') and the launch fails after a finished run.
    After a failure there is no barrier (the other ranks may be inside another collective)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if wait_for_others:
            dist.barrier()
        dist.destroy_process_group()


def main(argv=None) -> int:
    """`python -m occult_ft.commands.train` (what launchers run)."""
    return standalone("train", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())

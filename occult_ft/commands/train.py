"""`occult-ft train [RECIPE] [--field value ...]`: Occult fine-tuning from a recipe and/or flags.

Every `OccultConfig` field (the Occult fields and all of `transformers.TrainingArguments`) can be set in
the YAML recipe and on the command line (`--max_steps 200` or `--max-steps 200`); command-line values
win. `occult-ft train --help` lists the Occult fields first, then the inherited ones.
RECIPE is a YAML file or the name of a shipped recipe (`tiny`, `olmoe-1b-7b`, ...: the files of the
repository's `recipes/`, installed with the package as `occult_ft/recipes/`).

    occult-ft train tiny
    occult-ft train recipes/olmoe-1b-7b.yaml --learning_rate 1e-5 --max_steps 200
    occult-ft train --model_name_or_path embedded --dataset embedded --max_devices_per_token 2

`--trainer trl` runs the recipe through TRL's SFTTrainer (`occult_ft.trl.OccultSFTTrainer`, needs
`pip install 'occult-ft[trl]'`): its fields are `OccultSFTConfig`'s, i.e. TRL's `SFTConfig` fields
(`max_length`, `packing`, `completion_only_loss`, `assistant_only_loss`, `dataset_text_field`, ...)
plus the same Occult fields; `docs/trl.md` has an example.

    occult-ft train --trainer trl sft-recipe.yaml

Launchers work as with any Trainer script (they set the environment Trainer reads); the module
`occult_ft.cli` and this one (`occult_ft.commands.train`) both accept the `--local_rank=N` that the
`deepspeed` launcher inserts:

    torchrun --nproc_per_node 4 -m occult_ft.cli train recipe.yaml
    accelerate launch --num_processes 4 -m occult_ft.commands.train recipe.yaml
    deepspeed --num_gpus 4 --module occult_ft.commands.train recipe.yaml --deepspeed ds.json
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..checks import close_match
from ._common import check_hub_sources, quiet_deepspeed_accelerator, read_yaml, standalone

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
    "field_names",
    "missing_extras",
    "format_help",
    "FIELD_GROUPS",
    "TRAINERS",
    "split_trainer",
]

#: `--trainer` values: occult_ft's own Trainer (OccultConfig) or TRL's SFTTrainer (OccultSFTConfig)
TRAINERS = ("occult", "trl")

_RECIPE_SUFFIXES = (".yaml", ".yml", ".json")

#: `occult-ft train --help` shows these OccultConfig fields first, in these groups (a field of
#: OccultConfig missing here is listed under "other Occult fields"; tests/test_cli.py keeps it empty)
FIELD_GROUPS = {
    "model and data": (
        "model_name_or_path",
        "model_dtype",
        "dataset",
        "dataset_split",
        "text_field",
        "eval_dataset",
        "eval_dataset_split",
        "streaming",
        "seq_len",
        "packing",
        "response_only",
        "skip_invalid_rows",
    ),
    "placement and pruning": (
        "devices",
        "nodes",
        "exchange",
        "exchange_chunks",
        "exchange_overlap_local",
        "exchange_overlap_shared",
        "exchange_capacity",
        "placement",
        "placement_algorithm",
        "max_load_imbalance",
        "profile_tokens",
        "max_devices_per_token",
        "max_nodes_per_token",
        "criterion",
        "gate_weights",
        "balance_loss_coef",
        "device_bias_rate",
        "device_bias_init",
        "distill_coef",
        "distill_temperature",
    ),
    "training": (
        "train_mode",
        "lora_r",
        "lora_alpha",
        "lora_dropout",
        "expert_parallel_size",
        "embedding_gradient_overlap",
        "output_dir",
        "learning_rate",
        "bf16",
        "logging_steps",
    ),
}

# --report_to names -> the module each needs (transformers.integrations); checked before any model loads
_REPORTERS = {
    "tensorboard": ("tensorboard", "tensorboardX"),
    "wandb": ("wandb",),
    "mlflow": ("mlflow",),
    "comet_ml": ("comet_ml",),
    "clearml": ("clearml",),
    "neptune": ("neptune",),
    "dvclive": ("dvclive",),
    "codecarbon": ("codecarbon",),
    "swanlab": ("swanlab",),
    "trackio": ("trackio",),
    "dagshub": ("dagshub",),
    "flyte": ("flytekit",),
    "azure_ml": ("azureml",),
}

# deprecated TrainingArguments names -> current ones (a recipe may use either with any transformers >= 5.17)
_ALIASES = {
    "gradient_checkpointing": "activation_checkpointing",
    "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs",
}


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
        "argv",
        nargs="*",
        help="[--trainer occult|trl] RECIPE.yaml and/or --field value overrides (any OccultConfig field; "
        "with --trainer trl any OccultSFTConfig field)",
    )
    p.set_defaults(func=run)
    return p


def config_class(trainer: str = "occult"):
    """The config dataclass of a `--trainer` value: `OccultConfig`, or `OccultSFTConfig` for trl."""
    if trainer == "trl":
        from ..trl import OccultSFTConfig

        return OccultSFTConfig
    from ..trainer import OccultConfig

    return OccultConfig


def split_trainer(argv: list[str]) -> tuple[str, list[str]]:
    """The `--trainer` value (default occult) and the other arguments.

    Raises:
        ValueError: an unknown trainer, named with the closest valid one.
    """
    rest, trainer = list(argv), "occult"
    for i, token in enumerate(rest):
        if token in ("--trainer", "--trainer=") or token.startswith("--trainer="):
            if "=" in token:
                trainer, rest = token.split("=", 1)[1], rest[:i] + rest[i + 1 :]
            elif i + 1 < len(rest):
                trainer, rest = rest[i + 1], rest[:i] + rest[i + 2 :]
            else:
                raise ValueError(f"--trainer needs a value: one of {', '.join(TRAINERS)}")
            break
    if trainer not in TRAINERS:
        close = close_match(trainer, TRAINERS, cutoff=0.5)
        hint = f"did you mean {close!r}? " if close else ""
        raise ValueError(f"--trainer {trainer!r} is unknown; {hint}choose one of {', '.join(TRAINERS)}")
    return trainer, rest


def config_parser(trainer: str = "occult"):
    """The `HfArgumentParser` of `OccultConfig` (or, for `trainer="trl"`, `OccultSFTConfig`) behind
    `occult-ft train` (errors raise ValueError)."""
    from transformers import HfArgumentParser

    config = config_class(trainer)

    class _Parser(HfArgumentParser):
        def error(self, message):  # one line through the CLI's error handling, not a usage dump
            raise ValueError(message)

    from ..cli import HelpFormatter

    return _Parser(
        config,
        prog="occult-ft train",
        allow_abbrev=False,
        formatter_class=HelpFormatter,
        description="Fine-tune an MoE with Occult placement and collaboration pruning.",
    )


def format_help(parser, trainer: str = "occult") -> str:
    """`occult-ft train --help`: usage with the recipe, the Occult fields in `FIELD_GROUPS`, then the
    fields inherited from `transformers.TrainingArguments` (with `--trainer trl`: from `trl.SFTConfig`),
    every default shown once."""
    import argparse
    import dataclasses

    from transformers import TrainingArguments

    from ..cli import HelpFormatter

    base: type = TrainingArguments
    base_name, link = (
        "transformers.TrainingArguments",
        "https://huggingface.co/docs/transformers/main_classes/trainer",
    )
    if trainer == "trl":
        from trl import SFTConfig

        base, base_name, link = SFTConfig, "trl.SFTConfig", "https://huggingface.co/docs/trl/sft_trainer"

    display = argparse.ArgumentParser(
        prog="occult-ft train",
        usage="occult-ft train [RECIPE] [--field value ...]",
        description=__doc__,
        formatter_class=HelpFormatter,
        add_help=False,
    )
    actions: dict[str, list] = {}
    for action in parser._actions:
        if action.dest != "help":
            actions.setdefault(action.dest, []).append(action)
    shown: set[str] = set()
    inherited = {f.name for f in dataclasses.fields(base)}
    own = [name for name in actions if name not in inherited]
    groups = dict(FIELD_GROUPS)
    others = tuple(name for name in own if not any(name in names for names in groups.values()))
    if others:
        groups["other Occult fields"] = others
    for acts in actions.values():
        for action in acts[1:]:
            if isinstance(action, argparse._StoreFalseAction):  # HfArgumentParser's --no_<field>
                action.help = f"sets {acts[0].option_strings[0]} to False"
    for title, names in groups.items():
        group = display.add_argument_group(f"Occult: {title}")
        for name in names:
            for action in actions.get(name, ()):
                group._add_action(action)
            shown.add(name)
    group = display.add_argument_group(f"inherited from {base_name}", f"the trainer's own settings ({link})")
    for name, acts in actions.items():
        if name not in shown:
            for action in acts:
                group._add_action(action)
    return display.format_help()


def field_names(parser) -> list[str]:
    """The OccultConfig field names `parser` (`config_parser()`) knows, sorted."""
    return sorted({a.dest for a in parser._actions if a.dest not in ("help",)})


def _unknown(name: str, names: list[str], where: str) -> ValueError:
    if _is_sft_field(name) and "max_length" not in names:
        return ValueError(
            f"unknown field {name!r} {where}; it is a TRL SFTConfig field: run with --trainer trl"
        )
    close = close_match(name, names)
    hint = f"; did you mean {close!r}?" if close else "; `occult-ft train --help` lists the fields"
    return ValueError(f"unknown field {name!r} {where}{hint}")


def _is_sft_field(name: str) -> bool:
    """A field of TRL's SFTConfig that is not a TrainingArguments field (False without TRL)."""
    import dataclasses
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return False
    from transformers import TrainingArguments
    from trl import SFTConfig

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    return name in {f.name for f in dataclasses.fields(SFTConfig)} - inherited


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
            close = close_match(token, names)
            hint = f"did you mean {close!r}? " if close else ""
            raise ValueError(
                f"{token!r} is neither a recipe file (.yaml/.yml/.json) nor a shipped recipe; {hint}shipped: "
                f"{', '.join(names) or 'none'}; fields are given as --field value"
            )
        break
    return None, rest


def _current_name(name: str, actions) -> str:
    """The name this transformers release knows for a field that was renamed: the current one for a
    deprecated name (no deprecation warning for a recipe that works either way), the old one on a release
    before the rename."""
    if name in _ALIASES and _ALIASES[name] in actions:
        return _ALIASES[name]
    old = next((k for k, v in _ALIASES.items() if v == name), None)
    if old is not None and name not in actions and old in actions:
        return old
    return name


def read_recipe(path: str) -> dict:
    """The mapping of fields a recipe file holds, read bounded (`_common.read_yaml`: an alias bomb is one
    line at once); nothing heavy is imported, so a bad recipe is refused before torch and transformers load."""
    if not os.path.isfile(path):
        raise ValueError(
            f"recipe {path!r} does not exist; pass a YAML file of OccultConfig fields or a shipped recipe "
            f"name ({', '.join(sorted(shipped_recipes()))})"
        )
    data = read_yaml(path, "recipe") or {}
    if not isinstance(data, dict):
        raise ValueError(f"recipe {path!r} holds a {type(data).__name__}; expected a mapping of field: value")
    return data


def load_recipe(path: str, parser, data: dict | None = None) -> dict:
    """The recipe's fields as parser defaults (`data`: what `read_recipe` read, else it is read here)."""
    data = read_recipe(path) if data is None else data
    actions = {a.dest: a for a in parser._actions}
    names = field_names(parser)
    values = {}
    for key, value in data.items():
        name = _current_name(str(key).replace("-", "_"), actions)
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
                    f"write one value, e.g. {name}: {_example(actions[name].default, convert)}"
                )
        values[name] = value
    return values


def _example(default, convert) -> str:
    """A value to show in a recipe error: the field's default, or a plain number where it has none."""
    if default is not None:
        return repr(default)
    return "4" if convert is int else "0.001"


def parse_config(argv: list[str], trainer: str | None = None):
    """An `OccultConfig` (or, with `--trainer trl`, an `OccultSFTConfig`) from `[--trainer T] [RECIPE]
    [--field value ...]`, or None after printing --help.

    Raises:
        ValueError: one line naming an unknown field (with the closest valid one) or a bad value.
    """
    if trainer is None:
        trainer, argv = split_trainer(argv)
    if any(token in ("-h", "--help") for token in argv):
        quiet_deepspeed_accelerator()
        print(format_help(config_parser(trainer), trainer))
        return None
    recipe, rest = split_recipe(argv)
    data = read_recipe(recipe) if recipe is not None else None  # before the imports below
    quiet_deepspeed_accelerator()  # before transformers imports DeepSpeed (--deepspeed)
    parser = config_parser(trainer)
    import torch

    # progress bars by default (the CLI quiets library logging); no pinned memory without an accelerator
    # (the DataLoader warns on every CPU run otherwise)
    parser.set_defaults(disable_tqdm=False, dataloader_pin_memory=torch.accelerator.is_available())
    if recipe is not None:
        parser.set_defaults(**load_recipe(recipe, parser, data))
    actions = {a.dest: a for a in parser._actions}
    for i, token in enumerate(rest):
        if token.startswith("--"):
            flag, eq, value = token.partition("=")
            name = flag[2:].replace("-", "_")
            if _current_name(name, actions) != name:
                rest[i] = f"--{_current_name(name, actions)}{eq}{value}"
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
        raise _unknown(name, field_names(parser), "on the command line")
    return config


def missing_extras(config) -> list[str]:
    """One line per optional dependency `config` needs but this install lacks (checked before any model loads)."""
    import importlib.util

    needs = []
    if hasattr(config, "max_length"):  # an OccultSFTConfig: TRL's SFTTrainer runs it
        needs.append(("trl", "trl", "--trainer trl"))
    if config.train_mode == "lora":
        needs.append(("peft", "peft", "train_mode=lora"))
    if config.deepspeed:
        needs.append(("deepspeed", "deepspeed", "--deepspeed"))
    missing = [
        f"{why} needs {module}, which is not installed: pip install 'occult-ft[{extra}]'"
        for module, extra, why in needs
        if importlib.util.find_spec(module) is None
    ]
    for name in config.report_to or ():
        modules = _REPORTERS.get(name, ())
        if modules and all(importlib.util.find_spec(m) is None for m in modules):
            missing.append(
                f"--report_to {name} needs {modules[0]}, which is not installed: pip install {modules[0]} "
                "(or --report_to none)"
            )
    return missing


def run(args: argparse.Namespace) -> int:
    import importlib.util

    trainer_name, argv = split_trainer(list(args.argv))
    if trainer_name == "trl" and importlib.util.find_spec("trl") is None:
        raise ImportError("--trainer trl needs trl, which is not installed: pip install 'occult-ft[trl]'")
    config = parse_config(argv, trainer_name)  # a recipe is read (bounded) before torch is imported
    if config is None:
        return 0
    missing = missing_extras(config)
    if missing:
        raise ImportError("; ".join(missing))
    check_hub_sources(
        "train", models=[config.model_name_or_path], datasets=[config.dataset, config.eval_dataset]
    )
    finished = False
    try:
        if trainer_name == "trl":
            from ..trl.pipeline import train_sft as run_training
        else:
            from ..trainer import train as run_training  # type: ignore[assignment]
        trainer, metrics = run_training(config)
        if trainer.is_world_process_zero():
            pruned = config.max_devices_per_token is not None or config.max_nodes_per_token is not None
            what = "LoRA adapter" if config.train_mode == "lora" else "pruned model" if pruned else "model"
            print(
                f"saved the {what} to {config.output_dir} (load it with "
                f"occult_ft.from_pretrained({config.output_dir!r})); metrics:"
            )
            for key in sorted(metrics):
                value = metrics[key]
                print(f"  {key}: {value:.4f}" if isinstance(value, float) else f"  {key}: {value}")
        finished = True
    finally:
        from ..dispatch.comm import close_process_group

        close_process_group(wait_for_others=finished)
    return 0


def main(argv=None) -> int:
    """`python -m occult_ft.commands.train` (what launchers run)."""
    return standalone("train", add_parser, argv)


if __name__ == "__main__":
    from ..cli import exit_process

    exit_process(main())

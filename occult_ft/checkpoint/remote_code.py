"""Remote code for pruned checkpoints: stock `AutoModelForCausalLM` routes with the budget too.

A pruned checkpoint whose budget the model's own config cannot express (every architecture except
DeepSeek with its native `n_group`/`topk_group` fields) would route with its original top-k under a
stock loader. `write_remote_code` puts a self-contained `occult_pruned_routing.py` into the checkpoint
and `set_auto_map` points `config.auto_map["AutoModelForCausalLM"]` (a multimodal model's
`AutoModelForImageTextToText`) at the class it defines, so

    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)

returns `Occult<Base>ForCausalLM`, a subclass of the stock class whose routers apply the budget of
config.json's `occult` block, on a machine without occult_ft. Without `trust_remote_code` transformers
loads the stock class, as before. The file is generated from occult_ft's own source (see
`remote_code_source`), so there is one copy of the routing maths.

    needs_remote_code(pruning, native)   a full checkpoint with an active, non-native budget
    set_auto_map(config, on)             add (or drop a stale) occult entry of `config.auto_map`
    remote_code_source(model_type)       the text of the file
    write_remote_code(save_dir, config)  write it beside a saved checkpoint
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os

from .. import checks, metrics
from ..fileio import atomic_write_text, read_json_object
from ..models import arch as models_arch
from ..models import registry
from ..models.family import loads_as
from ..routing import config as routing_config
from ..routing import router as routing_router
from ..routing import rules as routing_rules
from . import format as format_
from .format import AUTO_CLASS, REMOTE_CODE_FILE, REMOTE_MODULE

__all__ = [
    "remote_auto_class",
    "remote_class_name",
    "remote_auto_map",
    "needs_remote_code",
    "set_auto_map",
    "remote_code_source",
    "write_remote_code",
]


_AUTO_CLASSES = {"causal_lm": AUTO_CLASS, "image_text_to_text": "AutoModelForImageTextToText"}


def remote_auto_class(model_type: str) -> str:
    """The auto class whose `auto_map` entry the file gets: `AutoModelForCausalLM`, or
    `AutoModelForImageTextToText` for a multimodal model type."""
    kind = loads_as(model_type)
    if kind is None:
        raise ValueError(
            f"model_type {model_type!r} has no causal-LM or image-text-to-text class in transformers; "
            "remote code is written for language models only"
        )
    return _AUTO_CLASSES[kind]


def _stock_class_name(model_type: str) -> str:
    from transformers.models.auto import modeling_auto

    mapping = (
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if remote_auto_class(model_type) == AUTO_CLASS
        else modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    )
    return mapping[model_type]


def remote_class_name(model_type: str) -> str:
    """`Occult<Base>`, e.g. `OccultOlmoeForCausalLM` for `olmoe`."""
    return f"Occult{_stock_class_name(model_type)}"


def remote_auto_map(model_type: str) -> dict[str, str]:
    """The `auto_map` entry that sends the model type's auto class (with trust_remote_code) to the file."""
    return {remote_auto_class(model_type): f"{REMOTE_MODULE}.{remote_class_name(model_type)}"}


def needs_remote_code(pruning, native: bool, model_type: str | None = None) -> bool:
    """A checkpoint needs remote code when its budget is active and not written in native fields (and,
    given `model_type`, transformers has a language-model class to subclass)."""
    if pruning is None or not pruning.active or native:
        return False
    return model_type is None or loads_as(model_type) is not None


def set_auto_map(config, on: bool) -> None:
    """Point the model type's auto class in `config.auto_map` at the remote class (`on`), or remove
    occult entries left from an earlier load (`not on`); other `auto_map` entries are kept."""
    current = dict(getattr(config, "auto_map", None) or {})
    for key in [k for k, v in current.items() if str(v).startswith(f"{REMOTE_MODULE}.")]:
        del current[key]
    if on:
        current.update(remote_auto_map(config.model_type))
    if current:
        config.auto_map = current
    else:
        config.__dict__.pop("auto_map", None)


# ---- generating the file from occult_ft's source ----------------------------------------------------
def _node_source(lines: list[str], node: ast.stmt) -> str:
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return "\n".join(lines[start - 1 : node.end_lineno])


def _module_body(module) -> str:
    """Every top-level statement of `module` except its docstring, imports and `__all__`."""
    source = inspect.getsource(module)
    lines, parts = source.splitlines(), []
    for i, node in enumerate(ast.parse(source).body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            continue
        parts.append(_node_source(lines, node))
    return "\n\n\n".join(parts)


def _absolute_imports(modules, plain=()) -> list[str]:
    """The top-level absolute imports of `modules` and the modules `plain`, merged (what the copied code
    and the adapter use)."""
    plain, froms = set(plain), dict[str, set[str]]()
    for module in modules:
        for node in ast.parse(inspect.getsource(module)).body:
            if isinstance(node, ast.Import):
                plain.update(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
            elif (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and node.module not in (None, "__future__")
            ):
                names = froms.setdefault(node.module, set())
                names.update(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
    lines = [f"import {name}" for name in sorted(plain)]
    lines += [f"from {mod} import {', '.join(sorted(names))}" for mod, names in sorted(froms.items())]
    return lines


def _literal(value) -> str:
    """A Python literal of a registry field (infinite floats as `float("-inf")`)."""
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return f'float("{value}")'
    return repr(value)


def _arch_constant(arch) -> str:
    kwargs = [f"    {f.name}={_literal(getattr(arch, f.name))}," for f in dataclasses.fields(arch)]
    return "ARCH = MoEArch(\n" + "\n".join(kwargs) + "\n)"


_HEADER = '''"""Pruned routing of an occult_ft checkpoint ({model_type}) for stock transformers.

Generated by occult_ft (occult_ft/checkpoint/remote_code.py); do not edit. With

    {auto}.from_pretrained(path, trust_remote_code=True)

transformers loads `{cls}`: the stock `{base}` whose MoE routers apply the
device budget (and device bias) of config.json's `occult` block, exactly as
`occult_ft.from_pretrained(path)` does. It needs torch, transformers and safetensors, not occult_ft.
The routing maths is copied from occult_ft.
"""

from __future__ import annotations
'''

_ADAPTER = '''
# ---- the adapter: one forward hook per router -------------------------------------------------
logger = logging.get_logger(__name__)
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")


def _read_tables(path, hub_kwargs):
    """layer index -> (E, E) similarity table (placed order) saved beside the checkpoint, or None."""
    if not path:
        return None
    path = str(path)
    subfolder = hub_kwargs.get("subfolder") or ""
    file = None
    for name in (SIMILARITY_FILE, *LEGACY_SIMILARITY_FILES):  # today's name, then earlier releases'
        if os.path.isdir(path):
            file = os.path.join(path, subfolder, name)
            file = file if os.path.isfile(file) else None
        else:
            try:
                from transformers.utils import cached_file

                kwargs = {{k: v for k, v in hub_kwargs.items() if k in _HUB_KWARGS and v is not None}}
                file = cached_file(path, name, _raise_exceptions_for_missing_entries=False, **kwargs)
            except Exception:  # offline, no such repo: the caller refuses the checkpoint
                file = None
        if file is not None:
            break
    if file is None:
        return None
    from safetensors.torch import load_file

    return {{int(k.split(".")[1]): v.float() for k, v in load_file(file).items()}}


class _PrunedRouting:
    """The checkpoint's budget and, for `similarity`, its tables; called as each router's forward hook."""

    def __init__(self, config):
        self.config = config
        data = getattr(config, "occult", None)
        if not data:  # this class exists for pruned checkpoints only: without the block it would route unpruned
            raise ValueError(
                "config.json names {cls} (a checkpoint occult_ft pruned) but has no occult block, without which "
                "it would route unpruned; put back the config.json it was saved with"
            )
        block = OccultBlock.from_dict(data, "config.json's occult block")
        self.pruning = block.pruning
        self.device_bias = block.device_bias or {{}}  # floats: the model
        # is built on the meta device, so tensors are made at the first forward (`__call__`)
        self.tables = None  # None: not read yet; {{}}: none found
        self._cache = {{}}

    def read_tables(self, path, hub_kwargs=None):
        """Read the similarity tables once (criterion `similarity` only); refuse a checkpoint without them
        (routing by another criterion would load a model that computes something else)."""
        if self.pruning is None or self.pruning.criterion != "similarity" or self.tables is not None:
            return
        self.tables = _read_tables(path, hub_kwargs or {{}}) or {{}}
        if not self.tables:
            self._refuse(f"{{SIMILARITY_FILE}} was not found beside {{path or 'the model'}}")

    @staticmethod
    def _refuse(why):
        raise ValueError(
            f"occult: {{why}}; this checkpoint prunes by criterion 'similarity', which routes with those tables: "
            f"put the checkpoint's {{SIMILARITY_FILE}} back beside its config.json (occult_ft.from_pretrained "
            "and vLLM refuse it too)"
        )

    def _on(self, key, tensor, device):
        """`tensor` on `device`, moved once."""
        if (key, device) not in self._cache:
            self._cache[(key, device)] = tensor.to(device)
        return self._cache[(key, device)]

    def __call__(self, index, router, args, kwargs, output):
        logits, weights, ids = output
        pruning, table = self.pruning, None
        if pruning.criterion == "similarity":
            self.read_tables(getattr(self.config, "_name_or_path", None))  # built without from_pretrained
            table = self.tables.get(index)
            if table is None:
                self._refuse(f"the similarity tables hold no MoE layer {{index}}")
            table = self._on(("sim", index), table, logits.device)
        num_experts = ARCH.num_experts(router)
        expert_device = self._on(
            ("dev", num_experts), contiguous_expert_device(num_experts, pruning.num_devices), logits.device
        )
        inputs = ARCH.call_inputs(args[1:], kwargs)
        bias = None
        if index in self.device_bias:
            if ("bias", index) not in self._cache:
                self._cache[("bias", index)] = torch.tensor(self.device_bias[index], dtype=torch.float32)
            bias = self._on(("bias", index, "on"), self._cache[("bias", index)], logits.device)
        ids, weights, _ = prune_topk(
            ARCH, router, logits, ids, weights, pruning, expert_device, table, inputs, bias
        )
        return logits, weights, ids


def _install(model):
    """Hook every routed MoE block's router (layer index as occult_ft's `find_moe_layers` counts it)."""
    routing = _PrunedRouting(model.config)
    if routing.pruning is None or not routing.pruning.active:
        return routing
    for index, _, block in moe_blocks(ARCH, model):
        router = getattr(block, ARCH.router_attr)
        routing.pruning.check(ARCH.num_experts(router), ARCH.top_k(router))
        router.register_forward_hook(functools.partial(routing, index), with_kwargs=True)
    return routing


def _share_weight_conversions():
    """transformers renames some checkpoints' weights on load (legacy names) through conversion mappings
    it skips for remote-code classes unless the mapping was registered: register the model type's own
    mapping again (unchanged), so this class loads the checkpoint exactly as the stock class does."""
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
    except ImportError:  # a transformers without conversion mappings renames nothing
        return
    mapping = get_checkpoint_conversion_mapping({model_type!r})
    if mapping is not None:
        register_checkpoint_conversion_mapping({model_type!r}, mapping, overwrite=True)
    # a mapping keyed by the stock class's name (Qwen3-Omni's thinker: `model.` -> `model.language_model.`)
    # is looked up by class name, which is this class's own
    mapping = get_checkpoint_conversion_mapping({base!r})
    if mapping is not None:
        register_checkpoint_conversion_mapping({cls!r}, mapping, overwrite=True)


_share_weight_conversions()


class {cls}(_StockModel):
    """`{base}` with the pruned routing of the checkpoint's `occult` block."""

    # vLLM's Transformers backend would rebuild the stock model from this config and route it with the
    # unpruned top-k: these two answers make vLLM refuse the checkpoint instead (occult_ft's vLLM plugin
    # serves it). They only keep `set_attn_implementation` from switching attention after loading.
    _supports_attention_backend = False

    @classmethod
    def _can_set_attn_implementation(cls):
        return False

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self._occult_routing = _install(self)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        model._occult_routing.read_tables(pretrained_model_name_or_path, kwargs)
        return loaded

    def save_pretrained(self, save_directory, *args, **kwargs):
        result = super().save_pretrained(save_directory, *args, **kwargs)
        tables = self._occult_routing.tables
        if tables and kwargs.get("is_main_process", True):
            from safetensors.torch import save_file

            tensors = {{f"layers.{{i}}": t.contiguous().cpu() for i, t in tables.items()}}
            save_file(tensors, os.path.join(str(save_directory), SIMILARITY_FILE))
        return result
'''


def remote_code_source(model_type: str) -> str:
    """The text of `occult_pruned_routing.py` for a registered `model_type`."""
    arch = registry.get_arch(model_type)
    base, cls = _stock_class_name(model_type), remote_class_name(model_type)
    imports = _absolute_imports(
        [checks, routing_rules, models_arch, routing_config, routing_router, format_],
        ("dataclasses", "functools", "os"),
    )
    imports += [
        f"from transformers import {base} as _StockModel",
        "from transformers.utils import logging",
    ]
    # One copy of the maths: the file is cut from occult_ft's own source, the input checks of checks.py,
    # the pure criteria of routing/rules.py and the router conventions of models/arch.py (all three whole
    # modules), PruningConfig, router_selectable and prune_topk, contiguous_expert_device and OccultBlock
    # with its PlacementRecord, plus the model type's registry entry written out as a constant and
    # `_ADAPTER`, which hooks every router: the hook receives the router's own (logits, weights, indices)
    # and call arguments and returns prune_topk's result, what occult_ft's pruned router class computes.
    # The `similarity` criterion reads `occult_similarity.tables` (or an earlier release's
    # `occult_similarity.safetensors`) from the checkpoint, local or Hub; without it the file refuses
    # the checkpoint, as occult_ft's loader and vLLM plugin do. A multimodal model's file subclasses its image-text-to-text class.
    sections = [
        _HEADER.format(model_type=model_type, cls=cls, base=base, auto=remote_auto_class(model_type)),
        "\n".join(imports),
        "# ---- copied from occult_ft/checks.py ------------------------------------------------------",
        _module_body(checks),
        "# ---- copied from occult_ft/routing/rules.py -----------------------------------------------",
        _module_body(routing_rules),
        "# ---- copied from occult_ft/models/arch.py --------------------------------------------------",
        _module_body(models_arch),
        "# ---- copied from occult_ft/metrics.py, routing/ and checkpoint/format.py -----------------",
        inspect.getsource(metrics.contiguous_expert_device),
        inspect.getsource(routing_config.PruningConfig),
        inspect.getsource(routing_router.router_selectable),
        inspect.getsource(routing_router.prune_topk),
        "\n".join(
            f"{name} = {getattr(format_, name)!r}"
            for name in ("BLOCK_VERSION", "EXPERT_ORDERS", "PRUNING_KEYS", "KNOWN_KEYS")
        ),
        inspect.getsource(format_.CheckpointError),
        inspect.getsource(format_.PlacementRecord),
        inspect.getsource(format_.OccultBlock),
        f"# ---- the {model_type!r} entry of occult_ft's architecture registry ----",
        _arch_constant(arch),
        f"SIMILARITY_FILE = {format_.SIMILARITY_FILE!r}",
        f"LEGACY_SIMILARITY_FILES = {format_.LEGACY_SIMILARITY_FILES!r}",
        _ADAPTER.format(cls=cls, base=base, model_type=model_type),
    ]
    return "\n\n".join(s.strip("\n") for s in sections) + "\n"


def write_remote_code(save_dir: str | os.PathLike, config) -> str:
    """Write `occult_pruned_routing.py` for `config.model_type` into a saved checkpoint and name its class
    in the saved config.json's `architectures`; returns the file's path.

    The name is what keeps a serving engine that does not know the budget from serving the checkpoint
    with the unpruned routing: vLLM picks its model class by `architectures`, has no `Occult<Base>` class
    and refuses the checkpoint, unless occult_ft's plugin (`occult_ft.serving.vllm_plugin`) registered it.
    transformers picks its class by `model_type` (the stock class without `trust_remote_code`, the remote
    class with it, through `auto_map`), so the name changes nothing there; the remote class, saved again,
    writes its own name."""
    folder = os.fspath(save_dir)
    path = os.path.join(folder, REMOTE_CODE_FILE)
    atomic_write_text(path, remote_code_source(config.model_type))
    config_file = os.path.join(folder, "config.json")
    saved = read_json_object(config_file)
    saved["architectures"] = [remote_class_name(config.model_type)]
    atomic_write_text(config_file, json.dumps(saved, indent=2, sort_keys=True) + "\n")
    return path

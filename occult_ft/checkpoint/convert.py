"""DeepSeek-MoE (model_type `deepseek`, Hub remote code only) -> an exactly equivalent `qwen2_moe` checkpoint.

transformers has no `deepseek` model type, and the remote code's per-expert MoE block is not one of
the architectures occult_ft supports (recipes/README.md, "DeepSeek-MoE-16B"). Qwen2-MoE expresses
the same function exactly: plain multi-head attention with RoPE, RMSNorm, softmax top-k routing
without renormalisation, dense layers (`mlp_only_layers`) and a shared expert. The mapping:

- config: `n_routed_experts` -> `num_experts`, `n_shared_experts * moe_intermediate_size` ->
  `shared_expert_intermediate_size`, the dense layers (`layer < first_k_dense_replace` or
  `layer % moe_layer_freq != 0`) -> `mlp_only_layers` (with `decoder_sparse_step=1`), `qkv_bias=False`;
  everything else (vocab, widths, heads, rope theta, eps, norm_topk_prob) unchanged.
- weights keep their names (embeddings, norms, attention, dense MLPs, `mlp.gate.weight`,
  `mlp.experts.J.{gate,up,down}_proj.weight`; the per-expert names are the layout transformers itself
  saves for qwen2_moe and fuses into `gate_up_proj` (E, 2I, H) / `down_proj` (E, H, I) on load),
  except the shared experts, which DeepSeek already stores as one MLP of width n_shared * I:
  `mlp.shared_experts.*` -> `mlp.shared_expert.*`. Qwen2-MoE scales the shared expert by
  `sigmoid(shared_expert_gate(x))`: the gate is written as zeros (a constant 0.5) and the shared
  `down_proj` is multiplied by 2, which is exact in floating point (a power of two).

Conversion streams the shards tensor by tensor (at most one decoder layer in memory) and writes the
new checkpoint to a temporary sibling directory that is renamed into place. `maybe_convert` does the
same once into a cache directory, so a DeepSeek-MoE checkpoint is accepted wherever a model is.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

from ..fileio import CONVERTED_MARK, OutputPathError, atomic_directory, check_output_path

__all__ = [
    "DEEPSEEK_MODEL_TYPE",
    "ConversionError",
    "convert_config",
    "convert_deepseek_moe",
    "converted_cache_dir",
    "maybe_convert",
]

DEEPSEEK_MODEL_TYPE = "deepseek"
_SHARD_BYTES = 4 * 1024**3  # a shard is one layer, split past ~4 GiB (a DeepSeek-MoE-16B layer is ~1.1 GB)
_TOKENIZER_FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\..*|merges\.txt|.*\.tiktoken|"
    r"generation_config\.json|chat_template\..*)$"
)
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class ConversionError(ValueError):
    """A checkpoint that cannot be converted (wrong model type, unsupported option, bad --out)."""


# ---- config -----------------------------------------------------------------------------------------
def _is_moe_layer(cfg: dict, i: int) -> bool:
    """The remote code's rule for which decoder layers hold an MoE block."""
    return (
        cfg.get("n_routed_experts") is not None
        and i >= int(cfg.get("first_k_dense_replace", 0))
        and i % int(cfg.get("moe_layer_freq", 1)) == 0
    )


def convert_config(cfg: dict) -> dict:
    """The `qwen2_moe` config (as a dict for `Qwen2MoeConfig(**d)`) of a DeepSeek-MoE `config.json`.

    Raises:
        ConversionError: a model_type other than `deepseek`, or an option Qwen2-MoE cannot express
            exactly (attention bias, rope scaling, a scoring function other than softmax, no shared expert).
    """
    _check_convertible(cfg)
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    out = {
        "model_type": "qwen2_moe",
        "architectures": ["Qwen2MoeForCausalLM"],
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.get("max_position_embeddings", 4096),
        "initializer_range": cfg.get("initializer_range", 0.02),
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0))},
        "use_sliding_window": False,
        "max_window_layers": layers,
        "attention_dropout": cfg.get("attention_dropout", 0.0),
        "qkv_bias": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if not _is_moe_layer(cfg, i)],
        "num_experts": cfg["n_routed_experts"],
        "num_experts_per_tok": cfg["num_experts_per_tok"],
        "moe_intermediate_size": cfg["moe_intermediate_size"],
        "shared_expert_intermediate_size": cfg["n_shared_experts"] * cfg["moe_intermediate_size"],
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "router_aux_loss_coef": cfg.get("aux_loss_alpha", 0.001),
        "use_cache": cfg.get("use_cache", True),
    }
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if cfg.get(name) is not None:
            out[name] = cfg[name]
    dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    if dtype:
        out["dtype"] = dtype
    return out


def _check_convertible(cfg: dict) -> None:
    """Raises `ConversionError` for a config `convert_config` cannot turn into an exact qwen2_moe one."""
    model_type = cfg.get("model_type")
    if model_type != DEEPSEEK_MODEL_TYPE:
        raise ConversionError(
            f"model_type {model_type!r} is not DeepSeek-MoE ('deepseek'); only DeepSeek-MoE checkpoints need "
            "conversion, load this one directly"
        )
    unsupported = {
        "attention_bias": (cfg.get("attention_bias", False), False),
        "rope_scaling": (cfg.get("rope_scaling"), None),
        "scoring_func": (cfg.get("scoring_func", "softmax"), "softmax"),
        "hidden_act": (cfg.get("hidden_act", "silu"), "silu"),
        "pretraining_tp": (cfg.get("pretraining_tp", 1), 1),
    }
    for name, (value, wanted) in unsupported.items():
        if value != wanted:
            raise ConversionError(
                f"DeepSeek-MoE config {name}={value!r} has no exact qwen2_moe equivalent; only {name}={wanted!r} "
                "is converted"
            )
    if not cfg.get("n_routed_experts") or not cfg.get("n_shared_experts"):
        raise ConversionError(
            f"n_routed_experts={cfg.get('n_routed_experts')!r}, n_shared_experts={cfg.get('n_shared_experts')!r}: "
            "the converter handles DeepSeek-MoE with routed and shared experts only"
        )


# ---- weights ----------------------------------------------------------------------------------------
def _rename(key: str, cfg: dict):
    """(new name, scale) of one original tensor, or None for a buffer to drop; raises for unknown names."""
    if key.endswith("rotary_emb.inv_freq"):
        return None  # recomputed from rope_theta
    if key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        return key, 1
    m = _LAYER_KEY.match(key)
    if m:
        rest = m.group(2)
        if rest.startswith("mlp.shared_experts."):
            name = rest[len("mlp.shared_experts.") :]
            new = f"model.layers.{m.group(1)}.mlp.shared_expert.{name}"
            return new, (2 if name == "down_proj.weight" else 1)  # undoes sigmoid(0) = 0.5
        if re.fullmatch(
            r"(input_layernorm|post_attention_layernorm)\.weight|self_attn\.[qkvo]_proj\.weight|"
            r"mlp\.(gate|up|down)_proj\.weight|mlp\.gate\.weight|mlp\.experts\.\d+\.(gate|up|down)_proj\.weight",
            rest,
        ):
            return key, 1
    raise ConversionError(
        f"unexpected tensor {key!r} in a DeepSeek-MoE checkpoint; is it really model_type deepseek?"
    )


class _ShardReader:
    """Tensors of a checkpoint by name, read one at a time from safetensors (or .bin) shards."""

    def __init__(self, root: str):
        self.root = root
        self._handles: dict[str, object] = {}
        index = next(
            (
                os.path.join(root, n)
                for n in ("model.safetensors.index.json", "pytorch_model.bin.index.json")
                if os.path.isfile(os.path.join(root, n))
            ),
            None,
        )
        if index is not None:
            with open(index, encoding="utf-8") as f:
                self.where = dict(json.load(f)["weight_map"])
        else:
            single = next(
                (
                    n
                    for n in ("model.safetensors", "pytorch_model.bin")
                    if os.path.isfile(os.path.join(root, n))
                ),
                None,
            )
            if single is None:
                raise ConversionError(
                    f"{root!r} has no model.safetensors(.index.json) or pytorch_model.bin(.index.json); "
                    "pass a complete checkpoint directory"
                )
            self.where = {k: single for k in self._open(single).keys()}

    def _open(self, shard: str):
        if shard not in self._handles:
            path = os.path.join(self.root, shard)
            if shard.endswith(".safetensors"):
                from safetensors import safe_open

                handle = safe_open(path, framework="pt")
            else:
                import torch

                handle = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            self._handles[shard] = handle
        return self._handles[shard]

    def get(self, key: str):
        handle = self._open(self.where[key])
        return handle.get_tensor(key) if hasattr(handle, "get_tensor") else handle[key]


def _key_order(key: str) -> tuple:
    m = _LAYER_KEY.match(key)
    if key == "model.embed_tokens.weight":
        return (-1, key)
    return (int(m.group(1)), key) if m else (1 << 30, key)


def _write_weights(reader: _ShardReader, cfg: dict, dst: str, zeros_like) -> None:
    """Stream every tensor through `_rename` into one safetensors shard per decoder layer (embeddings and
    head on their own) plus their index; at most one layer's tensors are in memory."""
    out = _ShardWriter(dst)
    moe_layers = {i for i in range(int(cfg["num_hidden_layers"])) if _is_moe_layer(cfg, i)}
    gate_written: set[int] = set()
    current_layer = None
    for key in sorted(reader.where, key=_key_order):
        renamed = _rename(key, cfg)
        if renamed is None:
            continue
        new, scale = renamed
        layer_of_key = _key_order(key)[0]
        if layer_of_key != current_layer:
            out.flush()  # one output shard per decoder layer: at most one layer in memory
            current_layer = layer_of_key
        tensor = reader.get(key)
        tensor = (tensor * scale if scale != 1 else tensor).contiguous()
        layer = _LAYER_KEY.match(new)
        if layer and ".mlp.shared_expert." in new and int(layer.group(1)) not in gate_written:
            # DeepSeek-MoE's shared experts are ungated: a zero qwen2_moe gate, sigmoid(0) = 0.5, undone by
            # the 2x that `_rename` put on the shared down projection
            i = int(layer.group(1))
            out.add(
                f"model.layers.{i}.mlp.shared_expert_gate.weight",
                zeros_like(1, int(cfg["hidden_size"]), tensor.dtype),
            )
            gate_written.add(i)
        out.add(new, tensor)
    missing = sorted(moe_layers - gate_written)
    if missing:
        raise ConversionError(
            f"MoE layers {missing} have no mlp.shared_experts tensors; the checkpoint is incomplete"
        )
    out.finish()


class _ShardWriter:
    """safetensors shards of at most `_SHARD_BYTES` (a `flush` also ends one), named as transformers names
    them once their count is known, and their index (`model.safetensors.index.json`)."""

    def __init__(self, dst: str):
        self.dst = dst
        self.shard: dict = {}
        self.size = 0  # bytes in `shard`
        self.total = 0  # bytes written in all
        self.names: list[str] = []
        self.weight_map: dict[str, str] = {}

    def add(self, name: str, tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.size and self.size + nbytes > _SHARD_BYTES:
            self.flush()
        self.shard[name] = tensor
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.shard:
            return
        name = f"model-{len(self.names) + 1:05d}.safetensors"
        save_file(self.shard, os.path.join(self.dst, name), metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(self.shard, name))
        self.names.append(name)
        self.shard, self.size = {}, 0

    def finish(self) -> None:
        self.flush()
        # shard names carry the final count, as transformers writes them
        final = {}
        for j, name in enumerate(self.names):
            final[name] = f"model-{j + 1:05d}-of-{len(self.names):05d}.safetensors"
            os.replace(os.path.join(self.dst, name), os.path.join(self.dst, final[name]))
        index = {
            "metadata": {
                "total_size": self.total,
                CONVERTED_MARK: DEEPSEEK_MODEL_TYPE,
            },  # fileio: ours to replace
            "weight_map": {k: final[v] for k, v in sorted(self.weight_map.items())},
        }
        with open(os.path.join(self.dst, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)


# ---- checkpoints ------------------------------------------------------------------------------------
def _local_checkpoint(model: str) -> str:
    if os.path.isdir(model):
        return os.path.abspath(model)
    if model.startswith(("/", "./", "../", "~")) or model.count("/") > 1:
        raise ConversionError(
            f"model {model!r} does not exist; pass a local checkpoint directory or a Hub model id"
        )
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.bin"]
        )
    except Exception as exc:  # network, auth, offline: one line for the user
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConversionError(f"cannot fetch model {model!r} from the Hub: {first}") from None


def _read_config(root: str) -> dict:
    path = os.path.join(root, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"{root!r} has no config.json; pass a checkpoint directory")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def convert_deepseek_moe(model: str, out: str, overwrite: bool = False) -> str:
    """Convert a DeepSeek-MoE checkpoint (local directory or Hub id) into a `qwen2_moe` checkpoint at `out`.

    Args:
        model: directory or Hub id of a checkpoint with `model_type: deepseek`.
        out: the directory to create (not inside `model`); written to a temporary sibling, then renamed.
        overwrite: replace an existing non-empty `out`.

    Returns:
        The absolute path of `out`.

    Raises:
        ConversionError: one line naming a wrong model_type, a bad `out` or an unsupported option.
    """
    import torch
    from transformers import Qwen2MoeConfig

    src = _local_checkpoint(model)
    out = os.path.abspath(os.path.expanduser(out))
    try:
        check_output_path(out, src, what="--out", directory=True)
    except OutputPathError as exc:
        raise ConversionError(str(exc)) from None
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)) and not overwrite:
        raise ConversionError(
            f"--out {out!r} already exists and is not empty; choose another directory or overwrite it"
        )
    cfg = _read_config(src)
    new_cfg = Qwen2MoeConfig(**convert_config(cfg))
    with atomic_directory(out) as tmp:
        new_cfg.to_json_file(os.path.join(tmp, "config.json"))
        _write_weights(
            _ShardReader(src), cfg, tmp, lambda rows, cols, dtype: torch.zeros(rows, cols, dtype=dtype)
        )
        for name in sorted(os.listdir(src)):
            if _TOKENIZER_FILES.match(name) and os.path.isfile(os.path.join(src, name)):
                shutil.copy2(os.path.join(src, name), os.path.join(tmp, name))
    return out


def converted_cache_dir() -> str:
    """Where `maybe_convert` keeps converted checkpoints: $OCCULT_FT_CACHE, else $HF_HOME/occult_ft,
    else ~/.cache/occult_ft; plus `converted/`."""
    base = os.environ.get("OCCULT_FT_CACHE")
    if not base:
        hf_home = os.environ.get("HF_HOME")
        base = os.path.join(hf_home, "occult_ft") if hf_home else os.path.join("~", ".cache", "occult_ft")
    return os.path.join(os.path.expanduser(base), "converted")


def _hub_config(path: str) -> dict | None:
    """config.json of a Hub id, or None when it cannot be read (then loading reports the problem)."""
    try:
        from huggingface_hub import hf_hub_download

        with open(hf_hub_download(path, "config.json"), encoding="utf-8") as f:
            return json.load(f)
    except Exception:  # noqa: BLE001 - not a Hub model, offline, ...: not ours to report
        return None


def maybe_convert(path: str) -> str:
    """`path`, or for a DeepSeek-MoE checkpoint (local dir or Hub id) its converted copy in the cache.

    The first call converts (`convert_deepseek_moe`) into `converted_cache_dir()/<hash>`, the hash
    covering the checkpoint's resolved location and config; later calls return that directory.
    """
    if not isinstance(path, str) or not path:
        return path
    if os.path.isdir(path):
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            return path
        with open(config_path, encoding="utf-8") as f:
            try:
                cfg = json.load(f)
            except ValueError:
                return path
        src = os.path.realpath(path)
    elif path.count("/") == 1 and not path.startswith(("/", ".", "~")):
        cfg = _hub_config(path)
        if cfg is None:
            return path
        src = None
    else:
        return path
    if not isinstance(cfg, dict) or cfg.get("model_type") != DEEPSEEK_MODEL_TYPE:
        return path
    if src is None:
        src = _local_checkpoint(path)
    key = hashlib.sha256((src + "\0" + json.dumps(cfg, sort_keys=True)).encode()).hexdigest()[:16]
    out = os.path.join(converted_cache_dir(), key)
    done = os.path.join(out, "model.safetensors.index.json")
    if os.path.isfile(done):
        return out
    from filelock import FileLock

    os.makedirs(converted_cache_dir(), exist_ok=True)
    with FileLock(out + ".lock"):  # the ranks of a multi-GPU launch convert once, the others wait
        if not os.path.isfile(done):
            convert_deepseek_moe(src, out, overwrite=True)
    return out

"""Pruned checkpoints: standard HF checkpoints whose experts are placed and whose routing is pruned.

A checkpoint written here is an ordinary transformers checkpoint (plain `from_pretrained` loads it)
whose experts have been permuted so that device d of D holds the contiguous block
[d*E/D, (d+1)*E/D). Without a budget it is the same function as the original model. With a budget,
`config.json` carries an `occult` block and `occult_ft.from_pretrained` returns the model with the
pruned routing active:

    "occult": {"version": 1, "num_devices": 4, "num_nodes": 1, "max_devices_per_token": 2,
               "criterion": "score", "gate_weights": "model", "placed": true,
               "placement": {"algorithm": "search", "layers": {"0": [[...], ...]}}, ...}

`placement.layers` records which original experts each device holds (provenance; the weights are
already permuted). The similarity criterion's tables live beside the weights in
`occult_similarity.tables` (safetensors bytes, already in placed order; a name that no `*.safetensors`
glob takes for a weight shard). A LoRA adapter directory carries the same
block in `occult_config.json`; there `placed` is false and loading permutes the base model first.
DeepSeek-V3 with `device_topk_sum` (and DeepSeek-V2 with `device_max`) also get the native
`n_group`/`topk_group` fields, so stock transformers routes identically without occult_ft. Every other
active budget gets remote code (`occult_pruned_routing.py` and `config.auto_map`, see
`remote_code.py`): stock `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`
then routes with the budget too.

Modules: `format.py` the `occult` block, the similarity file and what a checkpoint directory holds
(the one reader and writer of those files); `save.py` writing checkpoints; `load.py` loading them
(`from_pretrained`; imported as `occult_ft.checkpoint.load`, since it sits above `occult_ft.apply`, which
records blocks through `format.py` and `save.py`); `remote_code.py` the `trust_remote_code` file; `convert.py` DeepSeek-MoE ->
qwen2_moe conversion.
"""

from .card import build_model_card, is_occult_card, write_model_card
from .convert import DEEPSEEK_MODEL_TYPE, ConversionError, convert_config, convert_deepseek_moe, maybe_convert
from .format import (
    ADAPTER_OCCULT_FILE,
    BLOCK_VERSION,
    LEGACY_SIMILARITY_FILES,
    OCCULT_KEY,
    REMOTE_CODE_FILE,
    SIMILARITY_FILE,
    CheckpointError,
    CheckpointSummary,
    OccultBlock,
    PlacementRecord,
    block_placement,
    describe_checkpoint,
    model_block,
    read_block,
    read_similarity,
    write_adapter_block,
    write_similarity,
)
from .save import (
    attach_occult_save,
    occult_config_fields,
    record_block,
    save_pruned,
    with_router_bias,
    write_native_group_fields,
)

__all__ = [
    "OCCULT_KEY",
    "SIMILARITY_FILE",
    "LEGACY_SIMILARITY_FILES",
    "ADAPTER_OCCULT_FILE",
    "REMOTE_CODE_FILE",
    "BLOCK_VERSION",
    "DEEPSEEK_MODEL_TYPE",
    "CheckpointError",
    "CheckpointSummary",
    "ConversionError",
    "OccultBlock",
    "PlacementRecord",
    "block_placement",
    "model_block",
    "read_block",
    "read_similarity",
    "write_similarity",
    "write_adapter_block",
    "occult_config_fields",
    "describe_checkpoint",
    "write_native_group_fields",
    "record_block",
    "with_router_bias",
    "save_pruned",
    "attach_occult_save",
    "build_model_card",
    "write_model_card",
    "is_occult_card",
    "convert_config",
    "convert_deepseek_moe",
    "maybe_convert",
]

"""Pruned checkpoints: standard HF checkpoints whose experts are placed and whose routing is pruned.

A checkpoint written here is an ordinary transformers checkpoint (plain `from_pretrained` loads it) with
its experts permuted so that device d holds [d*E/D, (d+1)*E/D); a budget rides in an `occult` block of
`config.json` (`occult_config.json` for a LoRA adapter). What a checkpoint holds and how each loader
sees it: docs/loading.md, "What a pruned checkpoint holds".

    format.py       the `occult` block, the similarity file, what a checkpoint directory holds (the one
                    reader and writer of those files)
    save.py         writing checkpoints
    load.py         loading them (`from_pretrained`; imported as `occult_ft.checkpoint.load`, since it sits
                    above `occult_ft.apply`, which records blocks through `format.py` and `save.py`)
    remote_code.py  the `trust_remote_code` file for budgets the model's config cannot express
    convert.py      DeepSeek-MoE -> qwen2_moe conversion

Legend: E experts per layer, D devices, d a device index.
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

"""Serving pruned checkpoints outside occult_ft (docs/serving.md):

- `routing.py`: `ServedRouting`, a checkpoint's pruned routing as a function of each MoE layer's
  router logits (engine-independent, testable without an engine);
- `vllm_plugin.py`: `register`, the `vllm.general_plugins` entry point (imports nothing heavy: vLLM
  calls it in every process it starts);
- `vllm_models.py`: the vLLM model classes it registers (imports vLLM; loaded by vLLM only).
"""

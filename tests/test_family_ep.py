"""Expert-parallel exactness for one representative of each router convention of the family.

For every convention (`occult_ft.models.representative_model_types()`: softmax top-k, DeepSeek-V2 and
-V3 group routing, sigmoid with a selection bias held by the router or by the block, top-k on logits,
the config's scoring_func, Gemma 4's probabilities with a per-expert scale, ...) a tiny model of the
representative type trains 5 steps with `OccultTrainer` twice: on 2 gloo processes with
expert_parallel_size=2 (the de-duplicated all-to-all, each rank holding 4 of the 8 experts) and on one
process with the same global batch; both pruned to 1 of 2 devices per token. The per-step losses and
gradient norms must agree (relative 1e-3, as in tests/test_expert_parallel.py, whose case runner this
file reuses). Every representative runs in one launch (the interpreters start once); half of them train
in `train_mode="lora"` (the expert LoRA factors shard with the experts), the other half `moe`.

This file is also the worker: `torchrun ... test_family_ep.py SPEC`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_utils import free_port  # noqa: E402
from helpers import build_tokenizer  # noqa: E402
from test_expert_parallel import REL_TOL, train_case  # noqa: E402

STEPS = 5


def _cases() -> dict[str, dict]:
    from occult_ft.models import representative_model_types

    reps = sorted(representative_model_types().values())
    return {t: {"train_mode": "lora" if i % 2 else "moe"} for i, t in enumerate(reps)}


def save_model(model_type: str, path: str) -> str:
    """A tiny model of `model_type` with diverse routing (random routers) and the tiny tokenizer."""
    from occult_ft.models import auto_model_class, find_moe_layers, tiny_config

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = tiny_config(model_type, vocab_size=len(tokenizer), max_position_embeddings=64)
    model = auto_model_class(config).from_config(config).float()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in find_moe_layers(model, check=False):
            for param in layer.router.parameters():
                if param.dim() == 2:
                    param.copy_(torch.randn(param.shape, generator=gen) * 2 / param.shape[1] ** 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _overrides(case: dict, world: int) -> dict:
    out = dict(max_steps=STEPS, devices=2, max_devices_per_token=1, train_mode=case["train_mode"])
    if case["train_mode"] == "lora":
        out.update(lora_r=2, lora_alpha=4, learning_rate=1e-2)
    if world > 1:
        out["expert_parallel_size"] = world
    return out


def _worker(spec_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    spec = json.loads(open(spec_path).read())
    results = {}
    for name, case in spec["cases"].items():
        try:
            results[name] = train_case(
                case["model"], os.path.join(spec["out"], name), spec["world"], _overrides(case, spec["world"])
            )
        except Exception as err:  # recorded, so the test reports which convention failed and why
            results[name] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    if int(os.environ.get("RANK", "0")) == 0:
        with open(spec["result"], "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    _worker(sys.argv[1])
    from occult_ft.dispatch.comm import exit_rank

    exit_rank(0)  # no interpreter finalization: see exit_rank


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("family-ep")
    cases = {t: {**c, "model": save_model(t, str(root / "models" / t))} for t, c in _cases().items()}
    single = {
        t: train_case(c["model"], str(root / "single" / t), 1, _overrides(c, 1)) for t, c in cases.items()
    }
    spec = {"cases": cases, "out": str(root / "ep"), "world": 2, "result": str(root / "ep.json")}
    (root / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.dirname(__file__), os.environ.get("PYTHONPATH")) if p
    )
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    launcher += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    proc = subprocess.run(
        [*launcher, os.path.abspath(__file__), str(root / "spec.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return single, json.loads((root / "ep.json").read_text()), cases


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(_cases()))
def test_expert_parallel_matches_one_process(runs, model_type):
    single, ep, cases = runs
    got, want = ep[model_type], single[model_type]
    assert "error" not in got, got.get("trace")
    assert got["steps"] == want["steps"] == list(range(1, STEPS + 1))
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"]), start=1):
        assert abs(a - b) <= REL_TOL * abs(b), f"step {step}: loss {a} on 2 ranks vs {b} on one"
    for step, (a, b) in enumerate(zip(got["grad_norm"], want["grad_norm"]), start=1):
        assert a == pytest.approx(b, rel=REL_TOL), f"step {step}: grad_norm {a} vs {b}"
    assert got["max_token_devices"] <= 1  # the budget held under expert parallelism
    assert got["shard_rows"] == 4 and got["groups"]["ep"] == [0, 1]

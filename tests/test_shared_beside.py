"""Shared experts beside the combine (`exchange_overlap_shared`, occult_ft/dispatch/shared.py).

The experts kernel runs the block's shared MLP while the combine travels and hands its output to the
block's own call of that MLP on the same tensor. Checked here: the whole model equals the stock one
(outputs and every gradient) for a block that calls the shared MLP after the experts (DeepSeek-V3,
GLM-4-MoE: served by the kernel) and one that calls it first (Qwen2-MoE: the kernel sees it ran and
leaves it); an output is never handed to another input (other memory, an in-place write, a later
forward); detaching restores the MLP's forward, another wrapper's included; and, on 2 gloo processes
under torchrun, training with it reproduces the single-process run step for step. The layer-level
exactness on 2 and 4 ranks (chunks, per-expert rows) is in tests/test_dispatch_dist.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from occult_ft.dispatch import check_exchange_settings, configure_exchange, gather_experts, shard_experts
from occult_ft.dispatch.shared import SharedBeside, attach_shared, detach_shared
from occult_ft.models import base_experts, find_moe_layers, tiny_config


def _besides(model) -> list[SharedBeside | None]:
    return [getattr(base_experts(layer.experts), "occult_beside", None) for layer in find_moe_layers(model)]


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "arch, way",
    [("deepseek_v3", "served"), ("glm4_moe", "served"), ("qwen2_moe", "ran_first")],
)
@pytest.mark.parametrize("chunks", [1, 2])
def test_the_model_with_the_shared_mlp_beside_the_combine_is_the_stock_model(arch, way, chunks):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch)).train()
    stock = copy.deepcopy(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 7))
    want = stock(input_ids=ids, labels=ids)
    want.loss.backward()

    shard_experts(model)  # one process: D = 1, the pipeline still runs its collectives' local path
    configure_exchange(model, chunks=chunks, overlap_shared=True)
    got = model(input_ids=ids, labels=ids)
    got.loss.backward()
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    stock_grads = _grads(stock)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, stock_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    besides = _besides(model)
    assert besides and all(b is not None for b in besides)
    # every layer's one forward went one way: the kernel's output served the block, or the block ran first
    assert [(b.served, b.ran_first) for b in besides] == [(1, 0) if way == "served" else (0, 1)] * len(
        besides
    )
    with torch.no_grad():  # and without a graph (evaluation, generation)
        torch.testing.assert_close(model(input_ids=ids).logits, want.logits, rtol=1e-5, atol=1e-5)

    gather_experts(model)  # removes the wrappers with the shards
    assert all(b is None for b in _besides(model))
    for layer in find_moe_layers(model):
        assert "forward" not in vars(getattr(layer.block, layer.arch.shared_mlp_attr))


def test_models_without_shared_experts_are_unchanged():
    model = AutoModelForCausalLM.from_config(tiny_config("olmoe"))
    shard_experts(model)
    configure_exchange(model, overlap_shared=True)
    assert all(b is None for b in _besides(model))
    assert all(base_experts(layer.experts).occult_shard.overlap_shared for layer in find_moe_layers(model))
    assert attach_shared(model) == 0


def test_turning_it_off_restores_the_mlp_forward():
    model = AutoModelForCausalLM.from_config(tiny_config("deepseek_v3"))
    shard_experts(model)
    configure_exchange(model, overlap_shared=True)
    assert attach_shared(model) == 2  # idempotent: the two MoE layers (the first is dense), still one wrapper
    mlp = find_moe_layers(model)[0].block.shared_experts
    assert mlp.forward == _besides(model)[0].forward
    configure_exchange(model, overlap_shared=False)
    assert "forward" not in vars(mlp) and all(b is None for b in _besides(model))


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.proj(x)


def test_an_output_is_handed_only_to_the_same_values():
    mlp = _MLP()
    beside = SharedBeside(mlp)
    mlp.forward = beside.forward
    x = torch.randn(2, 5, 4)
    flat = x.view(-1, 4)  # what the kernel sees: the block's tokens as (T, H), the same memory
    out = torch.randn(10, 3)

    beside.offer(flat, out)
    assert torch.equal(mlp(x), out.view(2, 5, 3)) and (beside.served, mlp.calls) == (1, 0)
    assert mlp(x).shape == (2, 5, 3) and mlp.calls == 1  # handed once: the next call runs the MLP

    beside.offer(flat, out)
    assert not torch.equal(mlp(x.clone()), out.view(2, 5, 3)) and mlp.calls == 2  # other memory
    beside.offer(flat, out)
    x.mul_(2)  # an in-place write after the kernel ran: new values under the same memory
    mlp(x)
    assert mlp.calls == 3 and beside.served == 1
    beside.offer(flat, out)
    mlp(x.transpose(0, 1))  # same memory and size, another token order
    assert mlp.calls == 4
    beside.offer(x.view(-1, 4), out)  # offered after the write: the same values again
    assert torch.equal(mlp(x), out.view(2, 5, 3)) and beside.served == 2
    beside.offer(x.view(-1, 4), out)
    beside.clear()  # the block's forward ended: nothing outlives it
    mlp(x)
    assert mlp.calls == 5 and beside.served == 2


def test_the_kernel_leaves_the_mlp_to_a_block_that_ran_it_first():
    mlp = _MLP()
    beside = SharedBeside(mlp)
    mlp.forward = beside.forward
    x = torch.randn(6, 4)
    mlp(x)
    assert not beside.wanted(x) and beside.ran_first == 1
    assert beside.wanted(x.clone())  # another tensor: the kernel runs it
    beside.clear()
    assert beside.wanted(x)


def test_a_block_forward_clears_what_its_kernel_left():
    """The block's hooks clear on entry and exit: an output offered before a forward (stale zeros for an
    input under the same memory) cannot serve it; the forward's own kernel output does."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("deepseek_v3")).eval()
    stock = copy.deepcopy(model)
    shard_experts(model)
    configure_exchange(model, overlap_shared=True)
    block, beside = find_moe_layers(model)[0].block, _besides(model)[0]
    x = torch.randn(1, 3, model.config.hidden_size)
    beside.offer(x.view(-1, x.shape[-1]), torch.zeros(3, model.config.hidden_size))
    with torch.no_grad():
        got, want = block(x), find_moe_layers(stock)[0].block(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert beside.served == 1 and beside._ready is None and beside._ran_on is None


def test_detaching_restores_another_wrappers_forward():
    model = AutoModelForCausalLM.from_config(tiny_config("deepseek_v3"))
    mlp = find_moe_layers(model)[0].block.shared_experts
    calls = []
    original = mlp.forward

    def hooked(*args, **kwargs):  # as accelerate's add_hook_to_module leaves a module
        calls.append(1)
        return original(*args, **kwargs)

    mlp.forward = hooked
    shard_experts(model)
    attach_shared(model)
    assert mlp.forward != hooked
    mlp(torch.randn(2, model.config.hidden_size))
    assert calls == [1]  # the wrapper runs the other wrapper, not past it
    detach_shared(model)
    assert mlp.forward == hooked


@pytest.mark.parametrize(
    "args, message",
    [
        (("two_stage", 2, 1, None, False, True), "overlap_shared runs the pipeline"),
        (("flat", 1, 1, 8, False, True), "capacity=8); use overlap_shared=False"),
        (("flat", 1, 1, None, False, "yes"), "overlap_shared='yes' must be True or False"),
    ],
)
def test_settings_it_cannot_run_are_one_line_errors(args, message):
    with pytest.raises(ValueError) as err:
        check_exchange_settings(*args)
    assert message in str(err.value) and "\n" not in str(err.value)


# ---- training on 2 gloo processes -------------------------------------------------------------------
@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory, tiny_tokenizer):
    from helpers import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("deepseek_v3"), "deepseek_v3", tiny_tokenizer)


@pytest.mark.slow
def test_training_with_the_shared_mlp_beside_the_combine_is_the_single_process_run(deepseek_dir, tmp_path):
    """DeepSeek-V3 (its block adds the shared MLP after the experts) on D = 2 with the overlap, plain and
    pruned to one device per token, against one process with the same global batch: losses and gradient
    norms within 1e-3 for 10 steps (the harness of tests/test_expert_parallel.py)."""
    from test_expert_parallel import PRUNING, STEPS, check_trajectory, launch, torchrun, train_case

    ep = dict(expert_parallel_size=2, exchange_overlap_shared=True)
    cases = [
        dict(name="plain", overrides=ep),
        dict(name="pruned", overrides=dict(ep, **PRUNING["pruned"])),
    ]
    results = launch(
        torchrun(2), dict(model=deepseek_dir, out=str(tmp_path), world=2, cases=cases), tmp_path, timeout=600
    )
    for case in cases:
        name = case["name"]
        reference = train_case(
            deepseek_dir, str(tmp_path / f"single-{name}"), 1, PRUNING[name] | {"devices": 2}
        )
        result = results[name]
        check_trajectory(result, reference, name)
        assert result["overlap_shared"] is True
        # every MoE layer (2 of 3) served by the kernel once per forward: 10 steps, plus any forward the
        # trainer runs besides them (the routing profile); never one layer without the other
        served = result["shared_served"]
        assert served >= 2 * STEPS and served % 2 == 0, served


def test_the_shared_mlp_backward_runs_while_the_dispatch_transposes_travel(monkeypatch):
    """The layer's backward issues the dispatch's transposes and returns; autograd then runs the shared
    MLP's backward, and only then `_Homecoming` waits for the transposes (`_dispatch_transpose`)."""
    from occult_ft.dispatch import pipeline

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("deepseek_v3")).train()
    shard_experts(model)
    configure_exchange(model, overlap_shared=True)
    order: list[str] = []
    for layer in find_moe_layers(model):
        weight = layer.block.shared_experts.down_proj.weight
        weight.register_hook(lambda g, i=layer.index: order.append(f"shared {i}") or g)
    transpose = pipeline._dispatch_transpose

    def recorded(states, *args):
        order.append("home")
        return transpose(states, *args)

    monkeypatch.setattr(pipeline, "_dispatch_transpose", recorded)
    ids = torch.randint(3, model.config.vocab_size, (2, 7))
    model(input_ids=ids, labels=ids).loss.backward()
    # backward meets the last MoE layer first: its shared MLP, then its homecoming; then the layer below
    assert order == ["shared 2", "home", "shared 1", "home"], order

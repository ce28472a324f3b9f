"""`CompensatedAdamW`: bf16 weights follow the float32 AdamW trajectory (no update lost to rounding),
float32 weights follow `torch.optim.AdamW` exactly, and `OccultTrainer` uses it for 16-bit runs."""

from __future__ import annotations

import pytest
import torch

from occult_ft.plan import COMPENSATED_OPTIMS
from occult_ft.trainer.optim import CompensatedAdamW

STEPS, LR = 10, 2e-5


def _gradients(n: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """A fine-tuning-like gradient sequence: a fixed direction plus fresh noise at each step."""
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(n, generator=gen)
    return [direction + 0.5 * torch.randn(n, generator=gen) for _ in range(steps)]


def _train(weights: torch.Tensor, optimizer_cls, grads, **kwargs) -> torch.Tensor:
    p = torch.nn.Parameter(weights.clone())
    opt = optimizer_cls([p], lr=LR, weight_decay=0.0, **kwargs)
    for g in grads:
        p.grad = g.to(p.dtype)
        opt.step()
    return p.detach()


def _bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at `x` (8 significant bits)."""
    return torch.ldexp(torch.ones_like(x), torch.frexp(x.float())[1] - 8)


def _moved(before: torch.Tensor, after: torch.Tensor, reference_delta: torch.Tensor) -> tuple[float, float]:
    """(share of the weights that the float32 run moved by a bf16 step or more that moved here too, mean
    |update| relative to the float32 run's)."""
    delta = after.float() - before.float()
    far = reference_delta.abs() >= _bf16_step(before)
    return float((delta[far] != 0).float().mean()), float(delta.abs().mean() / reference_delta.abs().mean())


def test_bf16_weights_move_like_float32_ones_where_torch_adamw_loses_two_thirds():
    n = 1_000_000
    w32 = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.02
    w16 = w32.bfloat16()
    grads = _gradients(n, STEPS)
    reference = _train(w16.float(), torch.optim.AdamW, grads) - w16.float()  # the same start, in fp32
    changed, ratio = _moved(w16, _train(w16, torch.optim.AdamW, grads), reference)
    assert ratio < 0.6  # plain bf16 AdamW rounds most updates away (30% of the weights move, 0.35x)
    ours = _train(w16, CompensatedAdamW, grads)
    changed, ratio = _moved(w16, ours, reference)
    assert changed > 0.99 and 0.9 < ratio < 1.1
    # each weight is the float32 trajectory's, rounded: within one bf16 step of it (99.9%; a weight that
    # shrank through a smaller binade carries its larger earlier rounding error, at most a few steps)
    target = w16.float() + reference
    assert float(((ours.float() - target).abs() <= _bf16_step(target)).float().mean()) > 0.999


def test_float32_parameters_follow_torch_adamw_exactly():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    groups = lambda ps: [{"params": [ps[0]], "weight_decay": 0.1}, {"params": [ps[1]], "weight_decay": 0.0}]  # noqa: E731
    ours = CompensatedAdamW(groups(a), lr=1e-2, betas=(0.8, 0.99), eps=1e-6)
    theirs = torch.optim.AdamW(groups(b), lr=1e-2, betas=(0.8, 0.99), eps=1e-6)
    for _ in range(5):
        grads = [torch.randn_like(p) for p in a]
        for params, opt in ((a, ours), (b, theirs)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert "compensation" not in ours.state[a[0]]


def test_a_resumed_optimizer_continues_exactly_with_float32_moments():
    w = torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 0.02
    grads = _gradients(4096, 6, seed=3)
    straight = _train(w.bfloat16(), CompensatedAdamW, grads)
    p = torch.nn.Parameter(w.bfloat16())
    opt = CompensatedAdamW([p], lr=LR, weight_decay=0.0)
    for g in grads[:3]:
        p.grad = g.bfloat16()
        opt.step()
    saved = opt.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    resumed = CompensatedAdamW([q], lr=LR, weight_decay=0.0)
    resumed.load_state_dict(saved)
    assert resumed.state[q]["exp_avg_sq"].dtype == torch.float32
    assert resumed.state[q]["compensation"].dtype == torch.bfloat16
    for g in grads[3:]:
        q.grad = g.bfloat16()
        resumed.step()
    assert torch.equal(q.detach(), straight)


# ---- through OccultTrainer -----------------------------------------------------------------------------
def _expert_delta(tiny_olmoe_dir, text_file, tmp_path, dtype: str, **trainer_kwargs):
    from occult_ft.models import find_moe_layers
    from occult_ft.trainer import OccultConfig, OccultTrainer

    args = OccultConfig(
        output_dir=str(tmp_path / dtype),
        model_dtype=dtype,
        train_mode="moe",
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_steps=STEPS,
        per_device_train_batch_size=4,
        seq_len=32,
        devices=4,
        placement="sequential",
        balance_loss_coef=0.0,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        train_sampling_strategy="sequential",
    )
    trainer = OccultTrainer(tiny_olmoe_dir, args=args, train_dataset=_rows(text_file), **trainer_kwargs)

    def experts():
        return torch.cat(
            [
                p.detach().float().flatten()
                for layer in find_moe_layers(trainer.model)
                for p in layer.experts.parameters()
            ]
        )

    before = experts()
    trainer.train()
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return before, experts() - before, type(optimizer)


def _rows(text_file):
    from occult_ft.data import load_text_dataset

    return load_text_dataset(text_file)


@pytest.mark.slow
def test_ten_bf16_steps_of_occult_trainer_move_the_experts_like_float32_ones(
    tiny_olmoe_dir, text_file, tmp_path
):
    _, reference, cls32 = _expert_delta(tiny_olmoe_dir, text_file, tmp_path, "float32")
    before, ours, cls16 = _expert_delta(tiny_olmoe_dir, text_file, tmp_path, "bfloat16")
    assert cls32 is torch.optim.AdamW and cls16 is CompensatedAdamW
    changed, ratio = _moved(before, before + ours, reference)
    assert changed > 0.99 and 0.9 < ratio < 1.1, (changed, ratio)
    _, plain, _ = _expert_delta(
        tiny_olmoe_dir,
        text_file,
        tmp_path / "plain",
        "bfloat16",
        optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": LR}),
    )
    assert _moved(before, before + plain, reference)[1] < 0.6  # without it: the updates are lost


@pytest.mark.parametrize("optim", COMPENSATED_OPTIMS)
def test_the_optim_names_the_plan_counts_as_compensated_are_torch_adamw(optim, tiny_olmoe_dir):
    from transformers import AutoModelForCausalLM

    from occult_ft.trainer import OccultConfig, OccultTrainer

    args = OccultConfig(output_dir="unused", use_cpu=True, report_to="none", optim=optim)
    model = AutoModelForCausalLM.from_pretrained(tiny_olmoe_dir, dtype=torch.bfloat16)
    assert OccultTrainer.get_optimizer_cls_and_kwargs(args, model)[0] is CompensatedAdamW
    assert OccultTrainer.get_optimizer_cls_and_kwargs(args, model.float())[0] is torch.optim.AdamW


# ---- what a 16-bit checkpoint holds: the saved weights and the rounded start ---------------------------
def test_the_stored_weight_is_always_the_best_16_bit_rounding_of_weight_plus_compensation():
    """Folding the compensation into the weights when they are saved would gain nothing: after every step
    p is a nearest bf16 value to p + c (p is rounded from the exact value and c is the remainder), so a
    saved bf16 weight is already the best a bf16 checkpoint can hold of the compensated trajectory. Where
    round(p + c) differs from p (0.1% of the weights), p + c lies exactly halfway: c, stored in bf16, was
    rounded to half a step."""
    n = 200_000
    p = torch.nn.Parameter((torch.randn(n, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16())
    opt = CompensatedAdamW([p], lr=LR, weight_decay=0.01)
    for step, g in enumerate(_gradients(n, STEPS, seed=4)):
        p.grad = g.bfloat16()
        opt.step()
        c = opt.state[p]["compensation"]
        exact = p.detach().double() + c.double()
        folded = exact.float().bfloat16()
        assert c.abs().max() > 0 and int((folded != p.detach()).sum()) < 0.005 * n, step
        # no bf16 value is nearer to p + c than p: |p - (p + c)| <= |round(p + c) - (p + c)|
        assert bool(((p.detach().double() - exact).abs() <= (folded.double() - exact).abs()).all()), step


def test_a_seeded_compensation_follows_the_float32_run_from_the_unrounded_start():
    """Loaded as bf16, a float32 checkpoint is rounded before the first step; seeding the compensation with
    what that rounding lost (`seed_compensation`) makes the bf16 weights the float32 run's, rounded: the
    update of each weight against the rounded start is the float32 run's rounded, where the unseeded run
    loses every update below half a bf16 step (3 steps: updates of about half a step at std 0.02, where
    the unseeded run moves 0.59x as far, the seeded one 1.000x)."""
    n = 1_000_000
    w32 = torch.randn(n, generator=torch.Generator().manual_seed(5)) * 0.02
    w16 = w32.bfloat16()
    grads = _gradients(n, 3, seed=6)
    best = (_train(w32, torch.optim.AdamW, grads)).bfloat16().float() - w16.float()  # fp32 run, rounded

    def bf16_run(seed: bool) -> torch.Tensor:
        p = torch.nn.Parameter(w16.clone())
        opt = CompensatedAdamW([p], lr=LR, weight_decay=0.0)
        if seed:
            assert opt.seed_compensation({p: (w32 - w16.float()).bfloat16()}) == 1
        for g in grads:
            p.grad = g.bfloat16()
            opt.step()
        return p.detach().float() - w16.float()

    seeded, plain = bf16_run(True), bf16_run(False)
    ratio = lambda d: float(d.abs().mean() / best.abs().mean())  # noqa: E731
    assert ratio(plain) < 0.8 and 0.99 < ratio(seeded) < 1.01, (ratio(plain), ratio(seeded))
    same = lambda d: float((d == best).float().mean())  # noqa: E731  # the same bf16 value, weight by weight
    assert same(plain) < 0.9 and same(seeded) > 0.99, (same(plain), same(seeded))


def test_a_float32_start_is_rounded_as_loading_it_in_bf16_would_be(tmp_path, tiny_tokenizer):
    """`round_keeping_residuals` gives a model loaded in float32 exactly the dtypes and values that
    `from_pretrained(dtype=bfloat16)` gives (DeepSeek-V3's router stays float32), and the residual of each
    trainable parameter is what the rounding lost."""
    from helpers import save_tiny_model
    from transformers import AutoModelForCausalLM

    from occult_ft.trainer.loading import round_keeping_residuals

    for model_type in ("olmoe", "deepseek_v3"):
        path = save_tiny_model(tmp_path / model_type, model_type, tiny_tokenizer)
        direct = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        exact = {n: p.detach().clone() for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.requires_grad_(".mlp." in n)  # as train_mode moe: experts and routers
        residuals = round_keeping_residuals(model, torch.bfloat16)
        assert model.config.dtype == torch.bfloat16
        ours, theirs = dict(model.named_parameters()), dict(direct.named_parameters())
        kept32 = [n for n, p in theirs.items() if p.dtype == torch.float32]
        assert bool(kept32) == (model_type == "deepseek_v3"), kept32
        for n, p in theirs.items():
            assert ours[n].dtype == p.dtype and torch.equal(ours[n], p), n
            if ours[n] in residuals:  # what the rounding lost, stored in the parameter's dtype
                assert torch.equal((exact[n] - p.float()).bfloat16(), residuals[ours[n]]), n
        trainable16 = {n for n, p in ours.items() if p.requires_grad and p.dtype == torch.bfloat16}
        assert {n for n, p in ours.items() if p in residuals} == trainable16 and trainable16


@pytest.mark.slow
def test_a_bf16_run_from_a_float32_checkpoint_saves_the_float32_runs_update_through_the_cli(
    tmp_path, tiny_tokenizer
):
    """The measurement that showed bf16 updates lost: tiny OLMoE (initializer std 0.02) saved in float32, 10 `moe` steps at lr
    2e-5 through `occult-ft train` in float32 and in bfloat16; the bf16 run's saved expert weights move as
    far as the float32 run's result rounded to bf16 (>= 0.95x in mean |update| and in the share of
    weights that moved; 0.92x / 0.97x before the compensation was seeded with the load rounding)."""
    from helpers import save_tiny_model
    from safetensors.torch import load_file

    from occult_ft.cli import main

    model = save_tiny_model(tmp_path / "m", "olmoe", tiny_tokenizer)
    assert load_file(f"{model}/model.safetensors")["lm_head.weight"].dtype == torch.float32
    saved = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        argv = ["train", "--model_name_or_path", model, "--dataset", "embedded", "--train_mode", "moe",
                "--model_dtype", dtype, "--max_steps", STEPS, "--learning_rate", LR, "--lr_scheduler_type",
                "constant", "--placement", "sequential", "--devices", 4, "--balance_loss_coef", 0, "--seed", 0,
                "--weight_decay", 0, "--output_dir", out, "--save_strategy", "no", "--report_to", "none",
                "--use_cpu", "true", "--per_device_train_batch_size", 4, "--seq_len", 64,
                "--train_sampling_strategy", "sequential", "--disable_tqdm", "true"]  # fmt: skip
        assert main([str(a) for a in argv]) == 0
        saved[dtype] = load_file(f"{out}/model.safetensors")
    start = load_file(f"{model}/model.safetensors")
    moved = best = 0.0
    moved_n = best_n = 0
    for name, w0 in start.items():
        if ".experts." not in name:
            continue
        b0 = w0.bfloat16().float()
        ours = saved["bfloat16"][name].float() - b0
        ref = saved["float32"][name].bfloat16().float() - b0  # the best a bf16 checkpoint can hold
        assert saved["bfloat16"][name].dtype == torch.bfloat16
        moved, best = moved + float(ours.abs().sum()), best + float(ref.abs().sum())
        moved_n, best_n = moved_n + int((ours != 0).sum()), best_n + int((ref != 0).sum())
    assert moved / best >= 0.95 and moved_n / best_n >= 0.95, (moved / best, moved_n / best_n)

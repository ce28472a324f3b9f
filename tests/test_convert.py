"""DeepSeek-MoE -> qwen2_moe conversion (`occult_ft.checkpoint.convert`, `occult-ft convert`).

The oracle is a plain-torch reference of the ORIGINAL DeepSeek-MoE architecture (the Hub's remote
`modeling_deepseek.py`, written out here independently) under the original weight names: random
weights are saved as a sharded safetensors checkpoint with `model_type: deepseek`, converted, loaded
with `AutoModelForCausalLM`, and the logits must match the reference in fp32.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from helpers import build_tokenizer
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F

from occult_ft.checkpoint.convert import ConversionError, convert_config, convert_deepseek_moe, maybe_convert


# ---- reference: the original architecture -----------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class MLP(nn.Module):
    def __init__(self, hidden, inner):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    """MoEGate: softmax over all experts, top-k, weights not renormalised (norm_topk_prob false)."""

    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg["n_routed_experts"], cfg["hidden_size"]))
        self.top_k = cfg["num_experts_per_tok"]

    def forward(self, x_TH):
        scores_TE = F.linear(x_TH, self.weight).softmax(dim=-1)
        return torch.topk(scores_TE, self.top_k, dim=-1)  # (weights_TK, ids_TK)


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hidden, inner = cfg["hidden_size"], cfg["moe_intermediate_size"]
        self.experts = nn.ModuleList(MLP(hidden, inner) for _ in range(cfg["n_routed_experts"]))
        self.gate = Gate(cfg)
        self.shared_experts = MLP(hidden, inner * cfg["n_shared_experts"])

    def forward(self, x):
        x_TH = x.reshape(-1, x.shape[-1])
        weights_TK, ids_TK = self.gate(x_TH)
        y_TH = torch.zeros_like(x_TH)
        for t in range(x_TH.shape[0]):  # token by token, expert by expert: obviously correct
            for w, e in zip(weights_TK[t], ids_TK[t]):
                y_TH[t] += w * self.experts[int(e)](x_TH[t])
        return (y_TH + self.shared_experts(x_TH)).reshape(x.shape)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, self.heads = cfg["hidden_size"], cfg["num_attention_heads"]
        self.head_dim = h // self.heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(h, h, bias=False) for _ in range(4))
        self.theta = cfg["rope_theta"]

    def forward(self, x):
        B, S, H = x.shape
        q, k, v = (
            p(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        inv_freq = 1.0 / self.theta ** (
            torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        )
        angles = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq)
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        out = scores.softmax(-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(B, S, H))


class Layer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.self_attn = Attention(cfg)
        moe = i >= cfg["first_k_dense_replace"] and i % cfg["moe_layer_freq"] == 0
        self.mlp = MoE(cfg) if moe else MLP(cfg["hidden_size"], cfg["intermediate_size"])
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class DeepseekReference(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def deepseek_config(**overrides) -> dict:
    """deepseek-moe-16b-base's config.json, shrunk (2048 -> 32 wide, 28 -> 4 layers, 64 -> 8 experts)."""
    cfg = {
        "architectures": ["DeepseekForCausalLM"],
        "model_type": "deepseek",
        "vocab_size": 320,
        "hidden_size": 32,
        "intermediate_size": 88,
        "moe_intermediate_size": 12,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 2,
        "num_experts_per_tok": 3,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def save_deepseek(path, cfg, seed=0) -> DeepseekReference:
    """Random reference weights as a 2-shard safetensors checkpoint with the original names."""
    torch.manual_seed(seed)
    ref = DeepseekReference(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1, 0.1)
            else:
                p.normal_(0, 0.2)  # larger than the usual init: every path shows in the logits
    os.makedirs(path, exist_ok=True)
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    keys = sorted(state)
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    weight_map = {}
    for name, part in halves.items():
        save_file({k: state[k] for k in part}, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    build_tokenizer(cfg["vocab_size"]).save_pretrained(path)
    return ref


# ---- tests ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [
        {},  # the 16B layout: layer 0 dense, every other layer MoE
        {"first_k_dense_replace": 0, "moe_layer_freq": 2, "num_hidden_layers": 3},  # MoE on layers 0, 2
    ],
    ids=["dense-first", "every-other"],
)
def test_converted_model_computes_the_original_logits(tmp_path, overrides):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = deepseek_config(**overrides)
    ref = save_deepseek(tmp_path / "ds", cfg)
    out = convert_deepseek_moe(str(tmp_path / "ds"), str(tmp_path / "conv"))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.config.model_type == "qwen2_moe"
    expected_dense = [
        i for i in range(cfg["num_hidden_layers"]) if not isinstance(ref.model.layers[i].mlp, MoE)
    ]
    assert model.config.mlp_only_layers == expected_dense
    ids = torch.randint(0, cfg["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids)
        got = model(ids).logits
    diff = (got - want).abs().max().item()
    print(f"max |logit difference| = {diff:.3g} (logits span {want.abs().max().item():.3g})")
    assert diff < 1e-5
    assert want.std() > 0.3  # logits of order 1: the 1e-5 tolerance is tight relative to them
    src_tok, out_tok = AutoTokenizer.from_pretrained(tmp_path / "ds"), AutoTokenizer.from_pretrained(out)
    assert out_tok("the quick fox").input_ids == src_tok("the quick fox").input_ids and len(out_tok) > 256
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary directory left


def test_shared_expert_gate_is_zero_and_down_proj_doubled(tmp_path):
    # sigmoid(0) = 0.5 and 2 * 0.5 = 1: the shared expert's output is unchanged, exactly
    from safetensors import safe_open

    ref = save_deepseek(tmp_path / "ds", deepseek_config())
    out = convert_deepseek_moe(str(tmp_path / "ds"), str(tmp_path / "conv"))
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        where = json.load(f)["weight_map"]

    def tensor(key):
        with safe_open(os.path.join(out, where[key]), "pt") as f:
            return f.get_tensor(key)

    assert torch.equal(tensor("model.layers.1.mlp.shared_expert_gate.weight"), torch.zeros(1, 32))
    original = ref.model.layers[1].mlp.shared_experts.down_proj.weight.detach()
    assert torch.equal(tensor("model.layers.1.mlp.shared_expert.down_proj.weight"), 2 * original)
    assert "model.layers.0.mlp.shared_expert_gate.weight" not in where  # layer 0 is dense
    # one shard per decoder layer (4) + embeddings + final norm and head: never more than a layer in memory
    assert len(set(where.values())) == 4 + 2
    assert (
        where["model.layers.2.mlp.experts.7.up_proj.weight"] == where["model.layers.2.input_layernorm.weight"]
    )


def test_config_of_the_real_16b_model():
    cfg = deepseek_config(
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_routed_experts=64,
        num_experts_per_tok=6,
    )
    q = convert_config(cfg)
    assert q["shared_expert_intermediate_size"] == 2 * 1408 == 2816
    assert q["mlp_only_layers"] == [0] and q["num_experts"] == 64 and q["num_experts_per_tok"] == 6
    assert q["qkv_bias"] is False and q["norm_topk_prob"] is False
    assert q["rope_parameters"]["rope_theta"] == 10000.0


def test_other_model_types_are_refused_in_one_line(tmp_path, tiny_olmoe_dir):
    with pytest.raises(ConversionError, match=r"model_type 'olmoe' is not DeepSeek-MoE") as err:
        convert_deepseek_moe(tiny_olmoe_dir, str(tmp_path / "out"))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()
    assert maybe_convert(tiny_olmoe_dir) == tiny_olmoe_dir  # not DeepSeek-MoE: untouched


def test_out_inside_or_equal_to_the_model_is_refused(tmp_path):
    save_deepseek(tmp_path / "ds", deepseek_config(num_hidden_layers=2))
    for out in (tmp_path / "ds", tmp_path / "ds" / "converted"):
        with pytest.raises(ConversionError, match="would overwrite the input"):
            convert_deepseek_moe(str(tmp_path / "ds"), str(out))
    assert sorted(os.listdir(tmp_path / "ds")) == sorted(
        [
            "config.json",
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )


def test_unsupported_options_are_refused():
    with pytest.raises(ConversionError, match="rope_scaling"):
        convert_config(deepseek_config(rope_scaling={"type": "linear", "factor": 2.0}))
    with pytest.raises(ConversionError, match="attention_bias"):
        convert_config(deepseek_config(attention_bias=True))


def test_maybe_convert_converts_once_into_the_cache(tmp_path, monkeypatch):
    from occult_ft.checkpoint.load import load_model_and_tokenizer

    monkeypatch.setenv("OCCULT_FT_CACHE", str(tmp_path / "cache"))
    cfg = deepseek_config(num_hidden_layers=2)
    ref = save_deepseek(tmp_path / "ds", cfg)
    first = maybe_convert(str(tmp_path / "ds"))
    assert first.startswith(str(tmp_path / "cache" / "converted"))
    stamp = os.path.getmtime(os.path.join(first, "config.json"))
    assert maybe_convert(str(tmp_path / "ds")) == first  # cached: not converted again
    assert os.path.getmtime(os.path.join(first, "config.json")) == stamp
    model, tokenizer = load_model_and_tokenizer(str(tmp_path / "ds"), dtype=torch.float32)
    assert model.config.model_type == "qwen2_moe" and tokenizer is not None
    ids = torch.arange(7).unsqueeze(0)
    with torch.no_grad():
        assert (model.eval()(ids).logits - ref(ids)).abs().max().item() < 1e-5

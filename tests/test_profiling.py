"""Profiling: the statistics recorded by router hooks equal those recomputed from the routing."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from occult_ft.models import find_moe_layers, tiny_config
from occult_ft.profiling import Profile, ProfileError, profile_model


def _model(model_type="olmoe"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()


def _batches(n=3, b=2, s=10):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(3, 128, (b, s), generator=g)} for _ in range(n)]


@pytest.mark.parametrize("model_type", ["olmoe", "deepseek_v3", "gpt_oss"])
def test_counts_match_the_token_level_routing(model_type):
    prof = profile_model(_model(model_type), _batches(), progress=False)
    assert prof.num_tokens == 60 and prof.top_k == 2 and prof.num_experts == 8
    for lp in prof.layers.values():
        ids = lp.topk_ids.long()
        assert ids.shape == (60, 2)
        onehot = torch.zeros(60, 8, dtype=torch.float64).scatter_(1, ids, 1.0)
        assert torch.equal(lp.coactivation, onehot.T @ onehot)
        assert torch.equal(lp.load, torch.bincount(ids.flatten(), minlength=8).double())
        assert torch.equal(lp.coactivation, lp.coactivation.T)
        # every token contributes k (k - 1) ordered off-diagonal pairs
        assert (lp.coactivation.sum() - lp.coactivation.trace()).item() == 60 * 2 * 1
        sim = lp.similarity()
        torch.testing.assert_close(sim.diagonal(), torch.ones(8))


def test_padding_is_skipped_and_max_tokens_respected():
    model = _model()
    ids = torch.randint(3, 128, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0  # 4 padded positions
    prof = profile_model(model, [{"input_ids": ids, "attention_mask": mask}], progress=False)
    assert prof.num_tokens == 16
    assert all(lp.topk_ids.shape[0] == 16 for lp in prof.layers.values())
    prof = profile_model(model, _batches(), max_tokens=25, progress=False)
    assert prof.num_tokens == 25


def test_profile_sees_the_routing_actually_used():
    from occult_ft.metrics import contiguous_expert_device, devices_per_token
    from occult_ft.routing import PruningConfig, apply_pruning

    model = _model()
    apply_pruning(model, PruningConfig(num_devices=4, max_devices_per_token=1))
    prof = profile_model(model, _batches(), progress=False)
    for lp in prof.layers.values():
        assert devices_per_token(lp.topk_ids.long(), contiguous_expert_device(8, 4), 4).max() == 1


def test_round_trip(tmp_path):
    prof = profile_model(_model(), _batches(), model_name="tiny", progress=False)
    path = str(tmp_path / "p.safetensors")
    prof.save(path)
    again = Profile.load(path)
    assert again.model == "tiny" and again.layers.keys() == prof.layers.keys()
    for i in prof.layers:
        assert torch.equal(again.layers[i].topk_ids, prof.layers[i].topk_ids)
        assert torch.equal(again.layers[i].prob_gram, prof.layers[i].prob_gram)


def test_bad_profile_files(tmp_path):
    with pytest.raises(ProfileError, match="does not exist"):
        Profile.load(str(tmp_path / "missing.safetensors"))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ProfileError, match="not a readable occult_ft profile"):
        Profile.load(str(bad))
    from safetensors.torch import save_file

    other = str(tmp_path / "other.safetensors")
    save_file({"x": torch.zeros(1)}, other)
    with pytest.raises(ProfileError, match="not an occult_ft profile"):
        Profile.load(other)


def test_no_tokens_is_an_error():
    with pytest.raises(ProfileError, match="no tokens"):
        profile_model(_model(), [], progress=False)


def test_layers_are_the_moe_layers():
    model = _model("deepseek_v2")
    prof = profile_model(model, _batches(1), progress=False)
    assert sorted(prof.layers) == [layer.index for layer in find_moe_layers(model)]

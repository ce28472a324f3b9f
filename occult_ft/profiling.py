"""Profiling: run a model over calibration data and record, per MoE layer, how its router behaves.

Per layer the `Profile` keeps
    topk_ids      (T, K) int16  the token-level routing, so placements are evaluated exactly
    coactivation  (E, E) f64    pair co-selection counts (diagonal = expert load)
    load          (E,)   f64    tokens per expert
    prob_gram     (E, E) f64    sum over tokens of p_e * p_f (router probabilities); its cosine form is
                                 the expert-similarity table of the similarity criterion
Forward hooks on the routers read the router's own output `(logits, weights, topk_ids)`, so the
profile sees exactly the routing the model uses (pruned or not). Padding tokens are skipped.
The file is safetensors (no pickle) with a JSON header in its metadata.

Shape legend: T tokens, K top-k, E experts, B batch, S sequence length.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from tqdm.auto import tqdm

from .checks import is_int
from .fileio import atomic_save
from .models.registry import find_moe_layers, get_arch, unwrap_model

__all__ = ["LayerProfile", "Profile", "ProfileError", "RoutingRecorder", "profile_model"]

FORMAT = "occult_ft.profile"
VERSION = 1


class ProfileError(ValueError):
    """A profile file that is missing, unreadable or does not fit the model."""


@dataclass
class LayerProfile:
    index: int
    topk_ids: torch.Tensor
    coactivation: torch.Tensor
    load: torch.Tensor
    prob_gram: torch.Tensor

    def similarity(self) -> torch.Tensor:
        """(E, E) cosine similarity of experts' router-probability profiles over the tokens."""
        norm = self.prob_gram.diagonal().clamp_min(1e-30).sqrt()
        return (self.prob_gram / norm[:, None] / norm[None, :]).float()


@dataclass
class Profile:
    model: str
    model_type: str
    num_experts: int
    top_k: int
    num_tokens: int
    layers: dict[int, LayerProfile] = field(default_factory=dict)
    group_size: int = 1  # experts per routing group of a group-limited router (placement moves whole groups)

    def check_model(self, num_experts: int, layer_indices, model_type: str | None = None) -> None:
        """Raise ProfileError unless this profile was made on a model with these experts and MoE layers."""
        rerun = "profile this model with `occult-ft profile`"
        if num_experts != self.num_experts:
            raise ProfileError(
                f"profile was made for {self.num_experts} experts, the model has {num_experts}; {rerun}"
            )
        layers = sorted(int(i) for i in layer_indices)
        if layers != sorted(self.layers):
            raise ProfileError(
                f"profile covers MoE layers {sorted(self.layers)}, the model has {layers}; {rerun}"
            )
        if model_type and self.model_type and model_type != self.model_type:
            raise ProfileError(
                f"profile was made on a {self.model_type} model, this one is {model_type}; {rerun}"
            )

    def similarity(self) -> dict[int, torch.Tensor]:
        return {i: lp.similarity() for i, lp in self.layers.items()}

    def topk_ids(self) -> dict[int, torch.Tensor]:
        return {i: lp.topk_ids.long() for i, lp in self.layers.items()}

    def save(self, path: str) -> None:
        from safetensors.torch import save_file

        tensors = {}
        for i, lp in self.layers.items():
            tensors[f"layers.{i}.topk_ids"] = lp.topk_ids.contiguous()
            tensors[f"layers.{i}.coactivation"] = lp.coactivation.contiguous()
            tensors[f"layers.{i}.load"] = lp.load.contiguous()
            tensors[f"layers.{i}.prob_gram"] = lp.prob_gram.contiguous()
        header = dict(
            format=FORMAT,
            version=VERSION,
            model=self.model,
            model_type=self.model_type,
            num_experts=self.num_experts,
            top_k=self.top_k,
            num_tokens=self.num_tokens,
            layers=sorted(self.layers),
            group_size=self.group_size,
        )
        metadata = {"occult_ft": json.dumps(header)}
        atomic_save(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))

    @classmethod
    def load(cls, path: str) -> Profile:
        from safetensors import safe_open

        if not os.path.isfile(path):
            raise ProfileError(
                f"profile {path!r} does not exist; create it with `occult-ft profile MODEL --data DATA --out {path}`"
            )
        try:
            with safe_open(path, framework="pt") as f:
                header = json.loads((f.metadata() or {}).get("occult_ft", "{}"))
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:  # safetensors raises several types for corrupt files
            raise ProfileError(
                f"profile {path!r} is not a readable occult_ft profile ({exc}); re-run occult-ft profile"
            ) from None
        if header.get("format") != FORMAT or header.get("version") != VERSION:
            raise ProfileError(
                f"{path!r} is not an occult_ft profile (format={header.get('format')!r}, version={header.get('version')!r}); "
                "re-run occult-ft profile"
            )
        prof = cls(
            header.get("model"),
            header.get("model_type"),
            header.get("num_experts"),
            header.get("top_k"),
            header.get("num_tokens"),
            group_size=header.get("group_size", 1),
        )
        prof.layers = _layers_from_tensors(path, header, tensors)
        return prof


def _layers_from_tensors(path: str, header: dict, tensors: dict) -> dict[int, LayerProfile]:
    """The layers of a profile file, checked against its header (sizes, shapes, ids, token counts)."""

    def bad(what: str) -> ProfileError:
        return ProfileError(
            f"profile {path!r}: {what}; the file is damaged or edited, re-run occult-ft profile"
        )

    e, k, n, g = (cast(Any, header.get(key)) for key in ("num_experts", "top_k", "num_tokens", "group_size"))
    ints = all(is_int(v) for v in (e, k, n))
    if not ints or not 1 <= k <= e or n < 1:
        raise bad(
            f"header num_experts={e!r}, top_k={k!r}, num_tokens={n!r} are not 1 <= top_k <= num_experts, tokens >= 1"
        )
    if not isinstance(g, int) or g < 1 or e % g:
        raise bad(f"header group_size={g!r} does not divide num_experts={e}")
    layers = header.get("layers")
    if not isinstance(layers, list) or not layers:
        raise bad(f"header lists no MoE layers ({layers!r})")
    return {int(i): _layer_from_tensors(int(i), tensors, e, k, bad) for i in layers}


def _layer_from_tensors(
    i: int, tensors: dict, e: int, k: int, bad: Callable[[str], ProfileError]
) -> LayerProfile:
    """MoE layer i of a profile file: its four tensors present, of the header's shapes, ids in [0, E)."""
    names = [f"layers.{i}.{part}" for part in ("topk_ids", "coactivation", "load", "prob_gram")]
    missing = [name for name in names if name not in tensors]
    if missing:
        raise bad(f"tensors {missing} are missing")
    ids, coact, load, gram = (tensors[name] for name in names)
    expected = {names[1]: (e, e), names[2]: (e,), names[3]: (e, e)}
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise bad(f"{name} has shape {tuple(tensors[name].shape)}, the header says {shape}")
    if ids.dim() != 2 or ids.shape[1] != k or ids.shape[0] < 1:
        raise bad(f"{names[0]} has shape {tuple(ids.shape)}, expected (tokens >= 1, top_k={k})")
    if int(ids.min()) < 0 or int(ids.max()) >= e:
        raise bad(f"{names[0]} holds expert ids outside [0, {e})")
    if not torch.isfinite(gram).all():
        raise bad(f"{names[3]} holds NaN or infinite values")
    return LayerProfile(i, ids, coact, load, gram)


class RoutingRecorder:
    """Forward hooks on every router of a model that accumulate a `Profile`.

    Use as a context manager; set `.mask_T` (bool, flattened attention mask) before each forward so
    that padding is skipped. At most `max_routing_tokens` token-level rows are kept per layer.
    """

    def __init__(self, model: nn.Module, max_routing_tokens: int | None = None):
        self.model = model
        self.layers = find_moe_layers(model)
        self.max_routing_tokens = max_routing_tokens
        self.mask_T: torch.Tensor | None = None
        e = self.layers[0].num_experts
        self._ids: dict[int, list[torch.Tensor]] = {layer.index: [] for layer in self.layers}
        self._kept = dict.fromkeys(self._ids, 0)
        self._co = {i: torch.zeros(e, e, dtype=torch.float64) for i in self._ids}
        self._gram = {i: torch.zeros(e, e, dtype=torch.float64) for i in self._ids}
        self.tokens = 0
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _hook(self, layer):
        def hook(module, args, output):
            logits, _, ids = output
            logits, ids = logits.detach(), ids.detach()
            if self.mask_T is not None and self.mask_T.numel() == ids.shape[0]:
                keep = self.mask_T.to(ids.device)
                logits, ids = logits[keep], ids[keep]
            e = logits.shape[-1]
            onehot = torch.zeros(ids.shape[0], e, dtype=torch.float64, device=ids.device)
            onehot.scatter_(1, ids.long(), 1.0)
            self._co[layer.index] += (onehot.T @ onehot).cpu()
            probs = layer.arch.probabilities(module, logits).double()
            self._gram[layer.index] += (probs.T @ probs).cpu()
            cap = self.max_routing_tokens
            room = ids.shape[0] if cap is None else max(0, cap - self._kept[layer.index])
            if room:
                self._ids[layer.index].append(ids[:room].to(torch.int16).cpu())
                self._kept[layer.index] += min(room, ids.shape[0])

        return hook

    def __enter__(self):
        for layer in self.layers:
            self._handles.append(layer.router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def profile(self, model_name: str) -> Profile:
        base = unwrap_model(self.model)
        first = self.layers[0]
        prof = Profile(
            model_name,
            get_arch(base).model_type,
            first.num_experts,
            first.top_k,
            self.tokens,
            group_size=max(layer.arch.routing_group_size(layer.router) for layer in self.layers),
        )
        for layer in self.layers:
            i = layer.index
            ids = torch.cat(self._ids[i]) if self._ids[i] else torch.zeros(0, first.top_k, dtype=torch.int16)
            co = self._co[i]
            prof.layers[i] = LayerProfile(i, ids, co, co.diagonal().clone(), self._gram[i])
        return prof


@torch.no_grad()
def profile_model(
    model: nn.Module,
    batches: Iterable[dict],
    model_name: str = "model",
    max_tokens: int | None = None,
    max_routing_tokens: int | None = 65536,
    progress: bool = True,
) -> Profile:
    """Run `model` over `batches` (dicts with `input_ids` (B, S) and optional `attention_mask`) and
    return its `Profile`. Stops after `max_tokens` non-padding tokens."""
    model.eval()
    device = next(model.parameters()).device
    bar = tqdm(total=max_tokens, unit="tok", desc="profiling", disable=not progress)
    with RoutingRecorder(model, max_routing_tokens) as rec:
        for batch in batches:
            ids_BS = torch.as_tensor(batch["input_ids"]).to(device)
            mask_BS = batch.get("attention_mask")
            mask_BS = torch.ones_like(ids_BS) if mask_BS is None else torch.as_tensor(mask_BS).to(device)
            if max_tokens is not None:
                left = max_tokens - rec.tokens
                if left <= 0:
                    break
                # drop whole trailing rows first, then mask the overflow inside the last one
                flat = mask_BS.flatten().cumsum(0)
                mask_BS = (mask_BS.flatten().bool() & (flat <= left)).view_as(mask_BS).long()
            rec.mask_T = mask_BS.flatten().bool()
            model(input_ids=ids_BS, attention_mask=mask_BS)
            n = int(rec.mask_T.sum())
            rec.tokens += n
            bar.update(n)
    bar.close()
    if rec.tokens == 0:
        raise ProfileError("profiling saw no tokens; check that the data is not empty")
    return rec.profile(model_name)

"""Collaboration pruning: device-limited top-k routing criteria and the pruned router.

Each token normally picks its top-k experts wherever they live; collaboration pruning restricts the
choice to experts on at most `max_devices_per_token` (M) devices, so a de-duplicated all-to-all sends
it at most M rows, and optionally on at most `max_nodes_per_token` nodes (DeepSeek-V3's node limit;
device d sits on node d // (D / num_nodes)). The criteria (pure functions below, vectorised over tokens):

- `score` (the paper's router-score rule): walk the token's selected top-k experts (as the model's
  router chose them: group limiting and DeepSeek-V3's correction bias included) in descending selection
  score and admit each one's device until M devices are admitted; then re-select the top-k among the
  experts on the admitted devices. For a plain top-k router the first M devices of that walk are the M
  devices with the best expert; for a group-limited router (DeepSeek `n_group` > 1) they are not, and
  ranking devices by their best expert would send tokens to groups the model's router excluded.
- `device_max` (DeepSeek-V2 device-limited routing: rank devices by their best expert, keep M, top-k
  inside): among the experts the model's router may select this is the same rule as `score`, reached
  from the DeepSeek side; both names are kept because users come from both.
- `device_topk_sum` (DeepSeek-V3 node-limited routing): rank devices by the sum of their top
  max(1, k // M) scores (for DeepSeek-V3 models their router's own top-2), keep M, top-k inside. Applied
  to every token, verbatim as DeepSeek-V3 does, so that the native `n_group`/`topk_group` fields
  reproduce it; unlike the others it may move a token whose top-k already fits.
- `similarity` (the paper's expert-similarity rule): admit devices as `score` does, keep the selected
  experts that live there, and replace each one outside (in descending score order) by the most similar
  expert on the admitted devices that is not selected yet. Similarity is the cosine between experts'
  router-probability profiles, measured by `occult_ft.profiling`.

Group-limited routers: re-selection (the top-k of `score`/`device_max`, the replacements of
`similarity`) takes experts of the groups the model's router allowed for the token; only when the
admitted devices hold too few of them (groups that straddle devices) does it fill up with the admitted
devices' other experts, because the device budget is the harder limit. The admitted devices always hold
at least one of the token's own selected experts, so no token moves to a device it did not choose.

With a node budget the walk admits a device only while its node is admitted or fewer than
`max_nodes_per_token` nodes are; when the selected top-k leaves room (fewer than M devices admitted) it
goes on through the token's other experts in descending score, so a token can use every device of its
admitted nodes that the device budget allows.

For `score`, `similarity` and `device_max` a token whose top-k already fits in the budget keeps its
routing and weights bit for bit (under a device bias: a token whose experts all lie on the devices the
bias ranks first).

Device balance (`device_bias`, DeepSeek-V3's auxiliary-loss-free balancing at the device level): a
pruned router may hold a (D,) bias added to the selection scores of each device's experts
(`add_device_bias`). The bias ranks the devices a token keeps, never how many: the walk visits the top-k
of the biased scores and admits at most as many devices as the token's own top-k reaches (within the
budget); the experts inside the admitted devices and the gate weights come from the unbiased scores
(`limit_topk`'s `ranked_scores_TE` / `ranked_ids_TK`). The trainer moves it after every optimizer step
by `device_bias_rate * sign(mean load - load)` (`update_device_bias`), so pruning stops piling tokens
onto the devices with the most popular experts, without sending any token to more devices. It applies
only under a budget.

Gate weights (the paper leaves them open; `gate_weights=`):
- `model` (default): the model's own convention applied to the new selection (softmax probabilities
  gathered and renormalised if the model renormalises, times `routed_scaling_factor`; GPT-OSS's
  softmax over the selected logits; DeepSeek-V3's unbiased sigmoid scores).
- `preserve_mass`: as `model`, then rescaled so that each pruned token's weights sum to what its
  unpruned weights summed to (keeps the output scale of models that do not renormalise, e.g. OLMoE).

Modules: `rules.py` the criteria as pure tensor functions (no model); `config.py` `PruningConfig`;
`router.py` the model-aware `prune_topk` and the pruned router class.

Shape legend: T tokens, E experts, K top-k, D devices, N nodes, M = max_devices_per_token.
"""

from .config import PruningConfig
from .router import (
    RouterRecord,
    apply_pruning,
    collect_routing,
    prune_topk,
    pruned_routers,
    remove_pruning,
    router_device_bias,
    router_selectable,
    router_similarity,
    set_recording,
    unpruned_routing,
)
from .rules import (
    CRITERIA,
    GATE_WEIGHT_POLICIES,
    add_device_bias,
    check_pruning_settings,
    device_scores,
    fits_budget,
    limit_devices,
    limit_topk,
    replace_by_similarity,
    update_device_bias,
    walk_admitted_devices,
)

__all__ = [
    "CRITERIA",
    "GATE_WEIGHT_POLICIES",
    "PruningConfig",
    "RouterRecord",
    "check_pruning_settings",
    "device_scores",
    "fits_budget",
    "limit_devices",
    "limit_topk",
    "walk_admitted_devices",
    "replace_by_similarity",
    "router_selectable",
    "prune_topk",
    "apply_pruning",
    "remove_pruning",
    "pruned_routers",
    "collect_routing",
    "set_recording",
    "unpruned_routing",
    "router_similarity",
    "router_device_bias",
    "add_device_bias",
    "update_device_bias",
]

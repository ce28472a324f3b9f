"""Redundant experts: the dispatch rule (`occult_ft.replicas`) against a token-by-token reference, the
replica placement (`occult_ft.placement.replicas`) against a brute-force search on tiny cases, and the
metrics that count the copies (`routing_report(copies=...)`, what benchmarks/redundant_experts.py reads)."""

from __future__ import annotations

import itertools

import pytest
import torch

from occult_ft.metrics import contiguous_expert_device, device_load, routing_report
from occult_ft.placement import PlacementError
from occult_ft.placement.replicas import check_redundant_experts, place_replicas, replica_key
from occult_ft.replicas import check_copies, replica_devices, replica_load, single_copies, spread_counts


def random_topk(tokens: int, experts: int, k: int, seed: int, skew: float = 1.5) -> torch.Tensor:
    """Distinct expert ids per token, drawn with a skew towards low ids (hot experts)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(experts, 0, -1).double() ** skew
    return torch.stack([torch.multinomial(weights, k, generator=g) for _ in range(tokens)])


def reference_devices(topk_ids_TK: torch.Tensor, copies_ED: torch.Tensor) -> torch.Tensor:
    """The module docstring's rule, token by token with Python lists."""
    ids = topk_ids_TK.tolist()
    copies = copies_ED.tolist()
    num_devices = len(copies[0])
    holders = [[d for d in range(num_devices) if row[d]] for row in copies]
    out = [[holders[e][0] for e in row] for row in ids]
    reached = [{holders[e][0] for e in row if len(holders[e]) == 1} for row in ids]
    for expert in [e for e in range(len(copies)) if len(holders[e]) > 1]:
        free = []
        for t, row in enumerate(ids):
            if expert not in row:
                continue
            hits = [d for d in holders[expert] if d in reached[t]]
            if hits:
                out[t][row.index(expert)] = hits[0]
            else:
                free.append(t)
        load = [sum(d in r for r in reached) for d in range(num_devices)]
        counts = dict.fromkeys(holders[expert], 0)
        for _ in free:  # each new row to the least loaded copy at that moment, ties to the lowest id
            d = min(holders[expert], key=lambda d: (load[d] + counts[d], d))
            counts[d] += 1
        queue = [d for d in holders[expert] for _ in range(counts[d])]  # lowest id's share first
        for t, d in zip(free, queue):
            out[t][ids[t].index(expert)] = d
            reached[t].add(d)
    return torch.tensor(out)


def copies_with(
    expert_device_E: torch.Tensor, num_devices: int, extra: list[tuple[int, int]]
) -> torch.Tensor:
    copies = single_copies(expert_device_E, num_devices)
    for e, d in extra:
        copies[e, d] = True
    return copies


def test_spread_counts_by_hand():
    # loads 5, 2, 2: 3 rows raise devices 1 and 2 to 3 (2 rows), the last to device 1 (lowest id at 3)
    assert spread_counts([5, 2, 2], 3) == [0, 2, 1]
    # 9 rows: all three reach 5 (0 + 3 + 3 = 6 rows), 3 left: one each -> 6, 6, 6
    assert spread_counts([5, 2, 2], 9) == [1, 4, 4]
    assert spread_counts([1, 1], 0) == [0, 0]
    assert spread_counts([4], 7) == [7]


@pytest.mark.parametrize("seed", range(6))
def test_spread_counts_match_one_row_at_a_time(seed):
    g = torch.Generator().manual_seed(seed)
    loads = torch.randint(0, 9, (4,), generator=g).tolist()
    for free in range(0, 25):
        counts = [0] * 4
        for _ in range(free):
            d = min(range(4), key=lambda d: (loads[d] + counts[d], d))
            counts[d] += 1
        assert spread_counts(loads, free) == counts


def test_rule_by_hand():
    # 4 experts on 2 devices (0, 1 | 2, 3); expert 0 also on device 1.
    copies = copies_with(contiguous_expert_device(4, 2), 2, [(0, 1)])
    ids = torch.tensor([[0, 2], [0, 1], [0, 3], [0, 1], [2, 3]])
    # fixed rows: token 0 reaches {1}, token 1 {0}, token 2 {1}, token 3 {0}, token 4 {1}
    # expert 0: tokens 0 and 2 already reach device 1, tokens 1 and 3 device 0: no free token
    assert replica_devices(ids, copies).tolist() == [[1, 1], [0, 0], [1, 1], [0, 0], [1, 1]]
    # token 0 now reaches one device instead of two
    assert replica_load(ids, copies).tolist() == [2, 3]


def test_free_tokens_go_to_the_least_loaded_copy():
    copies = copies_with(contiguous_expert_device(4, 2), 2, [(0, 1)])
    # three tokens of expert 0 alone (free), device loads from fixed rows: 0 -> 0, 1 -> 2
    ids = torch.tensor([[0], [0], [0], [2], [3]])
    # spread: device 0 takes two rows (0 -> 2), then tie at 2 -> device 0 (lowest id)
    assert replica_devices(ids, copies).flatten().tolist() == [0, 0, 0, 1, 1]
    ids = torch.tensor([[0], [0], [0], [0], [2], [3]])
    # four free tokens, loads 0 / 2: device 0 takes 2, then one each -> devices 0, 0, 0, 1 in token order
    assert replica_devices(ids, copies).flatten().tolist() == [0, 0, 0, 1, 1, 1]


def test_without_replicas_the_rule_is_the_placement():
    ids = random_topk(50, 8, 3, seed=1)
    expert_device = torch.tensor([1, 0, 3, 2, 0, 1, 2, 3])
    copies = single_copies(expert_device, 4)
    assert torch.equal(replica_devices(ids, copies), expert_device[ids])
    assert torch.equal(replica_load(ids, copies), device_load(ids, expert_device, 4))


@pytest.mark.parametrize("seed", range(8))
def test_rule_matches_the_token_by_token_reference(seed):
    g = torch.Generator().manual_seed(100 + seed)
    experts, devices = 8, 4
    ids = random_topk(60, experts, 3, seed=seed)
    copies = single_copies(contiguous_expert_device(experts, devices), devices)
    for _ in range(5):  # random extra copies, some experts with three
        copies[torch.randint(0, experts, (1,), generator=g), torch.randint(0, devices, (1,), generator=g)] = (
            True
        )
    assert torch.equal(replica_devices(ids, copies), reference_devices(ids, copies))


@pytest.mark.parametrize("seed", range(4))
def test_replicas_never_add_devices_to_a_token(seed):
    ids = random_topk(80, 8, 4, seed=seed)
    expert_device = contiguous_expert_device(8, 4)
    copies = place_replicas(ids, expert_device, 4, 8)
    with_copies = replica_devices(ids, copies)
    per_token = [len(set(row)) for row in with_copies.tolist()]
    without = [len(set(row)) for row in expert_device[ids].tolist()]
    assert all(a <= b for a, b in zip(per_token, without))
    # every row goes to a device that holds its expert
    assert copies[ids, with_copies].all()


def test_rule_handles_zero_tokens():
    copies = copies_with(contiguous_expert_device(4, 2), 2, [(0, 1)])
    assert replica_devices(torch.zeros(0, 2, dtype=torch.long), copies).shape == (0, 2)
    assert replica_load(torch.zeros(0, 2, dtype=torch.long), copies).tolist() == [0, 0]


def test_bad_copies_are_refused():
    with pytest.raises(ValueError, match="no copy"):
        check_copies(torch.zeros(4, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        check_copies(torch.ones(4, 2))


def brute_force_step(ids: torch.Tensor, copies: torch.Tensor, slots: int) -> tuple:
    """Best open (expert, device) by `place_replicas`' order, each candidate's routing from the reference."""
    experts_per_device = copies.shape[0] // copies.shape[1]
    best = None
    for e, d in itertools.product(range(copies.shape[0]), range(copies.shape[1])):
        if copies[e, d] or int(copies[:, d].sum()) - experts_per_device >= slots:
            continue
        trial = copies.clone()
        trial[e, d] = True
        dev = reference_devices(ids, trial).tolist()
        loads = [sum(d2 in set(row) for row in dev) for d2 in range(copies.shape[1])]
        together = sum(
            1
            for row_ids, row_dev in zip(ids.tolist(), dev)
            if e in row_ids and any(x != e and dv == d for x, dv in zip(row_ids, row_dev))
        )
        key = (max(loads), sum(loads), -together, e, d)
        best = key if best is None or key < best else best
    return best


@pytest.mark.parametrize("seed", range(5))
def test_each_replica_is_the_brute_force_best_step(seed):
    experts, devices, redundant = 6, 2, 4
    ids = random_topk(40, experts, 2, seed=seed)
    expert_device = contiguous_expert_device(experts, devices)
    placed = place_replicas(ids, expert_device, devices, redundant)
    copies = single_copies(expert_device, devices)
    for _ in range(redundant):
        best = brute_force_step(ids, copies, redundant // devices)
        trial = copies.clone()
        trial[best[3], best[4]] = True
        assert replica_key(ids, trial, best[3], best[4]) == best  # the fast key agrees with the reference
        copies[best[3], best[4]] = True
    assert torch.equal(placed, copies)
    assert (placed.sum(dim=0) == experts // devices + redundant // devices).all()  # equal slots


def test_replica_placement_by_hand():
    # 4 experts on 2 devices (0, 1 | 2, 3); expert 0 is hot and co-selected with expert 2
    ids = torch.tensor([[0, 2]] * 6 + [[0, 1]] * 2 + [[3, 2]])
    expert_device = contiguous_expert_device(4, 2)
    assert device_load(ids, expert_device, 2).tolist() == [8, 7]
    # step 1 (device 1's slot): a copy of 0 on device 1 sends the six (0, 2) tokens there: 2 / 7.
    #   Copies of 1 or 2 change nothing for device 0 (max 8).
    # step 2 (device 0's slot): a copy of 2 on device 0 makes experts 0 and 2 both free for the six
    #   (0, 2) tokens; expert 0 first: loads 2 / 1 from fixed rows, six free rows spread to 5 / 4, and
    #   expert 2 follows them. A copy of 3 on device 0 leaves 2 / 7.
    copies = place_replicas(ids, expert_device, 2, 2)
    assert copies[0, 1] and copies[2, 0] and int(copies.sum()) == 6
    assert replica_load(ids, copies).tolist() == [5, 4]


@pytest.mark.parametrize("seed", range(3))
def test_replicas_lower_the_imbalance_of_a_skewed_routing(seed):
    ids = random_topk(400, 16, 4, seed=seed, skew=2.0)
    expert_device = contiguous_expert_device(16, 4)
    copies = place_replicas(ids, expert_device, 4, 4)
    before = routing_report({0: ids}, expert_device, 4, 16)
    after = routing_report({0: ids}, expert_device, 4, 16, copies={0: copies})
    assert after.load_imbalance < before.load_imbalance
    assert after.comm_complexity <= before.comm_complexity


def test_zero_replicas_is_the_placement():
    ids = random_topk(30, 8, 2, seed=0)
    expert_device = contiguous_expert_device(8, 4)
    assert torch.equal(place_replicas(ids, expert_device, 4, 0), single_copies(expert_device, 4))


@pytest.mark.parametrize("bad", [3, -4, 2.0, 100])
def test_bad_replica_counts_are_refused_in_one_line(bad):
    with pytest.raises(PlacementError, match="redundant_experts") as err:
        check_redundant_experts(bad, 16, 4)
    assert "\n" not in str(err.value)


def test_report_with_single_copies_is_the_plain_report():
    ids = {0: random_topk(70, 8, 3, seed=2), 2: random_topk(50, 8, 3, seed=3)}
    expert_device = torch.tensor([1, 0, 3, 2, 0, 1, 2, 3])
    plain = routing_report(ids, expert_device, 4, 8)
    copies = {i: single_copies(expert_device, 4) for i in ids}
    assert routing_report(ids, expert_device, 4, 8, copies=copies) == plain
    # a layer the copies do not name keeps its plain figures
    copies = {0: place_replicas(ids[0], expert_device, 4, 4)}
    counted = routing_report(ids, expert_device, 4, 8, copies=copies)
    assert counted.layers[1] == plain.layers[1] and counted.layers[0] != plain.layers[0]

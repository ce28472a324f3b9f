"""occult_ft.checks: the shared integer, choice and divisibility checks and their one-line messages."""

from __future__ import annotations

import re

import pytest

from occult_ft.checks import (
    check_nodes,
    check_positive_int,
    choice_error,
    close_match,
    did_you_mean,
    divisors,
    is_int,
    is_positive_int,
    nodes_divide,
)
from occult_ft.layout import ExpertLayout
from occult_ft.placement import PlacementError


def test_divisors_match_a_brute_force_list():
    for n in [1, 2, 12, 36, 64, 97, 360]:
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    # 10**12 = 2**12 * 5**12 has 13 * 13 = 169 divisors, found in 10**6 steps, not 10**12
    big = divisors(10**12)
    assert len(big) == 169 and big[-2:] == [500000000000, 1000000000000]


@pytest.mark.parametrize(
    "value,integer,positive",
    [
        (3, True, True),
        (0, True, False),
        (-2, True, False),
        (True, False, False),
        (3.0, False, False),
        ("3", False, False),
    ],
)
def test_is_int_refuses_bools_floats_and_text(value, integer, positive):
    assert is_int(value) is integer
    assert is_positive_int(value) is positive


def test_check_positive_int_names_the_value_and_the_example():
    check_positive_int("devices", 4)
    with pytest.raises(ValueError, match=r"^devices=0 must be a positive integer, e.g. devices=4$"):
        check_positive_int("devices", 0, "devices=4")
    with pytest.raises(PlacementError, match=r"^seed=True must be a positive integer$"):
        check_positive_int("seed", True, error=PlacementError)


def test_close_match_offers_the_nearest_choice_only_when_it_is_close():
    assert close_match("scor", ("score", "similarity")) == "score"
    assert close_match("xyz", ("score", "similarity")) is None
    assert close_match(3, (1, 2, 33)) == "33"  # compared as text
    assert did_you_mean("flatt", ("flat", "per_expert")) == " (did you mean 'flat'?)"
    assert did_you_mean("zzz", ("flat", "per_expert")) == ""


def test_choice_error_is_one_line_with_the_hint_and_the_choices():
    error = choice_error("criterion", "scor", ("score", "similarity"))
    assert (
        str(error) == "criterion='scor' is unknown (did you mean 'score'?); choose one of score, similarity"
    )
    assert (
        str(choice_error("dtype", "int8", ("float32",))) == "dtype='int8' is unknown; choose one of float32"
    )


@pytest.mark.parametrize(
    "devices,nodes,ok",
    [
        (8, 1, True),
        (8, 2, True),
        (8, 8, True),
        (8, 3, False),
        (8, 0, False),
        (8, 2.0, False),
        (8, True, False),
    ],
)
def test_nodes_divide_devices(devices, nodes, ok):
    assert nodes_divide(devices, nodes) is ok
    if ok:
        check_nodes(devices, nodes)
        assert ExpertLayout(16, devices, nodes).devices_per_node == devices // nodes
    else:
        message = f"nodes={nodes!r} does not divide devices={devices}; use one of [1, 2, 4, 8]"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            check_nodes(devices, nodes)
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):  # ExpertLayout uses the same check
            ExpertLayout(16, devices, nodes)

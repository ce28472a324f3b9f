"""The small input checks every layer shares: integers, choices with a "did you mean" hint, divisibility.

Each `check_*` raises a one-line `ValueError` (or the `error` class a caller passes, a `ValueError`
subclass) naming the value and the fix; the predicates and `choice_error` let a caller word its own
message. This module imports nothing from occult_ft (layer 0), and `occult_ft.checkpoint.remote_code`
copies its body whole into the self-contained remote-code file of pruned checkpoints, so it uses the
standard library only.

    is_int(v), is_positive_int(v)        an int that is not a bool (and >= 1)
    divisors(n)                          the divisors of n, ascending
    close_match(v, choices)              the choice closest to a misspelt v, or None
    did_you_mean(v, choices)             " (did you mean 'x'?)", or "" when nothing is close
    choice_error(name, v, choices)       "name='v' is unknown (did you mean 'x'?); choose one of a, b"
    check_positive_int(name, v)          raise unless v is a positive integer
    nodes_divide(devices, nodes)         N is a positive integer dividing D
    check_nodes(devices, nodes)          raise unless nodes_divide
"""

from __future__ import annotations

import difflib
from math import isqrt
from typing import TypeGuard

__all__ = [
    "check_nodes",
    "check_positive_int",
    "choice_error",
    "close_match",
    "did_you_mean",
    "divisors",
    "is_int",
    "is_positive_int",
    "nodes_divide",
]


def is_int(value) -> TypeGuard[int]:
    """An `int` that is not a `bool` (`True` is an int to Python, never a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_int(value) -> TypeGuard[int]:
    """`is_int(value)` and value >= 1."""
    return is_int(value) and value >= 1


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending, in O(sqrt n) steps (pairs d, n // d up to sqrt n)."""
    small = [d for d in range(1, isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]  # a square's root listed once


def close_match(value, choices, cutoff: float = 0.6) -> str | None:
    """The choice closest to a misspelt `value` (difflib ratio >= cutoff, compared as text), else None."""
    found = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=cutoff)
    return found[0] if found else None


def did_you_mean(value, choices) -> str:
    """` (did you mean 'x'?)` naming the choice closest to `value`, or "" when none is close."""
    close = close_match(value, choices)
    return f" (did you mean {close!r}?)" if close is not None else ""


def choice_error(name: str, value, choices) -> ValueError:
    """`name=value is unknown (did you mean 'x'?); choose one of a, b`: the error for a value outside
    `choices`, with the closest choice as a hint when one is close."""
    hint = did_you_mean(value, choices)
    return ValueError(f"{name}={value!r} is unknown{hint}; choose one of {', '.join(map(str, choices))}")


def check_positive_int(name: str, value, example: str = "", error: type[ValueError] = ValueError) -> None:
    """Raise `error("name=value must be a positive integer[, e.g. example]")` unless `is_positive_int`."""
    if not is_positive_int(value):
        suffix = f", e.g. {example}" if example else ""
        raise error(f"{name}={value!r} must be a positive integer{suffix}")


def nodes_divide(num_devices: int, num_nodes) -> bool:
    """Whether N nodes split the D devices evenly (each node holds D / N consecutive ranks, as launchers
    number them): N a positive integer dividing the positive integer D."""
    return is_positive_int(num_nodes) and num_devices % num_nodes == 0


def check_nodes(num_devices: int, num_nodes, error: type[ValueError] = ValueError) -> None:
    """Raise `error("nodes=N does not divide devices=D; use one of [...]")` unless `nodes_divide`."""
    if not nodes_divide(num_devices, num_nodes):
        raise error(
            f"nodes={num_nodes!r} does not divide devices={num_devices}; use one of {divisors(num_devices)}"
        )

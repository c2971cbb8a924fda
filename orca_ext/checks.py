"""Argument checks shared by every public entry point, so each limit is worded one way."""
from __future__ import annotations

from typing import Iterable


def check_positive_int(name: str, value) -> int:
    """`value` must be an int >= 1 (bool is rejected: True is not a size)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def check_choice(name: str, value, choices: Iterable[str]) -> str:
    """`value` must be one of `choices`."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value

"""Counts as people read them: 1.23M, 4.56G."""
from __future__ import annotations


def fmt_count(n) -> str:
    """``n`` with a k/M/G/T/P suffix and two decimals; anything but an int (a formula) as its text."""
    if not isinstance(n, int):
        return str(n)
    for unit, div in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)

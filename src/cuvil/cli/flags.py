"""Flags several subcommands share, defined once so that they are spelled and explained the same way."""
from __future__ import annotations

from ..errors import CuvilError


def add_input_shape_flag(sp, text: str) -> None:
    sp.add_argument("--input-shape", action="append", metavar="INPUT=SHAPE", help=text)


def add_allow_bounded_flag(sp) -> None:
    sp.add_argument("--allow-bounded-rules", action="store_true",
                    help="also run 'prove exact' rules checked only on bounded instances whose ops sum (their "
                         "bits may depend on the summation order on larger shapes; off by default)")


def opt_level(text: str) -> int:
    """``O0``..``O3`` -> 0..3."""
    level = {"O0": 0, "O1": 1, "O2": 2, "O3": 3}.get(text.upper())
    if level is None:
        raise CuvilError(f"--opt-level takes O0, O1, O2 or O3, got {text!r}")
    return level

"""Registered ops the kernel layer does not lower, and why.

Both targets (x86 and PTX) schedule through :data:`cuvil.kernels.lower.LOWERINGS`, so an op without a
lowering is refused by either at scheduling time ("no x86 lowering"); this table says which ops those are,
on purpose. ``tests/test_op_registry.py`` fails for a registered op that has neither a lowering nor a row
here, and for a row whose op has a lowering after all.
"""
from __future__ import annotations

from typing import Dict


def _each(reason: str, *ops: str) -> Dict[str, str]:
    return {o: reason for o in ops}


NOT_LOWERED: Dict[str, str] = {
    **_each("not a function of its inputs: no random kernels", "RandomNormal", "RandomUniform", "RandomNormalLike",
            "RandomUniformLike", "Bernoulli", "Multinomial"),
    **_each("output shape depends on the input values", "NonZero", "Unique", "NonMaxSuppression"),
    **_each("becomes a constant on import (never scheduled)", "Constant"),
    **_each("transforms constant weights: folded at compile time", "WinogradKernel"),
    **_each("not lowered yet", "MaxRoiPool"),
}

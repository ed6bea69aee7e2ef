"""The GPU architectures the PTX target accepts, and the check that refuses any other before work starts.

Volta (sm_70) and newer: the kernels' warp shuffles are the ``.sync`` forms Volta's independent thread
scheduling needs, and the ``mma`` path needs sm_80. Every name here is one llvmlite's NVPTX backend (LLVM 22)
knows as a processor; an ``a`` suffix (sm_90a, sm_100a, ...) selects the architecture-specific feature set
and an ``f`` suffix (sm_100f, ...) the family one, both keeping the base architecture's limits.
"""
from __future__ import annotations

import difflib
import re

from ...errors import CuvilError

#: The architecture a bundle is compiled for unless told (the H100 and H200).
DEFAULT_ARCH = "sm_90"
#: Compute capabilities x 10 of the architectures the target accepts.
GPU_ARCH_NUMBERS = (70, 72, 75, 80, 86, 87, 88, 89, 90, 100, 101, 103, 110, 120, 121)
#: Every accepted spelling: sm_NN, plus sm_NNa from sm_90 and sm_NNf from sm_100.
GPU_ARCHS = tuple(f"sm_{n}{suffix}" for n in GPU_ARCH_NUMBERS
                  for suffix in ("", "a" if n >= 90 else None, "f" if n >= 100 else None) if suffix is not None)


def arch_number(arch: str) -> int:
    """The compute capability x 10 of an architecture name (``sm_90a`` -> 90; 0 for a name without digits)."""
    return int(re.sub(r"\D", "", arch) or 0)


def check_arch(arch: str, flag: str = "--arch") -> str:
    """``arch`` if the target accepts it; otherwise a CuvilError naming the nearest accepted names."""
    if arch in GPU_ARCHS:
        return arch
    m = re.fullmatch(r"(?:sm_?)?(\d+)([af]?)", str(arch).strip().lower())
    guess = f"sm_{m.group(1)}{m.group(2)}" if m else str(arch)
    if m and int(m.group(1)) < GPU_ARCH_NUMBERS[0]:
        nearest = [f"sm_{GPU_ARCH_NUMBERS[0]}"]   # older than Volta: the oldest accepted, not a look-alike
    else:
        nearest = [a for a in GPU_ARCHS if a == guess] or difflib.get_close_matches(guess, GPU_ARCHS, n=3, cutoff=0.5)
    known = ", ".join(f"sm_{n}" for n in GPU_ARCH_NUMBERS)
    raise CuvilError(f"unknown GPU architecture {arch!r} ({flag})",
                     details=[f"the GPU target accepts {known} (sm_90a, sm_100a, ...: with the 'a' suffix)"],
                     hint=f"{flag} {nearest[0]}" + (f" (or {', '.join(nearest[1:])})" if nearest[1:] else "")
                     if nearest else f"{flag} sm_90 (an H100/H200), or your GPU's compute capability x 10 as sm_NN")

"""The register-pressure pass (opt-in: ``register_pass=True``, ``cuvil compile --register-pass``): per kernel,
a register cap where registers are what keeps a multi-wave grid from fitting in fewer waves.

After the module is assembled once, ``ptxas -v`` says how many registers each kernel's threads use; with the
kernel's block size that fixes how many of its blocks an SM holds at once (:func:`occupancy`) and so how many
rounds ("waves") its grid takes on the GPU (:func:`waves`). When registers are the binding limit and an
occupancy step with fewer registers would take fewer waves, the pass gives that kernel a ``.maxnreg`` cap at
that step and ptxas re-orders and rematerialises values to stay under it. A cap is kept only if ptxas meets
it without spilling (at most :data:`MAX_SPILL` bytes of spill stores/loads/stack, 0 by default). Kernels
that fit in one wave, or where no step saves a wave, are left alone. Caps for all kernels are tried
together, one ptxas run per round, fewest waves first, backing off a step per kernel that spills
(:func:`relieve`).

Why opt-in: on an H200 (bench/gpu/RESULTS.md, "register-pressure pass"; measured with the kernels of that
time, before the implicit-GEMM convolutions) no ResNet-50 kernel qualified at batch 1; at batch 8, capping the
shared-memory tiled kernels from 56-63 to 48 registers (50% -> 62% occupancy, no spills, no wave saved) made
them 0-33% slower, and the caps that do save a wave needed 24-36 B of spills and were no faster in sum. The
convolution kernels that replaced them each fit in one wave at batch 1, so the pass caps none of them; at
batch 8 it caps 22 of them (91 -> 72 / 93 -> 64 registers, 2 waves -> 1, no spills;
``python3 bench/gpu/register_pass.py --no-gpu``), which has not been timed on a GPU. These kernels are limited by their instruction and shared-memory
throughput, not by latency that more resident warps would hide.

The decision needs the number of SMs of the GPU that will run the bundle (:data:`SMS`, by architecture:
an H100/H200 SXM has 132, an A100 108; ``sms=`` overrides it); the bundle's manifest records it with
registers, occupancy and waves before and after for every kernel the pass looked at.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence, Tuple

# per-SM limits by compute capability (CUDA C Programming Guide, "Technical Specifications per Compute
# Capability"): 64 K 32-bit registers allocated per warp in units of 256, resident warps and blocks
LIMITS = {
# and the shared memory an SM gives its blocks (the configurable carve-out's maximum, 1 KB reserved per block)
    "sm_80": {"regs_per_sm": 65536, "reg_unit": 256, "max_warps": 64, "max_blocks": 32, "max_regs": 255,
              "smem_per_sm": 167936},
    "sm_86": {"regs_per_sm": 65536, "reg_unit": 256, "max_warps": 48, "max_blocks": 16, "max_regs": 255,
              "smem_per_sm": 102400},
    "sm_89": {"regs_per_sm": 65536, "reg_unit": 256, "max_warps": 48, "max_blocks": 24, "max_regs": 255,
              "smem_per_sm": 102400},
    "sm_90": {"regs_per_sm": 65536, "reg_unit": 256, "max_warps": 64, "max_blocks": 32, "max_regs": 255,
              "smem_per_sm": 233472},
}
# SMs of the usual data-centre part of each architecture (A100; A10 / RTX 3090 class has 72-84; L40S 142;
# H100 / H200 SXM)
SMS = {"sm_80": 108, "sm_86": 84, "sm_89": 142, "sm_90": 132}
MIN_CAP = 32        # never ask ptxas for fewer registers than this per thread
MAX_SPILL = 0       # default bytes of spill stores a capped kernel may have (0: none; relieve(max_spill=...))


def limits_for(arch: str) -> dict:
    base = re.sub(r"[af]$", "", arch)   # sm_90a: sm_90's limits
    return LIMITS.get(base, LIMITS["sm_90"])


def sms_for(arch: str) -> int:
    return SMS.get(re.sub(r"[af]$", "", arch), SMS["sm_90"])


def occupancy(regs: int, block: int, limits: Optional[dict] = None, shared: int = 0) -> dict:
    """Theoretical residency of a kernel using ``regs`` registers per thread and ``shared`` bytes of static
    shared memory per block, in blocks of ``block`` threads: blocks per SM (least of the register, shared
    memory, warp and block limits), resident warps, occupancy (resident warps / the SM's maximum) and which
    limit binds."""
    limits = limits or LIMITS["sm_90"]
    warps_per_block = -(-block // 32)
    regs_per_warp = -(-max(regs, 1) * 32 // limits["reg_unit"]) * limits["reg_unit"]
    by_regs = (limits["regs_per_sm"] // regs_per_warp) // warps_per_block
    by_smem = limits["smem_per_sm"] // (shared + 1024) if shared else limits["max_blocks"]
    by_warps = limits["max_warps"] // warps_per_block
    blocks = min(by_regs, by_smem, by_warps, limits["max_blocks"])
    limiter = ("registers" if by_regs < min(by_smem, by_warps, limits["max_blocks"]) else
               "shared memory" if by_smem < min(by_warps, limits["max_blocks"]) else "threads")
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * warps_per_block,
            "occupancy": blocks * warps_per_block / limits["max_warps"], "limiter": limiter}


def waves(grid: int, blocks_per_sm: int, sms: int) -> int:
    """Rounds of blocks a grid takes when every SM holds ``blocks_per_sm``."""
    return -(-grid // max(blocks_per_sm * sms, 1))


def steps(block: int, limits: Optional[dict] = None) -> List[Tuple[int, int]]:
    """(registers per thread, blocks per SM) at each occupancy step for ``block``-thread blocks: the largest
    register count that still gives that many blocks, most blocks first."""
    limits = limits or LIMITS["sm_90"]
    out: Dict[int, int] = {}
    for r in range(limits["max_regs"], 0, -1):
        bps = occupancy(r, block, limits)["blocks_per_sm"]
        if bps and bps not in out:
            out[bps] = r                    # scanning down, the first r with this many blocks is the largest
    return sorted(((r, bps) for bps, r in out.items()), key=lambda t: -t[1])


def candidate_caps(grid: int, block: int, regs: int, sms: int, limits: Optional[dict] = None,
                   min_cap: int = MIN_CAP, shared: int = 0) -> List[int]:
    """Register caps worth trying for a kernel, in the order to try them: for each wave count below the
    kernel's own that an occupancy step reaches, the mildest cap reaching it (most registers), fewest waves
    first. Empty when registers do not limit the kernel, its grid fits in one wave, or no step at or above
    ``min_cap`` registers saves a wave."""
    limits = limits or LIMITS["sm_90"]
    occ = occupancy(regs, block, limits, shared)
    w0 = waves(grid, occ["blocks_per_sm"], sms)
    if occ["limiter"] != "registers" or w0 <= 1:
        return []
    best: Dict[int, int] = {}
    for r, bps in steps(block, limits):
        bps = occupancy(r, block, limits, shared)["blocks_per_sm"]     # shared memory may bind first
        w = waves(grid, bps, sms)
        if min_cap <= r < regs and w < w0:
            best[w] = max(best.get(w, 0), r)
    return [best[w] for w in sorted(best)]


_ENTRY = re.compile(r"(\.entry\s+(\w+)\s*\((?:[^)]*)\)\s*\n)((?:[ \t]*\.(?:maxntid|maxnreg|minnctapersm|reqntid)[^\n]*\n)*)")


def apply_caps(ptx: str, caps: Dict[str, int]) -> str:
    """``ptx`` with a ``.maxnreg N`` directive on each entry named in ``caps`` (after its parameter list),
    replacing one the kernel declares itself (ptxas keeps the last: the flash attention kernel's ``.maxnreg 255``
    would have undone the cap)."""
    seen = set()

    def put(m):
        name = m.group(2)
        if name not in caps:
            return m.group(1) + m.group(3)
        seen.add(name)
        kept = "".join(line + "\n" for line in m.group(3).splitlines() if ".maxnreg" not in line)
        return f"{m.group(1)}.maxnreg {int(caps[name])}\n{kept}"
    out = _ENTRY.sub(put, ptx)
    missing = set(caps) - seen
    if missing:
        raise ValueError(f"no .entry for {', '.join(sorted(missing))} in the PTX")
    return out


def _clean(info, max_spill: int = 0) -> bool:
    return max(info.spill_stores, info.spill_loads, info.stack_frame) <= max_spill


def relieve(ptx: str, kernels: Sequence, info: dict, arch: str, assemble, *, sms: Optional[int] = None,
            min_cap: int = MIN_CAP, max_spill: Optional[int] = None, max_rounds: int = 6):
    """Run the pass: ``kernels`` are the launch descriptions (``name``, ``grid``, ``block``), ``info`` the
    first assembly's per-kernel report (``registers``, spills), ``assemble(ptx) -> (cubin, info)``. Returns
    ``(ptx, cubin or None, info, report)``: the capped PTX, its cubin (None when no kernel was capped: the
    first assembly stands) and the report (``sms``, ``min_cap``, ``rounds``, per-kernel ``before``/``after``
    registers, blocks per SM, occupancy, waves, the ``cap`` and caps ``tried``)."""
    limits = limits_for(arch)
    sms = int(sms or sms_for(arch))
    max_spill = MAX_SPILL if max_spill is None else int(max_spill)
    pending: Dict[str, List[int]] = {}
    rows: Dict[str, dict] = {}
    for k in kernels:
        r = info.get(k.name)
        if r is None or r.registers is None or not _clean(r):
            continue
        caps = candidate_caps(k.grid, k.block, r.registers, sms, limits, min_cap, r.shared)
        if caps:
            pending[k.name] = caps
            occ = occupancy(r.registers, k.block, limits, r.shared)
            rows[k.name] = {"grid": k.grid, "block": k.block, "shared": r.shared,
                            "before": {"registers": r.registers, "blocks_per_sm": occ["blocks_per_sm"],
                                       "occupancy": occ["occupancy"],
                                       "waves": waves(k.grid, occ["blocks_per_sm"], sms)},
                            "tried": [], "cap": None}
    accepted: Dict[str, int] = {}
    rounds = 0
    cubin, final_info, last = None, info, {}
    while pending and rounds < max_rounds:
        rounds += 1
        trying = {name: caps[0] for name, caps in pending.items()}
        last = {**accepted, **trying}
        cubin, final_info = assemble(apply_caps(ptx, last))
        for name, cap in trying.items():
            rows[name]["tried"].append(cap)
            g = final_info[name]
            if g.registers is not None and g.registers <= cap and _clean(g, max_spill):
                accepted[name] = cap
                del pending[name]
            else:
                pending[name] = pending[name][1:]
                if not pending[name]:
                    del pending[name]
    kept = dict(accepted)
    if not kept:
        cubin, final_info = None, info
    elif last != kept:     # the last round also tried caps that were refused: assemble the kept ones alone
        cubin, final_info = assemble(apply_caps(ptx, kept))
    for name, row in rows.items():
        r = final_info[name]
        occ = occupancy(r.registers, row["block"], limits, row["shared"])
        row["cap"] = kept.get(name)
        row["after"] = {"registers": r.registers, "blocks_per_sm": occ["blocks_per_sm"], "occupancy": occ["occupancy"],
                        "waves": waves(row["grid"], occ["blocks_per_sm"], sms), "spill_stores": r.spill_stores}
    report = {"sms": sms, "min_cap": min_cap, "max_spill": max_spill, "rounds": rounds, "capped": len(kept), "kernels": rows}
    if not kept:
        return ptx, None, info, report
    return apply_caps(ptx, kept), cubin, final_info, report

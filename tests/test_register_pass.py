"""The GPU register-pressure pass (``cuvil.targets.ptx.regpressure``): the occupancy arithmetic it decides
with, which kernels it looks at, the ``.maxnreg`` edit, its accept / back-off loop (against a simulated
ptxas), and end to end through ptxas on a bundle (capped kernels meet their cap without spilling)."""
import os
import re

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.targets.ptx import find_ptxas
from cuvil.targets.ptx.bundle import compile_bundle, read_bundle
from cuvil.targets.ptx.ptxas import KernelInfo
from cuvil.targets.ptx.regpressure import (LIMITS, apply_caps, candidate_caps, occupancy, relieve, steps,
                                           waves)

needs_ptxas = pytest.mark.skipif(find_ptxas() is None, reason="ptxas not found (no CUDA toolkit)")
SM90 = LIMITS["sm_90"]


def test_occupancy_steps_for_256_thread_blocks():
    # 64 K registers per SM in 256-register warp units, 8 warps per block, at most 64 warps: the sm_90 table
    assert steps(256) == [(32, 8), (40, 6), (48, 5), (64, 4), (80, 3), (128, 2), (255, 1)]
    for regs, bps in steps(256):
        assert occupancy(regs, 256)["blocks_per_sm"] == bps
        if regs < 255:
            assert occupancy(regs + 1, 256)["blocks_per_sm"] < bps   # the largest count at that step
    assert occupancy(63, 256) == {"blocks_per_sm": 4, "warps_per_sm": 32, "occupancy": 0.5, "limiter": "registers"}
    assert occupancy(24, 256)["limiter"] == "threads"
    assert waves(1568, 4, 132) == 3 and waves(1568, 6, 132) == 2 and waves(100, 1, 132) == 1


def test_which_kernels_the_pass_looks_at():
    # one wave as it is: nothing to gain from more blocks per SM
    assert candidate_caps(grid=392, block=256, regs=56, sms=132) == []
    # not register-limited (threads are)
    assert candidate_caps(grid=25000, block=256, regs=30, sms=132) == []
    # 1568 blocks at 63 registers: 4 per SM, 3 waves; 48 registers (5 per SM) still 3 waves, 40 (6) two,
    # 32 (8) also two: only the mildest cap per wave count saved
    assert candidate_caps(grid=1568, block=256, regs=63, sms=132) == [40]
    assert candidate_caps(grid=784, block=256, regs=56, sms=132) == [40]
    # 5000 blocks: 10 waves at 4 per SM; 48 -> 8, 40 -> 7, 32 -> 5 waves: fewest waves first
    assert candidate_caps(grid=5000, block=256, regs=63, sms=132) == [32, 40, 48]
    assert candidate_caps(grid=5000, block=256, regs=63, sms=132, min_cap=40) == [40, 48]
    assert candidate_caps(grid=12544, block=256, regs=40, sms=132) == [32]


def test_apply_caps_edits_only_the_named_entries():
    ptx = (".visible .entry k0(\n\t.param .u64 k0_param_0,\n\t.param .u64 k0_param_1\n)\n{\n\tret;\n}\n"
           ".visible .entry k1(\n\t.param .u64 k1_param_0\n)\n.maxntid 256\n{\n\tret;\n}\n")
    out = apply_caps(ptx, {"k1": 40})
    assert out.count(".maxnreg") == 1
    assert re.search(r"\.entry k1\([^)]*\)\n\.maxnreg 40\n\.maxntid 256", out)
    assert apply_caps(ptx, {}) == ptx
    # a kernel's own .maxnreg (the flash attention kernel declares 255) is replaced, not followed by the cap (ptxas
    # keeps the last directive)
    own = ptx.replace(".maxntid 256\n", ".maxntid 256\n.maxnreg 255\n")
    out = apply_caps(own, {"k1": 40})
    assert out.count(".maxnreg") == 1 and re.search(r"\.maxnreg 40\n\.maxntid 256\n\{", out)
    assert apply_caps(own, {}) == own
    with pytest.raises(ValueError, match="k9"):
        apply_caps(ptx, {"k9": 32})


class K:
    def __init__(self, name, grid, block=256, kind="element"):
        self.name, self.grid, self.block, self.kind = name, grid, block, kind


def fake_ptxas(natural, spill_below):
    """A stand-in for ptxas: kernel k uses natural[k] registers, or its cap when lower, and spills 16 B when
    capped below spill_below[k]."""
    calls = []

    def assemble(ptx):
        caps = dict((m.group(1), int(m.group(2))) for m in re.finditer(r"\.entry (\w+)\([^)]*\)\n\.maxnreg (\d+)", ptx))
        calls.append(caps)
        info = {}
        for k, r in natural.items():
            cap = caps.get(k)
            used = min(r, cap) if cap else r
            spill = 16 if cap and cap < spill_below[k] else 0
            info[k] = KernelInfo(k, used, spill, spill, spill)
        return b"cubin", info
    return assemble, calls


def _ptx(names):
    return "".join(f".visible .entry {n}(\n\t.param .u64 {n}_p\n)\n{{\n}}\n" for n in names)


def test_relieve_accepts_the_lowest_clean_cap_and_backs_off_on_spills():
    natural = {"a": 63, "b": 56, "c": 40, "d": 64}
    spill_below = {"a": 48, "b": 40, "c": 40, "d": 0}
    kernels = [K("a", 5000), K("b", 1568), K("c", 12544), K("d", 100)]   # d: one wave, never looked at
    assemble, calls = fake_ptxas(natural, spill_below)
    info = assemble(_ptx(natural))[1]
    calls.clear()
    ptx, cubin, got, rep = relieve(_ptx(natural), kernels, info, "sm_90", assemble)
    rows = rep["kernels"]
    assert set(rows) == {"a", "b", "c"}
    assert rows["a"]["tried"] == [32, 40, 48] and rows["a"]["cap"] == 48
    assert rows["b"]["tried"] == [40] and rows["b"]["cap"] == 40
    assert rows["c"]["tried"] == [32] and rows["c"]["cap"] is None          # the one step below 40 spilled
    assert rows["a"]["before"] == {"registers": 63, "blocks_per_sm": 4, "occupancy": 0.5, "waves": 10}
    assert rows["a"]["after"]["registers"] == 48 and rows["a"]["after"]["blocks_per_sm"] == 5
    assert rows["a"]["after"]["waves"] == 8 and rows["b"]["after"]["waves"] == 2
    assert rows["c"]["after"]["registers"] == 40
    assert rep["capped"] == 2 and cubin == b"cubin"
    assert calls[-1] == {"a": 48, "b": 40}                                  # the shipped set, assembled alone
    assert ".maxnreg 48" in ptx and ".maxnreg 40" in ptx and got["c"].registers == 40
    # spills allowed: every kernel takes its most aggressive cap
    assemble2, _ = fake_ptxas(natural, spill_below)
    _, _, _, rep2 = relieve(_ptx(natural), kernels, info, "sm_90", assemble2, max_spill=16)
    assert {k: r["cap"] for k, r in rep2["kernels"].items()} == {"a": 32, "b": 40, "c": 32}


def test_relieve_without_candidates_leaves_the_module_alone():
    natural = {"a": 40}
    assemble, calls = fake_ptxas(natural, {"a": 0})
    info = assemble(_ptx(natural))[1]
    calls.clear()
    ptx, cubin, got, rep = relieve(_ptx(natural), [K("a", 100)], info, "sm_90", assemble)
    assert cubin is None and ptx == _ptx(natural) and got is info and rep["kernels"] == {} and not calls


def conv_model(n=4, c=32, k=64, hw=56):
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c, hw, hw])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, k, hw, hw])
    w = numpy_helper.from_array((rng.standard_normal((k, c, 3, 3)) * 0.1).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])]
    return helper.make_model(helper.make_graph(nodes, "conv", [x], [y], [w]), opset_imports=[helper.make_opsetid("", 17)])


@needs_ptxas
def test_bundle_caps_meet_ptxas_without_spills(tmp_path):
    """On a small GPU (8 SMs assumed) the convolution runs in several waves; whatever the pass caps, ptxas
    meets without spilling, the cubin holds it, and the manifest says so. Pass off (the default): no
    .maxnreg at all."""
    g = Pipeline.from_onnx(conv_model()).optimize().graph
    man = compile_bundle(g, str(tmp_path / "on.cuvil"), sms=8, register_pass=True)
    rp = man["register_pass"]
    assert rp["sms"] == 8 and rp["kernels"], rp
    ptx = open(tmp_path / "on.cuvil" / "kernels.ptx").read()
    regs = {k: v["registers"] for k, v in man["ptxas"]["kernels"].items()}
    for name, row in rp["kernels"].items():
        assert row["before"]["waves"] > 1 and row["before"]["registers"] > 32
        if row["cap"]:
            assert regs[name] <= row["cap"] == row["tried"][-1]
            assert row["after"]["blocks_per_sm"] > row["before"]["blocks_per_sm"]
            assert man["ptxas"]["kernels"][name]["spill_stores"] == 0
            assert re.search(rf"\.entry {name}\([^)]*\)\n\.maxnreg {row['cap']}\n", ptx)
    assert rp["capped"] == sum(1 for r in rp["kernels"].values() if r["cap"]) >= 1
    off = compile_bundle(g, str(tmp_path / "off.cuvil"), sms=8)     # the default
    assert off["register_pass"] == {"skipped": "off"}
    assert ".maxnreg" not in open(tmp_path / "off.cuvil" / "kernels.ptx").read()
    plan, _ = read_bundle(str(tmp_path / "on.cuvil"))
    assert set(rp["kernels"]) <= {k["name"] for k in plan["kernels"]}
    assert os.path.isfile(tmp_path / "on.cuvil" / man["ptxas"]["cubin"])

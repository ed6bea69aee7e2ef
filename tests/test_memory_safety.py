"""Memory safety proved at compile time (cuvil.targets.bounds): every load and store of every kernel in bounds
over the profile's symbol ranges, the certificate in the manifest, unproved kernels guarded; arenas sized
to the profile's maxima."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from cuvil import CuvilError, Pipeline
from cuvil.cli import main as cli_main
from cuvil.ir.dim import SymExpr, Symbol
from cuvil.ir.dtype import DType
from cuvil.targets.bounds import BoundsProver, prove_schedule, prove_stage
from cuvil.targets.gemm import Contraction
from cuvil.targets.schedule import Schedule, Stage, schedule
from cuvil.targets.texpr import E, Buf, cmp, const, guarded_load, load, nodes, reduce, select, var
from cuvil.targets.x86.gemm import tile_cols, tile_shapes
from cuvil.testing.models import transformer_block

F32 = DType.FLOAT
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "src", "cuvil", "data", "demo_cnn.onnx")
N = SymExpr.symbol("N")


def one_stage(buf_shape, make_expr, inputs, symbols=()):
    """A schedule of one stage writing ``out[buf_shape]`` (an output buffer) from ``make_expr(vars)``."""
    out = Buf("out", F32, tuple(buf_shape), 2 + len(inputs), 0)
    vs = [var(f"i{k}") for k in range(len(buf_shape))]
    st = Stage("k0", out, vs, make_expr(vs))
    return Schedule([st], list(inputs), [out], [], 0, 0, {}, list(symbols)), st


def x_buf(shape, base=2):
    return Buf("x", F32, tuple(shape), base, 0)


def test_in_bounds_copy_is_proved_and_off_by_one_is_refuted_with_a_counterexample():
    x = x_buf((8,))
    good, _ = one_stage((8,), lambda i: load(x, [i[0]]), [x])
    assert prove_schedule(good).proved == 1
    bad, st = one_stage((8,), lambda i: load(x, [i[0] + 1]), [x])
    count, failed = prove_stage(BoundsProver(), bad, st)
    assert count == 2 and len(failed) == 1
    assert "index (8)" in failed[0][1] and "out of bounds" in failed[0][1]


def test_symbolic_shapes_with_division_and_modulo():
    """out[N, 4] read through a flat view x[4N]: (4*i0 + i1) // 4 and % 4 style indices over N in [1, 4096]."""
    n = Symbol("N", 1, 4096)
    x = x_buf((N * 4,))
    ok, _ = one_stage((N, 4), lambda i: load(x, [i[0] * 4 + i[1]]), [x], [n])
    assert prove_schedule(ok).proved == 1
    y = x_buf((N, 4))
    flat = lambda i: i[0] * 4 + i[1]          # noqa: E731
    ok2, _ = one_stage((N, 4), lambda i: load(y, [flat(i) // 4, flat(i) % 4]), [y], [n])
    assert prove_schedule(ok2).proved == 1
    bad, _ = one_stage((N, 4), lambda i: load(x, [i[0] * 4 + i[1] + 4]), [x], [n])
    cert = prove_schedule(bad, guard=False)
    assert cert.proved == 0 and cert.kernels[0].status == "unproved"
    assert "N=" in cert.kernels[0].failures[0]


def test_a_select_does_not_protect_its_arms_but_a_guarded_load_does():
    """Both arms of a select are evaluated (LLVM select is not a branch); a gload reads only where its
    guard holds."""
    x = x_buf((8,))
    shifted = lambda i: i[0] - 1             # noqa: E731
    inside = lambda i: cmp("ge", shifted(i), const(0, DType.INT64))   # noqa: E731
    sel, _ = one_stage((8,), lambda i: select(inside(i), load(x, [shifted(i)]), const(0.0, F32)), [x])
    assert prove_schedule(sel, guard=False).proved == 0
    gl, _ = one_stage((8,), lambda i: guarded_load(x, [shifted(i)], inside(i), 0.0), [x])
    assert prove_schedule(gl).proved == 1


def test_reduction_variables_are_bounded_by_their_extents():
    x = x_buf((4, 6))
    ok, _ = one_stage((4,), lambda i: reduce("sum", [6], lambda r: load(x, [i[0], r])), [x])
    assert prove_schedule(ok).proved == 1
    bad, _ = one_stage((4,), lambda i: reduce("sum", [7], lambda r: load(x, [i[0], r])), [x])
    assert prove_schedule(bad, guard=False).proved == 0


def test_guards_clamp_the_unproved_loads_and_the_kernel_is_listed():
    x = x_buf((8,))
    bad, st = one_stage((8,), lambda i: load(x, [i[0] + 1]), [x])
    cert = prove_schedule(bad)
    assert cert.kernels[0].status == "guarded" and cert.kernels[0].failures
    assert cert.to_json()["guarded"][0]["stage"] == "k0"
    assert st.expr.op == "load" and st.expr.args[0].op == "clamp"
    assert prove_stage(BoundsProver(), bad, st)[1] == []


def conv_contraction(out_spatial, x_shape):
    """A 3x3 convolution's contraction of one channel over the stored (padded) input ``x``."""
    a = Buf("a", F32, (1, 1, 9, 6), 1, 0)
    x = x_buf(x_shape)
    spec = Contraction(a, x, 1, 1, 1, 1, (3, 3), (1, 1), (1, 1), tuple(out_spatial), cols=8)

    def expr(i):
        plain = reduce("sum", [9], lambda k: load(a, [0, 0, k, 0]))
        return E("contract", list(i) + [plain], F32, spec)
    sched, st = one_stage((1, 1) + tuple(out_spatial), expr, [x])
    sched.weights_bytes = 9 * 6 * 4
    return sched, st


def test_micro_kernel_family_access_patterns_are_proved():
    """A contraction's im2col reads (3x3 windows over a 6x6 input) are stated as index expressions: a 4x4
    output is inside, a 5x4 one (an output row too many for the input) is refuted and the stage guarded by
    falling back to its plain expression."""
    ok, _ = conv_contraction((4, 4), (1, 1, 6, 6))
    assert prove_schedule(ok).proved == 1
    bad, st = conv_contraction((5, 4), (1, 1, 6, 6))
    cert = prove_schedule(bad)
    assert cert.kernels[0].status == "guarded"
    assert any("family:contract x[1, 1, 6, 6]" in f for f in cert.kernels[0].failures)
    assert st.expr.op == "reduce"       # the micro-kernel node is gone: the generic loop runs it


def test_family_patterns_of_a_real_schedule_catch_a_widened_output():
    """On the demo CNN's real kernels (GEMM contractions, row-kernel windows, padded copies), each family's
    stated pattern is proved as scheduled and refuted once its output is one position wider than the
    buffers it reads and writes; a padded copy's interior read one row further down is refuted too."""
    p = Pipeline.from_onnx(DEMO).optimize().specialize({"N": 2}).choose_algorithms("x86_64-linux-gnu", None)
    sched = schedule(p.graph, gemm_cols=tile_cols(512), split_concat=True, gemm_tiles=tile_shapes(512),
                     row_kernels=True)
    prover = BoundsProver()
    seen = set()
    for st in sched.stages:
        for x in nodes(st.expr):
            if x.op not in ("contract", "window", "padwin") or x.op in seen:
                continue
            seen.add(x.op)
            assert prove_stage(prover, sched, st)[1] == []
            spec = x.attr
            if x.op == "padwin":
                old = spec.begin
                spec.begin = old[:-2] + (old[-2] - 1,) + old[-1:]
            else:
                old = spec.out_spatial
                spec.out_spatial = old[:-1] + (old[-1] + 1,)
            failed = prove_stage(prover, sched, st)[1]
            assert any(a.kind == f"family:{x.op}" for a, _ in failed), x.op
            if x.op == "padwin":
                spec.begin = old
            else:
                spec.out_spatial = old
    assert seen == {"contract", "window", "padwin"}


def test_view_larger_than_its_storage_is_refuted():
    root = Buf("t", F32, (16,), 0, 0)
    view = Buf("v", F32, (4, 5), 0, 0, root=root)
    sched, _ = one_stage((4, 5), lambda i: load(view, list(i)), [])
    sched.arena_bytes = 64
    cert = prove_schedule(sched, guard=False)
    assert cert.proved == 0 and "may exceed" in cert.kernels[0].failures[0]


def test_proofs_are_cached_by_structure():
    """Symbolic shapes go to Z3 (static ones are mostly settled by interval arithmetic); a second kernel of
    the same structure, with other variables, is answered from the cache."""
    n = Symbol("N", 1, 64)
    x = x_buf((N, N))
    prover = BoundsProver()
    a, _ = one_stage((N, N), lambda i: load(x, [i[1], i[0]]), [x], [n])
    b, _ = one_stage((N, N), lambda i: load(x, [i[1], i[0]]), [x], [n])
    prove_schedule(a, prover=prover)
    queries = prover.queries
    assert queries >= 1
    cert = prove_schedule(b, prover=prover)
    assert cert.proved == 1 and prover.queries == queries and cert.cache_hits >= 2


def test_interval_shortcut_is_sound():
    """Static shapes: in-bounds accesses proved without Z3; an out-of-bounds one still reaches Z3 and fails."""
    x = x_buf((8, 8))
    prover = BoundsProver()
    ok, _ = one_stage((8, 8), lambda i: load(x, [i[1], (i[0] * 8 + i[1]) % 8]), [x])
    assert prove_schedule(ok, prover=prover).proved == 1 and prover.queries == 0
    bad, _ = one_stage((8, 8), lambda i: load(x, [i[1], (i[0] * 8 + i[1]) // 7]), [x])
    assert prove_schedule(bad, prover=prover, guard=False).proved == 0 and prover.queries > 0


# -- compiled libraries ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo():
    return Pipeline.from_onnx(DEMO).optimize()


def _cleanup(art):
    shutil.rmtree(os.path.dirname(art.path), ignore_errors=True)


def test_manifest_carries_the_certificate(demo):
    art = demo.compile(shape_profiles={"N": (1, 2, 4)}, cache=False)
    try:
        ms = art.manifest["memory_safety"]
        assert len(ms["per_kernel"]) == ms["kernels"]
        assert sum(k["variant"] == "generic" for k in ms["per_kernel"]) == art.manifest["kernels"]
        assert ms["kernels_proved"] == ms["kernels"] and ms["guarded"] == []
        assert {k["variant"] for k in ms["per_kernel"]} == {"generic", "opt"}
        assert ms["accesses"] > ms["kernels"] and ms["summary"].startswith(f"{ms['kernels']}/{ms['kernels']}")
        with open(os.path.splitext(art.path)[0] + ".manifest.json") as f:
            assert json.load(f)["memory_safety"] == ms
    finally:
        _cleanup(art)


class _Refusing(BoundsProver):
    """A prover that refuses the first access of each kind in ``kinds`` (one load, one micro-kernel family
    access), to drive the guards through the code generator."""

    kinds = ("load", "family:contract")

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.refused = set()

    def check(self, acc, ranges):
        if acc.kind in self.kinds and acc.kind not in self.refused and acc.node is not None:
            self.refused.add(acc.kind)
            self.cache.clear()
            return f"{acc.kind} refused by the test"
        return super().check(acc, ranges)


def test_guarded_kernels_compile_run_correctly_and_are_listed(demo, monkeypatch):
    """Clamping an index that is in bounds changes nothing, and a micro-kernel stage falling back to its
    plain expression computes the same: the guarded library agrees with the proved one."""
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    want = demo.compile(fixed={"N": 2}, cache=False)
    monkeypatch.setattr("cuvil.targets.x86.compile.BoundsProver", _Refusing)
    got = demo.compile(fixed={"N": 2}, cache=False)
    try:
        ms = got.manifest["memory_safety"]
        assert len(ms["guarded"]) == 2 and ms["kernels_proved"] == ms["kernels"] - 2
        assert all(g["status"] == "guarded" and "refused by the test" in g["unproved"][0] for g in ms["guarded"])
        (a,), (b,) = want.run({"image": x}).values(), got.run({"image": x}).values()
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    finally:
        _cleanup(want)
        _cleanup(got)


def test_cli_compile_reports_the_certificate(tmp_path, capsys):
    so = tmp_path / "libms.so"
    assert cli_main(["compile", "--input", DEMO, "--output", str(so), "--fix", "N=1", "--opt-level", "O1"]) == 0
    assert re.search(r"memory safety: (\d+)/\1 kernels proved in bounds \(\d+ accesses", capsys.readouterr().out)


def test_unbounded_transformer_arena_is_refused_with_a_clear_error():
    """Without a profile B and S range over [1, 4096]: the attention scores alone would need terabytes."""
    p = Pipeline.from_onnx(transformer_block(d_model=32, heads=4, d_ff=64, seed=0)).optimize()
    with pytest.raises(CuvilError, match=r"arena at the shape profile's maxima \(B <= 4096, S <= 4096\) is "
                                         r"[0-9.]+ TB.*--shape-profile"):
        p.compile(cache=False)


SESSION_UNDER_ULIMIT = r"""
import ctypes, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
lib = ctypes.CDLL(sys.argv[1])
lib.cuvil_session_create.restype = ctypes.c_void_p
s = lib.cuvil_session_create(1)
print("session" if s else "NULL")
"""


def test_transformer_session_fits_under_a_few_gigabytes_of_address_space():
    p = Pipeline.from_onnx(transformer_block(d_model=32, heads=4, d_ff=64, seed=0)).optimize()
    art = p.compile(shape_profiles={"B": (1, 2, 8), "S": (1, 16, 512)}, cache=False, opt_kernels=False)
    try:
        assert art.manifest["arena_bytes"] < 1 << 30
        assert art.manifest["memory_safety"]["kernels_proved"] == art.manifest["memory_safety"]["kernels"]
        out = subprocess.run([sys.executable, "-c", SESSION_UNDER_ULIMIT, art.path], capture_output=True,
                             text=True, timeout=60)
        assert out.stdout.strip() == "session", out.stderr
    finally:
        _cleanup(art)


def test_max_arena_is_configurable(monkeypatch, demo):
    monkeypatch.setenv("CUVIL_MAX_ARENA_BYTES", "1024")
    with pytest.raises(CuvilError, match="above the 1.0 KB limit"):
        demo.compile(shape_profiles={"N": (1, 2, 4)}, cache=False)
    monkeypatch.setenv("CUVIL_MAX_ARENA_BYTES", "lots")
    with pytest.raises(CuvilError, match="not a number of bytes"):
        demo.compile(shape_profiles={"N": (1, 2, 4)}, cache=False)


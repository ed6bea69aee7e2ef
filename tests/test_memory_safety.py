"""Memory safety proved at compile time (cuvil.kernels.bounds): every load and store of every kernel in bounds
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
from cuvil.kernels.bounds import BoundsProver, prove_schedule, prove_stage
from cuvil.kernels.contraction import Contraction
from cuvil.kernels.schedule import Schedule, Stage, schedule
from cuvil.kernels.texpr import E, Buf, cmp, const, guarded_load, load, nodes, reduce, select, var
from cuvil.targets.x86.gemm import tile_cols, tile_shapes
from cuvil.targets.x86.tuning import DEFAULT_TUNING
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
                     row_kernels=True, channel_tile_cost=DEFAULT_TUNING.channel_tile_cost)
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
    with pytest.raises(CuvilError, match=r"(?s)arena at the shape profile's maxima \(B <= 4096, S <= 4096\) is "
                                         r"[0-9.]+ TB.*next: give a shape profile .*--shape-profile"):
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



# -- counter-cases of the soundness review: each was "proved" while the generated code read or wrote outside
# its buffer ----------------------------------------------------------------------------------------------

def _conv_model(tmp_path, pads):
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    w = np.random.default_rng(0).standard_normal((8, 4, 3, 3)).astype(np.float32)
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=pads)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "w")])
    path = str(tmp_path / "conv.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path, w


def test_padded_copy_with_a_negative_begin_pad_is_guarded_not_proved(tmp_path):
    """Conv pads [-1, -1, 0, 0] (a crop) make a padded copy with begin (-1, -1): x86/pad.py runs its interior
    over rows and columns [-1, 7) of a 7x7 buffer, storing before each row and before the buffer. The padwin
    pattern used to be stated over the stage's own loop variables (always inside the buffer) and was proved;
    it is now stated over the interior's loops and refuted, and the stage runs its plain expression."""
    path, w = _conv_model(tmp_path, [-1, -1, 0, 0])
    p = Pipeline.from_onnx(path).optimize().choose_algorithms("x86_64-linux-gnu", None)
    sched = schedule(p.graph, gemm_cols=tile_cols(512), split_concat=True, gemm_tiles=tile_shapes(512),
                     row_kernels=True, channel_tile_cost=DEFAULT_TUNING.channel_tile_cost)
    (st,) = [s for s in sched.stages if s.expr.op == "padwin"]
    cert = prove_schedule(sched)
    (k,) = cert.guarded
    assert k.stage == st.name and k.status == "guarded"
    assert "family:padwin" in k.failures[0] and "-1" in k.failures[0]
    assert st.expr.op != "padwin"         # the row-run emitter is not used; the generic loop nest is
    art = Pipeline.from_onnx(path).optimize().compile(cache=False)
    try:
        assert [g["stage"] for g in art.manifest["memory_safety"]["guarded"]] == [st.name]
        x = np.random.default_rng(1).standard_normal((1, 4, 8, 8)).astype(np.float32)
        (y,) = art.run({"x": x}).values()
        crop = x[:, :, 1:, 1:]
        want = np.zeros((1, 8, 5, 5), np.float32)
        for i in range(5):
            for j in range(5):
                want[:, :, i, j] = np.einsum("nchw,mchw->nm", crop[:, :, i:i + 3, j:j + 3], w)
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
    finally:
        _cleanup(art)


def test_padded_copy_pattern_still_proved_for_ordinary_pads(tmp_path):
    path, _ = _conv_model(tmp_path, [1, 2, 1, 0])
    p = Pipeline.from_onnx(path).optimize().choose_algorithms("x86_64-linux-gnu", None)
    sched = schedule(p.graph, gemm_cols=tile_cols(512), split_concat=True, gemm_tiles=tile_shapes(512),
                     row_kernels=True, channel_tile_cost=DEFAULT_TUNING.channel_tile_cost)
    assert any(s.expr.op == "padwin" for s in sched.stages)
    assert prove_schedule(sched, guard=False).guarded == []


def test_arg_scan_reads_element_0_even_over_an_empty_axis():
    """An arg-max's scan reads element 0 before its loop over [1, n): over an axis that may be empty (a symbol
    whose minimum is 0) that read is outside the buffer. Its loop variable's domain [0, n) is then empty, so
    the read was proved vacuously; it is now an access of its own, refuted at S = 0, and as no clamp makes
    an empty buffer readable the kernel stays unproved."""
    s = Symbol("S", 0, 8)
    x = x_buf((4, SymExpr.symbol("S")))
    scan = lambda i: E("argscan", (), DType.INT64,        # noqa: E731
                       (lambda idx: load(x, idx), [i[0], const(0, DType.INT64)], 1, SymExpr.symbol("S"), "gt", False))
    sched, _ = one_stage((4,), scan, [x], [s])
    cert = prove_schedule(sched)
    assert cert.kernels[0].status == "unproved" and "S=0" in cert.kernels[0].failures[0]
    nonempty, _ = one_stage((4,), scan, [x], [Symbol("S", 1, 8)])
    assert prove_schedule(nonempty).proved == 1


class _Unprovable(BoundsProver):
    """Refuses every access of the first load it meets, its guarded form included: a kernel that stays
    unproved."""

    def check(self, acc, ranges):
        if acc.kind == "load" and acc.buf.name == "image":
            return "refused by the test"
        return super().check(acc, ranges)


def test_a_kernel_left_unproved_by_its_guards_is_refused(demo, monkeypatch):
    """Such a kernel used to be compiled anyway (only the manifest said so)."""
    monkeypatch.setattr("cuvil.targets.x86.compile.BoundsProver", _Unprovable)
    with pytest.raises(CuvilError, match=r"(?s)not proved memory-safe even with run-time guards\n  refused by the "
                                         r"test.*--shape-profile"):
        demo.compile(fixed={"N": 1}, cache=False)


def test_a_possibly_empty_reduction_elsewhere_in_the_stage_proves_nothing_vacuously():
    """Every access used to be bounded by the domains of every loop of its stage: a reduction over an extent
    that may be 0 (here a constant 0; any symbolic extent at 0 likewise) made each query of the stage
    unsatisfiable, so an off-by-one load beside it was "proved"."""
    x = x_buf((8,))
    bad, _ = one_stage((8,), lambda i: E("add", (load(x, [i[0] + 1]),
                                                 reduce("sum", [0], lambda r: load(x, [r]))), F32), [x])
    cert = prove_schedule(bad, guard=False)
    assert cert.proved == 0 and "index (8)" in cert.kernels[0].failures[0]
    n = Symbol("N", 0, 8)
    sym_bad, _ = one_stage((8,), lambda i: E("add", (load(x, [i[0] + 1]), reduce(
        "sum", [SymExpr.symbol("N")], lambda r: load(x, [r * 0]))), F32), [x], [n])
    assert prove_schedule(sym_bad, guard=False).proved == 0


def test_the_cache_does_not_answer_an_access_with_a_vacuous_proof_of_another():
    """The cache key names the domains of the variables an access reads; the query used to bound every loop
    of the stage, so x[0] inside a reduction over a possibly empty extent was proved (vacuously at N = 0) and
    the same key then answered x[0] outside any loop, which runs at N = 0 too. Now neither is proved."""
    n = Symbol("N", 0, 8)
    x = x_buf((SymExpr.symbol("N"),))
    zero = const(0, DType.INT64)
    prover = BoundsProver()
    inside, _ = one_stage((4,), lambda i: reduce("sum", [SymExpr.symbol("N")], lambda r: load(x, [zero])), [x], [n])
    prove_schedule(inside, prover=prover, guard=False)
    outside, _ = one_stage((4,), lambda i: load(x, [zero]), [x], [n])
    assert prove_schedule(outside, prover=prover, guard=False).proved == 0


def test_an_obligation_with_fewer_indices_than_dims_is_not_proved():
    """A stated pattern written for a buffer of another rank: zip() checked only the leading dims."""
    from cuvil.kernels.bounds import Access
    x = x_buf((2, 3, 4))
    i = var("i")
    acc = Access("family:test", x, [i], [], {i.attr: (0, 2)})
    assert BoundsProver().check(acc, {}) is not None


def test_a_micro_kernel_storing_past_its_stage_region_is_not_proved():
    """The GEMM and row kernels store their whole output, whatever the stage's region (a piece of a split
    concatenation); the epilogue's loads are proved over the region only. A region narrower than the
    contraction's output was proved (the stores were checked against the whole buffer)."""
    ok, st = conv_contraction((4, 4), (1, 1, 6, 6))
    st.region = (3, 0, 4)
    assert prove_schedule(ok, guard=False).proved == 1
    bad, st = conv_contraction((4, 4), (1, 1, 6, 6))
    st.region = (3, 0, 2)
    cert = prove_schedule(bad, guard=False)
    assert cert.proved == 0 and "region 0:2" in cert.kernels[0].failures[0]


def test_an_arg_scan_over_an_empty_axis_yields_0_not_nothing():
    """The scan's result was taken in [0, n): over an axis that may be empty that range is empty, and an
    access indexed by it was proved vacuously (here z[S][argmax], out of bounds at S = 0). The kernel
    returns 0 there."""
    from cuvil.kernels.bounds import stage_accesses
    s = Symbol("S", 0, 8)
    x = x_buf((4, SymExpr.symbol("S")))
    z = Buf("z", F32, (SymExpr.symbol("S"),), 3, 0)
    scan = E("argscan", (), DType.INT64, (lambda idx: load(x, idx), [const(1, DType.INT64), const(0, DType.INT64)],
                                          1, SymExpr.symbol("S"), "gt", False))
    sched, st = one_stage((4,), lambda i: load(z, [scan]), [x, z], [s])
    (acc,) = [a for a in stage_accesses(st) if a.buf is z]
    assert BoundsProver().check(acc, sched.ranges) is not None


def _argmax_of_slice(tmp_path):
    """ArgMax over x[S, S][:, 2:], an axis of max(S - 2, 0) elements."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    inits = [numpy_helper.from_array(np.array([v], np.int64), k) for k, v in (("st", 2), ("en", 1 << 40), ("ax", 1))]
    g = helper.make_graph([helper.make_node("Slice", ["x", "st", "en", "ax"], ["s"]),
                           helper.make_node("ArgMax", ["s"], ["y"], axis=1, keepdims=0)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["S", "S"])],
                          [helper.make_tensor_value_info("y", TensorProto.INT64, None)], inits)
    path = str(tmp_path / "argmax.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_arg_max_over_a_slice_that_may_be_empty_is_refused(tmp_path):
    """At S <= 2 the sliced axis is empty and the scan's read of its element 0 is x[i, min(2, S)], outside x
    (the Slice of a symbolic dim used to stop the compile with a TypeError; past it, that read was proved
    vacuously). The compile is refused, naming the access and the next step; with S >= 3 it is proved and
    agrees with numpy."""
    path = _argmax_of_slice(tmp_path)
    p = Pipeline.from_onnx(path).optimize()
    with pytest.raises(CuvilError, match=r"(?s)kernel y \(generic\) is not proved memory-safe even with run-time "
                                         r"guards\n  load x.* out of bounds at .*sym!S=[12]\b.*--shape-profile"):
        p.compile(shape_profiles={"S": (1, 4, 8)}, cache=False, opt_kernels=False)
    art = p.compile(shape_profiles={"S": (3, 4, 8)}, cache=False, opt_kernels=False)
    try:
        assert art.manifest["memory_safety"]["guarded"] == []
        x = np.random.default_rng(2).standard_normal((5, 5)).astype(np.float32)
        (y,) = art.run({"x": x}).values()
        np.testing.assert_array_equal(y, np.argmax(x[:, 2:], axis=1))
    finally:
        _cleanup(art)


def _max_alloca(path):
    """The largest stack array (elements) of the x86 kernels of the ONNX model at ``path``."""
    from cuvil.targets.x86.codegen import KernelModule, host_target
    p = Pipeline.from_onnx(path).optimize().choose_algorithms("x86_64-linux-gnu", None)
    sched = schedule(p.graph, gemm_cols=tile_cols(512), split_concat=True, gemm_tiles=tile_shapes(512),
                     row_kernels=True, channel_tile_cost=DEFAULT_TUNING.channel_tile_cost)
    tm, triple, _ = host_target(None)
    km = KernelModule("t", tm, triple)
    km.vector_bits = 512
    km.scratch_index, km.dims_index = 2 + len(sched.inputs) + len(sched.outputs), None
    for k, st in enumerate(sched.stages):
        km.add_stage(st, f"t_kernel{k}")
    sizes = [int(n) * int(lanes or 1) for lanes, n in
             re.findall(r"= alloca (?:<(\d+) x [^>]+>|[^,<]+), i64 (\d+)", str(km.module))]
    return max([1] + sizes)


def test_stack_rows_stay_small_however_wide_the_row(tmp_path):
    """Stack arrays are outside the buffers the proof covers: a row reduction's row was sized by a static last
    dim however wide (a 4M-wide MatMul of two inputs: a 16 MB alloca, a segfault), and so was a depthwise
    row kernel's output row. Rows wider than ROW_MAX take the loop nest."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from cuvil.targets.x86.codegen import ROW_MAX
    width = 4 * ROW_MAX
    mm = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "g",
                           [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 4]),
                            helper.make_tensor_value_info("b", TensorProto.FLOAT, [4, width])],
                           [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    w = numpy_helper.from_array(np.ones((2, 1, 3, 3), np.float32), "w")
    dw = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], group=2)], "g",
                           [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, width])],
                           [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    for k, g in enumerate((mm, dw)):
        path = str(tmp_path / f"m{k}.onnx")
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
        assert _max_alloca(path) <= ROW_MAX, k


def test_a_clamp_into_an_empty_dim_is_modelled_as_the_code_computes_it():
    """clamp(i, 0, d - 1) with d = 0 is -1 for every i in the generated code (lower bound first, then the
    upper); Z3 gave 0 for i < 0, so z[clamp(i - 1, 0, N - 1)] with a separate buffer z[1] was proved at
    N = 0 for i = 0, where the code reads z[-1]."""
    from cuvil.kernels.bounds import Access
    n = Symbol("N", 0, 8)
    z = Buf("z", F32, (1,), 2, 0)
    i = var("i")
    idx = E("clamp", (i - 1,), DType.INT64, (0, SymExpr.symbol("N") - 1))
    acc = Access("load", z, [idx], [], {i.attr: (0, 1)})
    assert BoundsProver().check(acc, {"N": (n.min, n.max)}) is not None


def test_int32_arithmetic_wraps_in_the_proof_as_in_the_code():
    """An index computed in int32 (a tensor's arithmetic, then widened) wraps where it overflows:
    t[int64(v + 1) - int64(v)] with v a loaded int32 is t[1], except at v = 2^31 - 1 where v + 1 wraps and
    the code reads t[-2^32]. Over mathematical integers it was always t[1], and proved."""
    from cuvil.kernels.bounds import Access
    from cuvil.kernels.texpr import binop, cast
    t = Buf("t", F32, (2,), 2, 0)
    idx_buf = Buf("ix", DType.INT32, (1,), 3, 0)
    v = load(idx_buf, [const(0, DType.INT64)])
    one = const(1, DType.INT32)
    idx = cast(binop("add", v, one), DType.INT64) - cast(v, DType.INT64)
    acc = Access("load", t, [idx], [], {})
    assert BoundsProver().check(acc, {}) is not None

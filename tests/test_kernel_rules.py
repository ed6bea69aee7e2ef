"""Kernel-level rules (``on kernel``): the matcher over texpr E trees, bottom-up rewriting with counts,
reductions contracted into fused multiply-accumulates, the verdict gate (exact always, real only with fma),
the PTX it produces (``fma.rn``), no calls left in light models' PTX, and the bundle manifest's record."""
import os
import re

import attrs
import pytest

from cuvil import Pipeline
from cuvil.dsl.errors import RuleError
from cuvil.dsl.parser import parse_rules
from cuvil.ir.dtype import DType
from cuvil.rewrite_rules.prove import RuleRejectedError
from cuvil.kernels.kernel_rules import (KernelRewriter, builtin_kernel_rules, compile_kernel_rule, nan_max,
                                        same, select_kernel_rules)
from cuvil.targets.ptx import assemble, find_libdevice, find_ptxas
from cuvil.targets.ptx.bundle import read_bundle
from cuvil.targets.ptx.codegen import build_ptx
from cuvil.kernels.schedule import Schedule, Stage
from cuvil.kernels.texpr import E, Buf, binop, call, cmp, const, load, reduce, select, unop, var
from cuvil.testing import light_model, small_cnn

F32, F16, I64 = DType.FLOAT, DType.FLOAT16, DType.INT64
PTXAS = find_ptxas()
needs_ptxas = pytest.mark.skipif(PTXAS is None, reason="ptxas not found (no CUDA toolkit)")
needs_libdevice = pytest.mark.skipif(find_libdevice() is None, reason="libdevice.10.bc not found")
# the built-in kernel rules as they run: proved, with the ops whose operands the matcher may swap
BUILTIN = {r.name: r for r in select_kernel_rules(fma=True)}


def rule(text):
    (r,) = parse_rules(text, "t.rule")
    return r


def leaves(dt=F32):
    x = Buf("x", dt, (8,), base=2)
    i = var("i")
    return [load(x, [i + k]) for k in range(4)]


# --- the matcher ---------------------------------------------------------------------------------------------

def test_fma_contraction_matches_and_builds():
    a, b, c, _ = leaves()
    k = compile_kernel_rule(BUILTIN["fma_contract"])
    e = binop("add", binop("mul", a, b), c)
    assert k.match(e) == {"a": a, "b": b, "c": c}
    out = k.apply(e)
    assert out.op == "fma" and out.args == (a, b, c) and out.dtype == F32
    # the commuted form c + a * b: the same rule, Add's operands taken the other way round (commutativity of
    # addition over the reals is proved before the matcher may do so)
    assert BUILTIN["fma_contract"].commutative == {"Add", "Mul"}
    commuted = k.apply(binop("add", c, binop("mul", a, b)))
    assert commuted.op == "fma" and commuted.args == (a, b, c)
    # as written, without the proved facts, the rule does not take the swapped order
    plain = compile_kernel_rule(attrs.evolve(BUILTIN["fma_contract"], commutative=frozenset()))
    assert plain.apply(binop("add", c, binop("mul", a, b))) is None


def test_only_add_and_mul_operands_are_swapped():
    """Max/Min are not commutative bit for bit (ties of +0/-0, which NaN): only Add and Mul operands swap."""
    assert all(r.commutative <= {"Add", "Mul"} for r in BUILTIN.values())
    a, b, c, _ = leaves()
    k = compile_kernel_rule(BUILTIN["kernel_mul_one"])   # x * 1, and 1 * x
    assert k.apply(binop("mul", a, const(1.0, F32))) is a and k.apply(binop("mul", const(1.0, F32), a)) is a


def test_index_arithmetic_is_never_rewritten():
    i, j = var("i"), var("j")
    e = E("add", (E("mul", (i, j), I64), const(3, I64)), I64)   # integer a*b+c: not a float expression
    rw = KernelRewriter([BUILTIN["fma_contract"]])
    assert rw.rewrite(e) is e and rw.counts["fma_contract"] == 0


def test_repeated_names_match_structurally_equal_subtrees():
    a, b, _, _ = leaves()
    r = compile_kernel_rule(rule("rule sq on kernel\n  Mul(x, x) => Mul(x, x)\n  prove exact\n"))
    x = Buf("x", F32, (8,), base=2)
    i = var("i")
    assert r.match(binop("mul", load(x, [i]), load(x, [i]))) is not None   # equal structure, distinct objects
    assert r.match(binop("mul", a, b)) is None


def test_literals_match_bit_for_bit():
    a, *_ = leaves()
    k = compile_kernel_rule(BUILTIN["kernel_mul_one"])
    assert k.apply(binop("mul", a, const(1.0, F32))) is a
    assert k.apply(binop("mul", a, const(1.0000001, F32))) is None
    z = compile_kernel_rule(rule("rule r on kernel\n  Add(x, -0.0) => x\n  prove exact\n"))
    assert z.apply(binop("add", a, const(0.0, F32))) is None          # +0.0 is not -0.0
    assert z.apply(binop("add", a, const(-0.0, F32))) is a


def test_max_min_relu_forms():
    a, b, *_ = leaves()
    k = compile_kernel_rule(BUILTIN["kernel_relu_relu"])
    inner = nan_max(a, const(0.0, F32))
    out = k.apply(nan_max(inner, const(0.0, F32)))
    assert out is not None and same(out, inner)
    mx = compile_kernel_rule(rule("rule m on kernel\n  Max(x, y) => Max(y, x)\n  prove real\n"))
    assert mx.match(nan_max(a, b)) == {"x": a, "y": b}
    assert mx.match(select(cmp("gt", a, b), a, b)) is None           # not np.maximum's NaN form
    mn = compile_kernel_rule(rule("rule m on kernel\n  Min(x, y) => Min(y, x)\n  prove real\n"))
    assert mn.match(nan_max(a, b)) is None


def test_unary_calls_and_neg():
    a, b, *_ = leaves()
    k = compile_kernel_rule(BUILTIN["kernel_add_neg"])
    out = k.apply(binop("add", a, unop("neg", b)))
    assert out.op == "sub" and out.args == (a, b)
    s = compile_kernel_rule(rule("rule r on kernel\n  Sqrt(Mul(x, x)) => Abs(x)\n  prove real\n"))
    out = s.apply(call("sqrt", binop("mul", a, a)))
    assert out.op == "call" and out.attr == "fabs" and out.args == (a,)


def test_rules_without_a_kernel_form_are_rejected():
    with pytest.raises(RuleError, match="Conv has no kernel form"):
        compile_kernel_rule(rule("rule r on kernel\n  Conv(x, w) => Conv(x, w)\n  prove exact\n"))
    with pytest.raises(RuleError, match="guards"):
        compile_kernel_rule(rule("rule r on kernel\n  Mul(x, y) when const(y) => Mul(y, x)\n  prove exact\n"))
    with pytest.raises(RuleError, match="attributes"):
        compile_kernel_rule(rule("rule r on kernel\n  LeakyRelu(x, alpha=a) => x\n  prove real\n"))


# --- rewriting: bottom-up, shared subtrees once, counts ------------------------------------------------------

def test_bottom_up_rewrite_and_counts():
    a, b, c, d = leaves()
    shared = binop("add", binop("mul", a, b), c)              # used twice below: rewritten once
    e = binop("add", binop("mul", shared, d), unop("neg", unop("neg", shared)))
    rw = KernelRewriter([BUILTIN[n] for n in ("fma_contract", "kernel_neg_neg")])
    out = rw.rewrite(e)
    # neg(neg(s)) -> s; then (s' * d) + s' -> fma(s', d, s') with s' = fma(a, b, c)
    assert out.op == "fma"
    s2 = out.args[0]
    assert s2.op == "fma" and s2.args == (a, b, c) and out.args[2] is s2 and out.args[1] is d
    assert rw.counts == {"fma_contract": 2, "kernel_neg_neg": 1}


def test_a_sum_reduction_becomes_a_multiply_accumulate():
    x = Buf("x", F32, (3, 100), base=2)
    w = Buf("w", F32, (100,), base=1)
    i = var("i")
    r = reduce("sum", [100], lambda k: binop("mul", load(x, [i, k]), load(w, [k])))
    e = binop("add", r, const(0.5, F32))
    rw = KernelRewriter([BUILTIN["fma_contract"]])   # the step acc + a * b, as c + a * b
    out = rw.rewrite(e)
    red = out.args[0]
    assert red.op == "reduce" and red.attr[0] == "fma" and [a.op for a in red.args] == ["load", "load"]
    assert rw.counts["fma_contract"] == 1
    # max reductions and non-product sums are left alone
    m = reduce("max", [100], lambda k: load(w, [k]))
    s = reduce("sum", [100], lambda k: load(w, [k]))
    assert rw.rewrite(m) is m and rw.rewrite(s) is s


def test_exact_rules_only_touch_float32():
    h = Buf("h", F16, (8,), base=2)
    e = binop("mul", load(h, [var("i")]), const(1.0, F16))
    rw = KernelRewriter([BUILTIN["kernel_mul_one"]])
    assert rw.rewrite(e) is e                                  # exact proofs are float32 proofs
    a, b, c = (load(h, [var("i") + k]) for k in range(3))
    rw = KernelRewriter([BUILTIN["fma_contract"]])
    assert rw.rewrite(binop("add", binop("mul", a, b), c)).op == "fma"   # real (contraction) at any width


# --- which rules may run ---------------------------------------------------------------------------------------

def test_builtin_kernel_rules_are_proved_and_gated_by_fma():
    names = {r.name for r in builtin_kernel_rules()}
    assert {"fma_contract", "kernel_mul_one", "kernel_add_neg"} <= names
    with_fma = {r.name for r in select_kernel_rules(fma=True)}
    without = {r.name for r in select_kernel_rules(fma=False)}
    assert with_fma == names
    assert "fma_contract" not in without and "kernel_mul_one" in without
    assert all(BUILTIN[n].proof == "exact" for n in without)


def test_refuted_kernel_rule_may_not_run():
    bad = rule("rule add_zero_k on kernel\n  Add(x, 0) => x\n  prove exact\n")
    with pytest.raises(RuleRejectedError, match="add_zero_k is refuted"):
        select_kernel_rules([bad])
    assert select_kernel_rules([bad], on_unproved="skip") == []


# --- PTX ---------------------------------------------------------------------------------------------------------

def _gemv_sched(dt=F32):
    x = Buf("x", dt, (4, 64), base=2)
    w = Buf("w", dt, (64,), base=1)
    y = Buf("y", dt, (4,), base=3)
    i = var("i")
    e = binop("add", reduce("sum", [64], lambda k: binop("mul", load(x, [i, k]), load(w, [k]))), const(1.0, dt))
    st = Stage("gemv", y, [i], e)
    st.reads = [x, w]
    return Schedule([st], [x], [y], [], 0, w.nbytes, {})   # the weights section holds w (the bundle proves reads against it)


def test_ptx_fma_only_through_rules():
    s = _gemv_sched()
    off = build_ptx(s, "sm_90", fma=False)
    on = build_ptx(s, "sm_90", fma=True)
    none = build_ptx(s, "sm_90", fma=True, kernel_rules=[])
    assert "fma.rn.f32" not in off.ptx and "mul.rn.f32" in off.ptx
    assert "fma.rn.f32" in on.ptx and on.kernel_rule_counts["fma_contract"] == 1
    assert "fma.rn.f32" not in none.ptx and none.kernel_rules == {}
    assert set(off.kernel_rules) == {r.name for r in select_kernel_rules(fma=False)}
    if PTXAS:
        assemble(on.ptx, "sm_90")


def test_ptx_half_accumulates_in_float32():
    r = build_ptx(_gemv_sched(F16), "sm_90", fma=True)
    assert r.widened_reductions == 1
    assert "fma.rn.f32" in r.ptx and "cvt.f32.f16" in r.ptx and "ld.global.nc.b16" in r.ptx
    assert "st.global.b16" in r.ptx
    if PTXAS:
        assemble(r.ptx, "sm_90")


@needs_libdevice
@needs_ptxas
@pytest.mark.parametrize("name", ["squeezenet", "bvlc_alexnet"])
def test_light_model_ptx_has_no_calls(name):
    """libdevice (exp/pow/...) is linked in and inlined: no call instruction is left in any kernel."""
    from cuvil.kernels.schedule import schedule
    s = schedule(Pipeline.from_onnx(light_model(name)).optimize().graph)
    r = build_ptx(s, "sm_90", fma=True)
    assert not re.search(r"\bcall(\.uni)?\b", r.ptx) and ".func" not in r.ptx
    assert r.kernel_rule_counts["fma_contract"] > 0
    _, info = assemble(r.ptx, "sm_90", jobs=0)
    assert all(k.stack_frame == 0 for k in info.values())


@needs_libdevice
def test_bundle_manifest_records_kernel_rules(tmp_path):
    p = Pipeline.from_onnx(small_cnn()).optimize()
    on = p.compile("nvptx64-nvidia-cuda", cache=False)
    off = p.compile("nvptx64-nvidia-cuda", cache=False, fma=False)
    _, man = read_bundle(on.path)
    assert man["fma"] is True and man["kernel_rules"]["fma_contract"]["applied"] >= 1
    assert man["kernel_rules"]["fma_contract"]["obligation"] == "real"
    _, man_off = read_bundle(off.path)
    assert man_off["fma"] is False and "fma_contract" not in man_off["kernel_rules"]
    # libdevice's own expf (Softmax) uses fma either way; the convolution's contractions come and go
    n_on = open(os.path.join(on.path, "kernels.ptx")).read().count("fma.rn.f32")
    n_off = open(os.path.join(off.path, "kernels.ptx")).read().count("fma.rn.f32")
    assert n_on > n_off

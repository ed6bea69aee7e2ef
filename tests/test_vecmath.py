"""The x86 target's float32 vector math (exp, erf, tanh, log inline as polynomials; Sigmoid through exp):
errors in ULPs over a sweep of float32 bit patterns, libm's answers at the special values and thresholds,
no libm call left in the library, ``math="libm"`` still selecting glibc, and the functions on whole vectors
(``VectorMath(lanes=n)``, the attention kernel's exp) giving the scalar form's bits.

The bounds are the largest errors measured over every 64th float32 (bench/vecmath.py; docs/math.md) rounded
up in the last digit; this test sweeps every 4099th (about 1M values per function).
"""
import ctypes
import os
import re
import subprocess
import warnings

import llvmlite.binding as llvm
import llvmlite.ir as ir
import numpy as np
import pytest

from cuvil import CuvilError, Pipeline
from cuvil.targets.llvm.module import initialize_native
from cuvil.targets.llvm.types import F32 as LF32, I64
from cuvil.targets.llvm.vecmath import VectorMath
from cuvil.targets.x86.cpu import host_cpu
from cuvil.testing.ulp import REFERENCES, float32_sweep, mismatched_non_finite, ulp_errors, unary_model

# largest error in ULPs (against the float64 result) measured over every 64th float32, every float32 with
# 0.5 <= |x| < 8 and the points below; Sigmoid over results >= 2^-126 (its 2.49 is 1 / (1 + exp(-x))'s own:
# the libm build measures the same)
MAX_ULP = {"Exp": 0.84, "Erf": 1.16, "Tanh": 1.02, "Log": 0.91, "Sigmoid": 2.49}
LIBM_NAMES = {"Exp": "expf", "Erf": "erff", "Tanh": "tanhf", "Log": "logf"}
STRIDE = 4099
F32 = np.float32
TINY = np.finfo(F32).smallest_subnormal
NORMAL = np.finfo(F32).tiny
FLT_MAX = np.finfo(F32).max
SPECIALS = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, TINY, -TINY, NORMAL * (1 - 2 ** -23),
                     -NORMAL * (1 - 2 ** -23), NORMAL, -NORMAL, FLT_MAX, -FLT_MAX, 1.0, -1.0], F32)
# where results saturate: float32 overflow / underflow of exp, erf and tanh reaching +-1
THRESHOLDS = {"Exp": (88.72283935546875, -103.97208404541016, -87.33654022216797),
              "Erf": (3.919205665588379, -3.919205665588379), "Tanh": (9.010913848876953, -9.010913848876953),
              "Log": (1.0,), "Sigmoid": (88.72283935546875, -16.635532379150391, 16.635532379150391)}


def neighbours(x: float, count: int = 4096) -> np.ndarray:
    """The ``count`` float32 values on each side of ``x`` (by bit pattern), ``x`` included."""
    bits = int(np.array([x], F32).view(np.int32)[0])
    return np.arange(bits - count, bits + count + 1, dtype=np.int32).view(F32)


def points(op: str) -> np.ndarray:
    return np.concatenate([float32_sweep(STRIDE), SPECIALS] + [neighbours(t) for t in THRESHOLDS[op]])


@pytest.fixture(scope="module")
def compiled():
    """op -> the vector-math library of ``y = op(x)`` over ``points(op)``, and those points."""
    out = {}

    def get(op: str, math: str = "vector"):
        if (op, math) not in out:
            x = points(op)
            art = Pipeline.from_onnx(unary_model(op, x.size)).optimize().compile(math=math)
            out[op, math] = art, x
        return out[op, math]
    return get


def reference(op: str, x: np.ndarray, dtype=np.float64) -> np.ndarray:
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return REFERENCES[op](x.astype(np.float64)).astype(dtype)


@pytest.mark.parametrize("op", list(MAX_ULP))
def test_error_in_ulps_over_the_float_line(compiled, op):
    art, x = compiled(op)
    y = art.run({"x": x})["y"]
    ref = reference(op, x)
    err, non_finite = ulp_errors(y, ref)
    if op == "Sigmoid":   # 1 / (1 + exp(-x)) is 0 once exp(-x) overflows (x < -88.7): its ULPs where normal
        err = err[ref[~non_finite] >= 2.0 ** -126]
    xs = x[~non_finite]
    if op == "Sigmoid":
        xs = xs[ref[~non_finite] >= 2.0 ** -126]
    worst = int(np.argmax(err))
    assert err[worst] <= MAX_ULP[op], f"{op}: {err[worst]:.3f} ULP at x = {xs[worst]!r}"
    bad = mismatched_non_finite(y, ref)
    assert not bad.size, f"{op}: x = {x[bad][:5]} gives {y[bad][:5]}, libm {ref[bad][:5].astype(F32)}"


@pytest.mark.parametrize("op", list(MAX_ULP))
def test_special_values_and_saturation_as_libm(compiled, op):
    """At NaN, +-inf and +-0, and wherever the result saturates (inf, 0, +-1): exactly the correctly rounded
    float64 result, +-0 with their sign (the other SPECIALS, e.g. the smallest normal, are held to MAX_ULP); tanh(x) = x at denormal x; erf at denormal x (1.128 x, not flushed to 0)
    within one denormal step (2/sqrt(pi) in float32 is 1e-9 off: near-ties round the other way)."""
    art, x = compiled(op)
    y = art.run({"x": x})["y"]
    ref = reference(op, x, F32)
    exact = np.isin(x, [np.inf, -np.inf, 0.0]) | np.isnan(x) | np.isin(ref, [np.inf, -np.inf, 0.0, 1.0, -1.0])
    exact |= np.isnan(ref)
    if op == "Tanh":
        exact |= np.abs(x) < NORMAL
    if op == "Erf":
        tiny = (np.abs(x) < NORMAL) & (x != 0)
        step = np.abs(y[tiny].astype(np.float64) - ref[tiny].astype(np.float64)) / TINY
        assert step.max() <= 1 and np.all(np.signbit(y[tiny]) == np.signbit(x[tiny])) and np.all(y[tiny] != 0)
    same = (y == ref) & (np.signbit(y) == np.signbit(ref)) | (np.isnan(y) & np.isnan(ref))
    wrong = np.nonzero(exact & ~same)[0]
    assert not wrong.size, f"{op}: x = {x[wrong][:6]} gives {y[wrong][:6]}, libm {ref[wrong][:6]}"


def _imports(path: str) -> set:
    out = subprocess.run(["nm", "-D", "--undefined-only", path], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


@pytest.mark.parametrize("op", list(LIBM_NAMES))
def test_vector_math_calls_no_libm_and_libm_stays_selectable(compiled, op):
    art, x = compiled(op)
    assert LIBM_NAMES[op] not in _imports(art.path)
    assert art.manifest["math"] == "vector"
    libm, _ = compiled(op, "libm")
    assert LIBM_NAMES[op] in _imports(libm.path) and libm.manifest["math"] == "libm"
    y, ref = libm.run({"x": x})["y"], reference(op, x)
    err, _ = ulp_errors(y, ref)
    assert err.max() < (2.1 if op == "Tanh" else 0.9)   # glibc's own bounds (tanhf: 2 ULP)


def test_unknown_math_mode_is_refused():
    with pytest.raises(CuvilError, match='"vector" or "libm"'):
        Pipeline.from_onnx(unary_model("Exp", 4)).optimize().compile(math="fast")


def test_docs_math_snippet_runs():
    """docs/math.md's python block (building with libm) runs as written."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "math.md"), encoding="utf-8") as f:
        (code,) = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    exec(compile(code, "docs/math.md", "exec"), {})


def _vector_form(fn: str, lanes: int, scalef: bool = False):
    """``void f(float *x, float *y, i64 n)``: y = fn(x), ``lanes`` at a time, through ``VectorMath(lanes=lanes,
    scalef=scalef)`` (as the attention kernel calls exp on its registers), JIT-compiled for the host CPU."""
    initialize_native()
    mod = ir.Module(name="vector_form")
    vec, fptr = ir.VectorType(LF32, lanes), ir.PointerType(LF32)
    f = ir.Function(mod, ir.FunctionType(ir.VoidType(), [fptr, fptr, I64]), name="f")
    entry, body, done = f.append_basic_block("entry"), f.append_basic_block("body"), f.append_basic_block("done")
    b = ir.IRBuilder(entry)
    b.branch(body)
    b.position_at_end(body)
    i = b.phi(I64)
    i.add_incoming(ir.Constant(I64, 0), entry)
    vm = VectorMath(b, lambda name, ret, args: mod.declare_intrinsic(name, fnty=ir.FunctionType(ret, args)), lanes,
                    scalef=scalef)
    at = [b.bitcast(b.gep(p, [i]), ir.PointerType(vec)) for p in f.args[:2]]
    b.store(getattr(vm, fn)(b.load(at[0], align=4)), at[1], align=4)
    nxt = b.add(i, ir.Constant(I64, lanes))
    i.add_incoming(nxt, body)
    b.cbranch(b.icmp_signed("<", nxt, f.args[2]), body, done)
    b.position_at_end(done)
    b.ret_void()
    tm = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=2)
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(str(mod)), tm)
    engine.finalize_object()
    run = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(engine.get_function_address("f"))

    def apply(x: np.ndarray) -> np.ndarray:
        n = -(-x.size // lanes) * lanes
        xp = np.zeros(n, F32)
        xp[:x.size] = x
        y = np.empty(n, F32)
        run(xp.ctypes.data, y.ctypes.data, n)
        return y[:x.size]
    apply.engine = engine       # keeps the JIT alive as long as the function
    return apply


@pytest.mark.parametrize("op", list(LIBM_NAMES))
@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("scalef", [False, True], ids=["portable", "scalef"])
def test_vector_form_gives_the_scalar_form_bits(compiled, op, lanes, scalef):
    """``VectorMath(lanes=n)`` on whole vectors computes each lane by the scalar form's instructions: the same
    bits as the compiled library (the scalar form in a loop the vectoriser widens) at every point. Both forms
    of exp's last step (``scalef``: one ``llvm.ldexp``, AVX-512F's ``vscalefps``; else two exact multiplies)
    against the library, which takes ``scalef`` on an AVX-512 host: the two give the same bits."""
    if scalef and "avx512f" not in host_cpu().features:
        pytest.skip("scalef form: this CPU has no AVX-512F (LLVM would expand llvm.ldexp into ldexpf calls)")
    art, x = compiled(op)
    want = art.run({"x": x})["y"]
    got = _vector_form(op.lower(), lanes, scalef)(x)
    same = (got.view(np.int32) == want.view(np.int32)) | (np.isnan(got) & np.isnan(want))
    wrong = np.nonzero(~same)[0]
    assert not wrong.size, f"{op}: x = {x[wrong][:6]} gives {got[wrong][:6]}, scalar form {want[wrong][:6]}"


def test_a_library_for_a_cpu_without_avx512_scales_exp_without_vscalef():
    """exp's last step is llvm.ldexp only where the target has AVX-512F (vscalefps); a library built for an
    AVX2 CPU (x86-64-v3) on any host keeps the two exact multiplies: no ldexpf import, no vscalef."""
    x = points("Exp")[:4096]
    art = Pipeline.from_onnx(unary_model("Exp", x.size)).optimize().compile(cpu="x86-64-v3", cache=False)
    assert not {"ldexpf", "ldexp"} & _imports(art.path)
    asm = subprocess.run(["objdump", "-d", art.path], capture_output=True, text=True, check=True).stdout
    assert "vscalef" not in asm and "zmm" not in asm
    if "avx2" in host_cpu().features and "fma" in host_cpu().features:
        y = art.run({"x": x})["y"]
        want, _ = compiled_default_exp(x)
        assert np.array_equal(y.view(np.int32), want.view(np.int32))


def compiled_default_exp(x):
    """exp of ``x`` by a library for this host (vscalefps on an AVX-512 host): the reference bits."""
    art = Pipeline.from_onnx(unary_model("Exp", x.size)).optimize().compile(cache=False)
    return art.run({"x": x})["y"], art

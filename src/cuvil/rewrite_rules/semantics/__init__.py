"""Z3 semantics of ONNX ops over small concrete shapes, for proving rewrite rules.

A tensor here is a numpy array of dtype=object (0-d allowed) whose elements are Z3 expressions; its shape
is concrete. :func:`evaluate` computes an op's outputs from such inputs in one of two domains:

* :class:`FP32Domain` (``prove exact``): IEEE-754 binary32, round-nearest-even, NaN, +-0, +-inf and
  subnormals included (Z3 ``FPSort(8, 24)``). SMT-LIB has a single NaN, so NaN payloads and NaN signs are
  not distinguished: every NaN equals every NaN, while +0 and -0 differ (:meth:`Domain.equal`).
* :class:`RealDomain` (``prove real``): the reals. Operations undefined somewhere (x/0, Sqrt of a
  negative, Log of a non-positive) record definedness conditions in ``dom.side``; facts about the
  uninterpreted functions (sqrt(a) >= 0, exp(a) > 0 ...) go to ``dom.axioms``. ``dom.side`` holds each
  condition once (a condition already required by the left side is not appended again for the right);
  :meth:`Domain.mark` / :meth:`Domain.side_since` give one side's full list. Sqrt is an uninterpreted
  ``sqrt`` with sqrt(a) >= 0 and sqrt(a)^2 = a (for a >= 0); Exp, Log, Tanh, Erf ... are uninterpreted
  (exp > 0; tanh, erf in (-1, 1)); Floor/Ceil/Round are exact via ToInt (Round half-to-even); Pow with a
  literal integer exponent 0..4 is a product, otherwise uninterpreted; Softmax is exp(x) / sum(exp(x))
  and LogSoftmax is Log(Softmax(x)) (equal, over the reals, to the max-shifted function bodies).

Choices that matter for bit-exactness (FP32Domain):

* Transcendentals (Exp, Log, Tanh, Erf, Sin, Pow ...) are uninterpreted functions, one per op and domain,
  the same Z3 declaration on both sides of a rule, so only structural identities about them are provable.
  Composite ops are defined by their ONNX function bodies (opset 21) over those primitives: Sigmoid =
  1 / (1 + Exp(-x)), Softplus = Log(Exp(x) + 1), Elu, Selu, Gelu, HardSigmoid, HardSwish, Softmax =
  Exp(x - ReduceMax(x)) / ReduceSum(...), LogSoftmax = (x - max) - Log(ReduceSum(...)), LayerNormalization.
  "Exact" therefore means: bit for bit, given that each primitive is implemented once.
* Max / Min / Relu follow numpy's ``maximum`` / ``minimum`` on float32: a NaN in either argument gives NaN,
  and on ties (which includes -0 vs +0) the *second* argument is returned. Relu(x) is ONNX's function body
  Max(x, 0), i.e. ``np.maximum(x, 0)``, so Relu(-0.0) = +0.0 (as onnx.reference; onnxruntime's CPU kernel
  returns -0.0 here). Variadic Max/Min and ReduceMax/Min fold left: r = maximum(r, a_i).
* Clip follows numpy's clip with scalar bounds: NaN in x, min or max gives NaN; otherwise
  t = min if x < min else x; y = max if t > max else t (a tie keeps x, so Clip(-0.0, 0, 6) = -0.0).
  An absent bound is ONNX's default (the lowest / largest finite float32, as onnxruntime; the
  reference implementation leaves that side unbounded instead). In the real domain an absent bound is no bound.
* Sums (Sum, MatMul, Gemm, Conv, ReduceSum, pools) add left to right over the reduction index, in row-major
  order of the reduced axes (Conv: input channel, then kernel position), starting from the first term (not
  from +0, which would turn a -0 result into +0). Rules that reorder sums are therefore not provable
  exactly, which is right. Conv includes the products of padding zeros with weights (0 * inf = NaN), as
  convolving the zero-padded input (im2col) does; pools ignore padding.
* MaxPool skips NaNs (as onnx.reference and onnxruntime do when the window holds a number; an all-NaN
  window gives NaN), ties giving the later element; GlobalMaxPool and ReduceMax/Min propagate NaN like
  np.max. AveragePool propagates NaN (onnxruntime; onnx.reference skips NaNs there). The runtimes
  disagree among themselves on these corners (onnxruntime's MaxPool turns -inf into -FLT_MAX).
* Gemm is (A'B') * alpha + C * beta as onnx.reference computes it, with C skipped when beta == 0; alpha == 1
  and beta == 1 (exact identities) are not multiplied out.
* BatchNormalization (inference) is (x - mean) / Sqrt(var + eps) * scale + B in this order (the ONNX spec
  formula); InstanceNormalization is scale * (x - mean) / Sqrt(var + eps) + B with var the mean of squared
  deviations; LayerNormalization follows its function body (var = E[x^2] - E[x]^2, stash_type 1 only).
* LeakyRelu, PRelu, Elu, Selu use their bodies' Where(x < 0, ..., x): -0.0 passes through unchanged
  (onnx.reference's PRelu computes where(x > 0, x, x * slope) and differs in the sign of zeros).
* Sign(+-0) = +0, Sign(NaN) = NaN (np.sign); Round is half-to-even; Floor/Ceil round toward -inf/+inf.
* Dropout in inference is the identity (mask all True). In training mode every element gets a fresh
  symbolic Bool mask m: y = m ? x * (1 / (1 - ratio)) : 0 (ratio == 0 keeps everything), so removing a
  training-mode Dropout is refuted.

Layout: the domains in :mod:`.domains`, symbolic tensors and shared helpers in :mod:`.tensors`, the table
(:func:`sem`, :func:`evaluate`) in :mod:`.table`, counterexample text in :mod:`.counterexamples`, and each op's
semantics in the module named after its family in ``ir/ops`` (:data:`FAMILIES`). Importing this package
registers them all.

Public interface: :class:`FP32Domain`, :class:`RealDomain`, :func:`evaluate`, :data:`SEMANTICS`,
:func:`symbolic`, :func:`tensors_equal`, :func:`element_equalities`, :func:`constant_tensor`,
:data:`SEMANTICS_VERSION`.
"""
from typing import Dict

from . import (activation, attention, cast, conv, elementwise, indexing, matmul, misc, norm, pool, reduce, shape,
               softmax, winograd)
from .counterexamples import first_difference, format_value
from .domains import FP32, FP_FORMATS, Domain, FP32Domain, FPDomain, RealDomain
from .table import SEMANTICS, SEMANTICS_VERSION, evaluate, sem
from .tensors import _map, _py_number, constant_tensor, element_equalities, symbolic, tensors_equal

# The op families with semantics (modules named as in ir/ops); each registers its ops on import.
FAMILIES = (activation, cast, conv, elementwise, indexing, matmul, misc, norm, pool, reduce, shape, softmax, winograd,
            attention)


def _each(reason: str, *ops: str) -> Dict[str, str]:
    return {o: reason for o in ops}


# Registered ops the prover has no semantics for, and why: a rule that uses one is not proved (it never runs).
# tests/test_op_registry.py fails for a registered op that has neither semantics nor a row here.
WITHOUT_SEMANTICS: Dict[str, str] = {
    **_each("a run-time loop's state slots / back edge: stateful (their values change per iteration), never "
            "rewritten", "LoopState", "LoopBack"),
    **_each("integer arithmetic (the domains are float32, other float formats and the reals)",
            "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "Mod"),
    **_each("quantized integer arithmetic", "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear",
            "QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger"),
    **_each("index-valued or value-dependent outputs", "ArgMax", "ArgMin", "TopK", "NonZero", "Unique",
            "NonMaxSuppression", "Compress", "Hardmax"),
    **_each("not a function of its inputs", "RandomNormal", "RandomUniform", "RandomNormalLike",
            "RandomUniformLike", "Bernoulli", "Multinomial"),
    **_each("computed from shapes and attributes only (folded before rules run)", "Constant", "ConstantOfShape",
            "Shape", "Size", "Range", "EyeLike"),
    **_each("control flow: expanded on import into the ops of its subgraphs (never in a graph)", "If", "Loop", "Scan"),
    **_each("the output type comes from another input (CastLike: no float32-only form)", "CastLike"),
    **_each("a loop over time carrying state (no built-in rule rewrites a recurrence)", "LSTM", "GRU", "RNN"),
    **_each("reinterprets bit patterns across types (the domains hold values of one type)", "BitCast"),
    **_each("signal processing (trigonometric sums over whole rows): no built-in rule uses it", "DFT", "STFT",
            "HannWindow", "HammingWindow", "BlackmanWindow", "MelWeightMatrix"),
    **_each("not modelled yet: no built-in rule uses it", "DeformConv", "Det", "Einsum", "GatherElements",
            "GatherND", "GlobalLpPool", "GridSample", "GroupNormalization", "LRN", "LpNormalization", "LpPool",
            "MaxRoiPool", "MaxUnpool", "MeanVarianceNormalization", "OneHot", "RMSNormalization", "Resize",
            "ReverseSequence", "RoiAlign", "ScatterElements", "ScatterND", "Shrink", "Trilu", "TensorScatter",
            "Col2Im", "AffineGrid"),
}

__all__ = ["FP32", "FP_FORMATS", "SEMANTICS", "SEMANTICS_VERSION", "Domain", "FP32Domain", "FPDomain", "RealDomain",
           "constant_tensor", "element_equalities", "evaluate", "first_difference", "format_value", "sem",
           "symbolic", "tensors_equal", "WITHOUT_SEMANTICS"]

"""The interface every code generation target implements, and the option objects targets take.

A target turns an optimised graph into an artifact in three steps, which :meth:`cuvil.Pipeline.compile` runs
in order with the artifact cache between the first and the second:

* ``plan(graph, options, profiles)``: cheap, before the cache is looked at. Checks what the options can only
  be checked against the target (a GPU architecture), resolves them (the kernel rules that may run) and
  returns a :class:`BuildPlan` whose ``key_parts`` are what the artifact depends on besides the graph.
* ``emit(plan, path, manifest_extra)``: only on a cache miss. The target's own graph passes (x86:
  the algorithm choices, the opt-point specialisation), scheduling, code generation and then linking (x86,
  ``cc``) or assembling (PTX, ``ptxas``) into ``path``; returns the manifest it wrote, with ``timings`` added
  (seconds of its stages: not written, the artifact is the same bytes at every build). The pipeline then
  writes the SBOM and provenance beside it (:mod:`cuvil.supply_chain`).
* ``load(path, manifest, cached)``: the artifact object for what ``emit`` wrote (now or on an earlier run).

A target is one folder under ``cuvil/targets/`` with a ``target.py`` defining ``TARGET`` (an object with the
attributes of :class:`Target`) and its option class, plus one row in :data:`cuvil.targets.TARGETS`.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, ClassVar, Dict, FrozenSet, List, Mapping, Optional, Protocol, Tuple, Type

import attrs

from ..errors import CuvilError
from ..ir.graph import Graph

class TargetOptions:
    """Base of the per-target option classes (made with :func:`target_options`): frozen, keyword-only, and
    checked when built (an unknown option or a wrong value is a :class:`CuvilError` naming it)."""

    triple: ClassVar[str]

    @classmethod
    def names(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in attrs.fields(cls))

    def replace(self, **changes) -> "TargetOptions":
        """A copy with ``changes`` applied (checked like the constructor's keywords)."""
        return type(self)(**{**attrs.asdict(self, recurse=False), **changes})


def target_options(triple: str):
    """Class decorator: an attrs frozen, keyword-only option class of target ``triple``; its constructor
    refuses unknown keywords with a :class:`CuvilError` listing the valid ones."""
    def make(cls):
        cls.triple = triple
        cls = attrs.frozen(kw_only=True)(cls)
        init = cls.__init__

        @functools.wraps(init)
        def checked_init(self, **kw):
            unknown = sorted(set(kw) - set(cls.names()))
            if unknown:
                raise CuvilError(f"{cls.__name__}: unknown option{'s' if len(unknown) > 1 else ''} "
                                 f"{', '.join(unknown)}; the options of {triple} are {', '.join(cls.names())}")
            init(self, **kw)
        cls.__init__ = checked_init
        return cls
    return make


def check(accepts: Callable[[Any], bool], expected: str):
    """An attrs validator raising a :class:`CuvilError` that names the option, what it takes and what it got."""
    def validate(inst, attribute, value):
        if not accepts(value):
            raise CuvilError(f"{type(inst).__name__}.{attribute.name} takes {expected}, got {value!r}")
    return validate


def is_bool(v) -> bool:
    return isinstance(v, bool)


def is_opt_level(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v in (0, 1, 2, 3)


def is_name(v) -> bool:
    """A non-empty string (a prefix, an architecture name)."""
    return isinstance(v, str) and bool(v)


@attrs.frozen
class BuildPlan:
    """What ``plan`` resolved and ``emit`` builds from: the graph, the options, the cache-key parts of the
    options as resolved (``key_parts``), the artifact's file or directory name, and target-specific data."""
    graph: Graph
    options: TargetOptions
    artifact_name: str
    key_parts: List[str]
    extra: Mapping[str, Any] = attrs.field(factory=dict)


class Target(Protocol):
    """A code generation target: see the module docstring for the three steps."""

    triple: str
    options_type: Type[TargetOptions]
    #: True: symbolic dims stay symbolic (one artifact serves a shape profile); False: every symbol is
    #: specialised before ``plan`` (to the given value, else its opt, else its min).
    keeps_symbols: bool

    def plan(self, graph: Graph, options: TargetOptions, profiles: Dict[str, list]) -> BuildPlan: ...

    def emit(self, plan: BuildPlan, path: str, manifest_extra: dict) -> dict:
        """Build the artifact at ``path``, reporting its stages through :mod:`cuvil.progress`."""

    def load(self, path: str, manifest: Optional[dict] = None, cached: bool = False): ...

    def precision_ops(self, options: TargetOptions) -> Dict[str, FrozenSet[str]]:
        """Optional. The ops this target runs narrowed with ``options`` on this machine, by number format:
        ``{"bf16": frozenset({"Conv", "MatMul", "Gemm"}), "int8": ...}`` (formats as :attr:`Node.precision
        <cuvil.ir.graph.Node.precision>` spells them, ops as the IR names them). The precision policy
        (:mod:`cuvil.precision`) narrows a node only to a format its op is listed under here; a target
        without the method narrows nothing. Read it through :func:`precision_ops`."""

    def transformed_rounding(self, options: TargetOptions, graph: Graph) -> Dict[str, float]:
        """Optional. ``{node name: unit roundoff}`` for the nodes of ``graph`` this target, with ``options``,
        computes in bf16 in another form than as written (x86: stride-1 3x3 convolutions as Winograd F(2x2),
        which round transformed operands), each with the input rounding that bounds its error. The precision
        policy re-bounds the narrowed ranges with it. A target without the method computes every narrowed node
        as written. Read it through :func:`transformed_rounding`."""

    #: Optional (default False). True: between convolutions narrowed to bf16 this target stores values as
    #: bfloat16 (:mod:`cuvil.kernels.bf16_storage`), so the precision plan lists those values and, under an
    #: explicit ``--precision bf16``, the skip path it certifies for that storage. Read it through
    #: :func:`stores_bf16`.
    stores_bf16: bool


#: The number formats a node may be narrowed to (:attr:`cuvil.ir.graph.Node.precision`; "" is float32).
PRECISION_FORMATS = ("bf16", "fp16", "fp8", "int8")


def stores_bf16(target: Target) -> bool:
    """Whether ``target`` keeps values between its bf16 convolutions as bfloat16 (:attr:`Target.stores_bf16`)."""
    return bool(getattr(target, "stores_bf16", False))


def transformed_rounding(target: Target, options: TargetOptions, graph) -> Dict[str, float]:
    """``target.transformed_rounding(options, graph)``, or ``{}`` for a target without it: node name -> the unit
    roundoff that bounds the rounding of a node the target computes in bf16 in another form than as written
    (x86's bf16 Winograd convolutions), for the precision policy's re-bounding of the narrowed ranges."""
    fn = getattr(target, "transformed_rounding", None)
    return {str(k): float(v) for k, v in dict(fn(options, graph) or {}).items()} if fn is not None else {}


def precision_ops(target: Target, options: TargetOptions) -> Dict[str, FrozenSet[str]]:
    """``target.precision_ops(options)`` checked (known formats, op names as strings), or ``{}`` for a target
    that does not define it: the ops the target runs in each narrow format."""
    fn = getattr(target, "precision_ops", None)
    if fn is None:
        return {}
    out = {}
    for fmt, ops in dict(fn(options) or {}).items():
        if fmt not in PRECISION_FORMATS:
            raise CuvilError(f"target {target.triple}: precision_ops gives unknown format {fmt!r} "
                             f"(the formats are {', '.join(PRECISION_FORMATS)})")
        out[fmt] = frozenset(str(o) for o in ops)
    return out

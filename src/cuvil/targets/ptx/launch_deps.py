"""Which kernels of one inference may run at the same time: the dependencies of a bundle's launches, and the
streams a captured CUDA graph puts them on.

A bundle launches its kernels in schedule order. Most depend on the one before (a layer's product reads what the
LayerNorm before it wrote), but not all: BERT's Q, K and V projections all read the same LayerNorm output and
write three buffers no other of them touches; an Inception block's four branches read one input. Launched one
after another, each of those small products fills a part of the GPU (its plan launches 96 blocks of 256 threads
for BERT-base's 128 x 768 x 768 at S = 128, against an H200's 132 SMs) and the next waits for its tail.

:func:`kernel_dependencies` states, per kernel, the earlier kernels it must wait for, from the bytes each reads and
writes: kernel ``j`` depends on an earlier ``i`` when ``i`` writes bytes that ``j`` reads or writes, or reads
bytes that ``j`` writes (read-after-write, write-after-write, write-after-read: the arena plan reuses bytes of
dead tensors, so the last two are real). The bytes are the schedule's: each stage's buffer (its root's range in
the arena, or an output buffer) written, every buffer its expression loads read (``Stage.reads``, the same sets
the arena plan keeps tensors alive by), every buffer a sequential program writes counted as written. Only kernels
of the kinds in :func:`touches_only_its_stages` are placed by their bytes; any other kind (split-K products and
their sum kernels, split attention, whose partials and tile counters share one scratch area after the arena) is
a *barrier*: it waits for every kernel before it and every kernel after it waits for it. A schedule whose sizes
are symbolic gets no dependencies (``None``: the runtime keeps the launch order). The lists are transitively
reduced (a kernel waits for ``i`` only where no other kernel it waits for already does).

:func:`assign_streams` lays the kernels over ``streams`` streams for graph capture (the runtime's
``streams``, :func:`launch_layout`): a kernel goes on the stream of one of its dependencies whose last kernel it is (stream
order then gives that dependency for free), else on an idle stream; every other dependency on another stream is an
event it waits for. Replaying the graph runs the independent kernels at once. The results are the same bits: each
kernel computes what it computed before, from the same inputs, and writes where it did; only the order of
kernels that share no byte changes.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ...errors import CuvilError
from ...kernels.schedule import WEIGHTS
from ...kernels.texpr import Buf, nodes
from .matmul_mma import FRAGMENTS

#: streams a captured graph lays a bundle's kernels over by default (GpuModel's ``streams``; 1: launch order).
#: 1 until run on a GPU: written in session 40 (tested through the fake driver, every dependency checked against
#: the memory-safety proof's accesses) when no device could be had; bench/gpu/streams_run.sh times streams=4
#: against 1 and runs the GPU tests (tests/test_gpu_streams.py)
DEFAULT_STREAMS = 1
MAX_STREAMS = 16

# kernel kinds (KernelDesc.kind, as ptx/codegen.py names them) whose kernels read and write only their stages'
# buffers: no split-K partials, no tile counters, no attention partials in the scratch area after the arena (those
# kinds, and any kind not listed here, are barriers). The tensor-core products and convolutions unsplit, per format.
_FORMATS = tuple(FRAGMENTS)      # the tensor-core formats (their kernels' kinds end in the format)
PLAIN_KINDS = frozenset({"element", "split", "coarse", "tiled", "sequential", "row", "gemm_fp32", "gemv",
                         "attention_mma", "conv", "conv_mma"} | {f"matmul_{f}" for f in _FORMATS}
                        | {f"conv_mma_{f}" for f in _FORMATS})


def touches_only_its_stages(kind: str) -> bool:
    """Whether a kernel of ``kind`` accesses only its stages' buffers (:data:`PLAIN_KINDS`); any other is a
    barrier: it may use the shared scratch area after the arena."""
    return kind in PLAIN_KINDS


Interval = Tuple[int, int, int]     # (buffer table slot, first byte, past the last byte)


def _interval(b: Buf) -> Optional[Interval]:
    """The bytes of ``b`` (its first element at ``offset`` of its slot, as kernels address it); None where its
    size is symbolic."""
    span = b.span
    if not isinstance(span, int):
        return None
    return (b.base, int(b.offset), int(b.offset) + span - int(b.shift))


def _accesses(stages, read_only: set) -> Optional[Tuple[List[Interval], List[Interval]]]:
    reads, writes = [], []
    for st in stages:
        written = [st.buf]
        for x in nodes(st.expr):
            if x.op == "sequential":
                written.extend(x.attr.written())
        for group, out in ((list(st.reads), reads), (written, writes)):
            for b in group:
                if b.base in read_only:
                    continue
                iv = _interval(b)
                if iv is None:
                    return None
                out.append(iv)
    return reads, writes


def _overlap(a: Sequence[Interval], b: Sequence[Interval]) -> bool:
    return any(x[0] == y[0] and x[1] < y[2] and y[1] < x[2] for x in a for y in b)


def kernel_dependencies(kernel_stages: Sequence[Sequence], kinds: Sequence[str],
                        read_only: Sequence[int] = (WEIGHTS,)) -> Optional[List[List[int]]]:
    """Per kernel (``kernel_stages[j]``: the stages kernel ``j`` computes, ``kinds[j]``: its KernelDesc kind), the
    earlier kernels it must wait for, transitively reduced; ``read_only``: buffer slots no kernel writes (the
    weights, the inputs). None where a size is symbolic."""
    n = len(kinds)
    acc = []
    for sts in kernel_stages:
        a = _accesses(sts, set(read_only))
        if a is None:
            return None
        acc.append(a)
    ancestors: List[int] = []     # bit i set: kernel i precedes this one (transitively)
    after: List[List[int]] = []
    for j in range(n):
        barrier = not touches_only_its_stages(kinds[j])
        direct = []
        for i in range(j):
            if barrier or not touches_only_its_stages(kinds[i]) or _overlap(acc[i][1], acc[j][0]) \
                    or _overlap(acc[i][1], acc[j][1]) or _overlap(acc[i][0], acc[j][1]):
                direct.append(i)
        anc = 0
        for i in direct:
            anc |= ancestors[i] | (1 << i)
        # a dependency that another dependency already waits for is implied
        implied = 0
        for i in direct:
            implied |= ancestors[i]
        after.append([i for i in direct if not (implied >> i) & 1])
        ancestors.append(anc)
    return after


def launch_summary(after: Optional[Sequence[Sequence[int]]], kernels: int) -> dict:
    """The manifest's ``launch_graph``: kernels, dependency edges, the longest chain of dependent kernels
    (``critical_path``) and the most kernels at one depth of the dependency graph (``widest_level``); where
    ``after`` is None (symbolic sizes), the kernels and that the launch order is kept."""
    if after is None:
        return {"kernels": kernels, "dependencies": "launch order (symbolic sizes)"}
    depth: List[int] = []
    for deps in after:
        depth.append(1 + max((depth[i] for i in deps), default=0))
    levels: Dict[int, int] = {}
    for d in depth:
        levels[d] = levels.get(d, 0) + 1
    return {"kernels": kernels, "edges": sum(len(d) for d in after), "critical_path": max(depth, default=0),
            "widest_level": max(levels.values(), default=0)}


def assign_streams(after: Sequence[Sequence[int]], streams: int) -> Tuple[List[int], List[List[int]]]:
    """(the stream of each kernel, the kernels whose completion each kernel waits for by an event): kernels on one
    stream run in launch order; a kernel waits for a dependency on another stream. Stream 0 is the caller's; a
    kernel with no dependency starts on stream 0 (after the run's memsets there), or where that is taken by a
    kernel it does not depend on, on an idle stream (which first waits for the run's start: the runtime's fork)."""
    tail: Dict[int, int] = {}          # stream -> its last kernel
    where: List[int] = []
    waits: List[List[int]] = []
    for j, deps in enumerate(after):
        deps = list(deps)
        own = next((s for s in range(streams) if tail.get(s) in deps), None)
        if own is None:
            idle = [s for s in range(streams) if s not in tail]
            own = idle[0] if idle else min(range(streams), key=lambda s: tail[s])
        where.append(own)
        waits.append([d for d in deps if where[d] != own])     # (one on this stream precedes in its order)
        tail[own] = j
    return where, waits


def launch_layout(plan_kernels: Sequence[dict], launched: Sequence[dict], streams: int):
    """(stream of each launch, the launches each waits for, the launches some other stream waits for) for the
    kernels of a plan that are launched (``launched``: those with work, in order; a kernel of no elements is not
    launched, and a launch that depended on it depends on what it depended on); None where the plan states no
    dependencies (an older bundle, symbolic sizes) or ``streams`` < 2: launch in order on one stream."""
    if streams < 2 or not plan_kernels or any("after" not in k for k in plan_kernels):
        return None
    for p, k in enumerate(plan_kernels):
        after = k["after"]
        if not isinstance(after, list) or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < p
                                                  for d in after):
            raise CuvilError(f"plan.json: kernel {p} ({k.get('name')}) has \"after\": {after!r}; each entry must be "
                             f"the index of an earlier kernel",
                             hint="recompile the bundle (its plan.json is damaged), or load it with streams=1")
    index = {id(k): p for p, k in enumerate(plan_kernels)}
    pos = {index[id(k)]: j for j, k in enumerate(launched)}

    def launched_deps(p: int, seen: set) -> List[int]:
        out = []
        for d in plan_kernels[p]["after"]:
            if d in seen:
                continue
            seen.add(d)
            out.extend([pos[d]] if d in pos else launched_deps(d, seen))
        return out
    after = [sorted(set(launched_deps(index[id(k)], set()))) for k in launched]
    where, waits = assign_streams(after, streams)
    waited = sorted({d for w in waits for d in w})
    return where, waits, waited

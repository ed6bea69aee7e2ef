"""Process replay: deterministic text snapshots of what the compiler generates for a fixed set of models,
compared against goldens so that a refactor can show that no kernel changed (tinygrad's process replay).

For each model (:data:`MODELS`) and each target there is one snapshot:

* ``x86``: the x86 schedule (every stage: name, op, buffer, dtype, shape, region, reads, tensor expression;
  the weights layout and a hash of the packed weights) and the LLVM IR module exactly as the x86 backend
  hands it to LLVM, before any LLVM optimisation, for the pinned CPU :data:`X86_CPU` (never the host: the
  CPU sets the vector width, the register tiles and the Winograd choices).
* ``ptx``: the GPU schedule and the NVPTX LLVM IR module of the bundle for :data:`PTX_ARCH`, also before LLVM
  optimisation and before libdevice is linked in. Not the PTX text: LLVM turns the same module into the same
  PTX, the PTX inlines the host's libdevice (a CUDA version), and LLVM's NVPTX pipeline was two thirds of
  the GPU snapshot's time.

The snapshots are taken on the real compile path, ``Pipeline.compile`` with ``cache=False``, stopped where
the backend hands its module to LLVM: see :data:`SEAMS`. Nothing is re-implemented here but the printing.

    python -m cuvil.testing.replay --check            # compare with tests/golden/replay/ (diff on mismatch)
    python -m cuvil.testing.replay --update           # rewrite the goldens from the current code
    python -m cuvil.testing.replay --diff resnet50.x86   # the whole diff of one snapshot
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import hashlib
import lzma
import multiprocessing
import os
import re
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from typing import Dict, Iterator, List, Optional, Tuple

import attrs
import llvmlite.binding as llvm

from ..kernels.schedule import Schedule, Stage
from ..kernels.texpr import E, Buf
from ..pipeline import Pipeline
from ..targets import PTX_TARGET, X86_TARGET
from ..targets.ptx import bundle as ptx_bundle
from ..targets.x86 import compile as x86_compile
from ..targets.x86.codegen import KernelModule as X86KernelModule
from .models import light_model, transformer_block

#: The x86 CPU every snapshot is generated for (AVX-512: 512-bit vectors, the 12x32 / channel-lane tiles).
X86_CPU = "skylake-avx512"
PTX_ARCH = "sm_90"
CNNS = ("resnet50", "squeezenet", "shufflenet", "densenet121", "inception_v1")
TRANSFORMER = "transformer_block"
MODELS = CNNS + (TRANSFORMER,)
TARGETS = ("x86", "ptx")
#: Where the compile path is intercepted: (module, attribute). A refactor that moves one of these functions
#: updates this table (and :func:`_x86_snapshot` / :func:`_ptx_snapshot`); the test fails loudly otherwise.
SEAMS = {"x86": (x86_compile, "generate_object"), "ptx": (ptx_bundle, "build_ptx")}
GOLDEN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))), "tests", "golden", "replay")


class _Stop(Exception):
    """Raised at a seam once the snapshot is taken: the rest of the build (LLVM, linking) is not needed."""


def load_pipeline(model: str) -> Pipeline:
    """The optimised pipeline of ``model`` (built-in rules), static shapes (batch 1) so both targets compile it."""
    if model == TRANSFORMER:
        onnx_model = transformer_block(d_model=32, heads=4, d_ff=64, batch=1, seq=8, seed=0)
    elif model in CNNS:
        onnx_model = light_model(model)
    else:
        raise ValueError(f"unknown replay model {model!r}; choose from {', '.join(MODELS)}")
    return Pipeline.from_onnx(onnx_model).optimize()


# ---------------------------------------------------------------------------------------------- printing
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def _buf(b: Buf) -> str:
    view = f" view of {b.root.name}" if b.root is not None else ""
    if b.pitch is not None:        # a padded buffer's interior (kernels/pad_in_place.py), channels-last, Winograd M
        view += f" pitch {list(b.pitch)}"
    return f"{b.name}:{b.dtype.name}{list(b.shape)}@{b.base}+{b.offset}{view}"


class _StagePrinter:
    """Prints one stage's expressions. Index variables carry a process-wide counter in their names
    (``i018213``): they are renamed in order of first appearance, the stage's own ``v0, v1, ...`` and the
    others (reduction variables) ``r0, r1, ...``, so a snapshot does not depend on what ran before."""

    def __init__(self, st: Stage):
        self.names: Dict[str, str] = {}
        for v in st.vars:
            self.names.setdefault(v.attr, f"v{len(self.names)}")
        self.others = 0

    def var(self, name: str) -> str:
        if name not in self.names:
            self.names[name] = f"r{self.others}"
            self.others += 1
        return self.names[name]

    def attr(self, a) -> str:
        if isinstance(a, Buf):
            return a.name
        if isinstance(a, E):
            return self.inline(a)
        if isinstance(a, (tuple, list)):
            inner = ", ".join(self.attr(x) for x in a)
            return f"({inner})" if isinstance(a, tuple) else f"[{inner}]"
        if callable(a) and not isinstance(a, type):   # a lowering's closure: its name is not the kernel
            return "<function>"
        if attrs.has(type(a)):
            fields = ", ".join(f"{f.name}={self.attr(getattr(a, f.name))}" for f in attrs.fields(type(a))
                                   if f.repr is not False)
            return f"{type(a).__name__}({fields})"
        return _ADDRESS.sub("", repr(a))

    def inline(self, e: E) -> str:
        if e.op == "var":
            return self.var(e.attr)
        if e.op == "const":
            return f"{e.attr!r}:{e.dtype.name}"
        head = f"{e.op}[{self.attr(e.attr)}]" if e.attr is not None else e.op
        return f"{head}({', '.join(self.inline(x) for x in e.args)})"

    def expr(self, e: E) -> List[str]:
        """The expression as lines: every node used more than once is bound once (``%k = ...``) and named
        after, so the text stays linear in the DAG's size; loads name their buffer."""
        uses: Dict[int, int] = {}
        order: List[E] = []
        stack = [(e, False)]
        seen = set()
        while stack:   # post-order, iteratively (deep chains of fused elementwise ops)
            x, done = stack.pop()
            if done:
                order.append(x)
                continue
            if x.uid in seen:
                continue
            seen.add(x.uid)
            stack.append((x, True))
            for a in reversed(x.args):
                uses[a.uid] = uses.get(a.uid, 0) + 1
                stack.append((a, False))
        bound: Dict[int, str] = {}
        text: Dict[int, str] = {}
        lines = []
        for x in order:
            if x.op == "var":
                s = self.var(x.attr)
            elif x.op == "const":
                s = f"{x.attr!r}:{x.dtype.name}"
            else:
                args = ", ".join(bound.get(a.uid) or text[a.uid] for a in x.args)
                head = f"{x.op}[{self.attr(x.attr)}]" if x.attr is not None else x.op
                s = f"{head}({args}):{x.dtype.name}"
            if uses.get(x.uid, 0) > 1 and x.op not in ("var", "const"):
                bound[x.uid] = f"%{len(bound)}"
                lines.append(f"    {bound[x.uid]} = {s}")
            else:
                text[x.uid] = s
        lines.append(f"    = {bound.get(e.uid) or text[e.uid]}")
        return lines


def format_stage(k: int, st: Stage) -> List[str]:
    """Stage ``k``: its name, op, buffer, region, work, variables, reads and expression."""
    pr = _StagePrinter(st)
    region = f" region={st.region}" if st.region is not None else ""
    head = (f"stage {k} {st.name} op={st.op} buf={_buf(st.buf)}{region} flops={st.flops} "
            f"vars=[{', '.join(pr.inline(v) for v in st.vars)}] reads=[{', '.join(b.name for b in st.reads)}]")
    return [head] + pr.expr(st.expr)


def format_schedule(s: Schedule) -> str:
    """Every stage of ``s`` (with its expression), the buffers and the memory plans, as text."""
    out = [f"inputs: {', '.join(_buf(b) for b in s.inputs)}", f"outputs: {', '.join(_buf(b) for b in s.outputs)}",
           f"symbols: {', '.join(f'{x.name}[{x.min},{x.max}]' for x in s.symbols) or '-'}",
           f"arena_bytes: {s.arena_bytes}", f"weights_bytes: {s.weights_bytes}",
           f"weights_sha256: {hashlib.sha256(s.weights_blob()).hexdigest()}",
           f"fused: {sorted(s.fused.items())}"]
    out += [f"weight {_buf(b)}" for b, _ in s.weights]
    for k, st in enumerate(s.stages):
        out += format_stage(k, st)
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- capture
@contextlib.contextmanager
def _patched(obj, name: str, value) -> Iterator[None]:
    if not hasattr(obj, name):
        raise RuntimeError(f"process replay: {obj.__name__}.{name} is gone; update SEAMS in {__name__}")
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def _scratch_tempdir() -> Iterator[None]:
    """``Pipeline.compile(cache=False)`` makes its output directory before it builds: keep it out of /tmp."""
    old = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="cuvil-replay-") as tmp:
        tempfile.tempdir = tmp
        try:
            yield
        finally:
            tempfile.tempdir = old


def _capture(p: Pipeline, seam_of: str, **compile_kw) -> Tuple[Schedule, str]:
    """``p.compile(**compile_kw)`` with the seam of ``seam_of`` (:data:`SEAMS`) intercepted: the schedule
    the seam is called with and the LLVM IR text it hands to LLVM; nothing after that runs."""
    seam_mod, seam = SEAMS[seam_of]
    real = getattr(seam_mod, seam)
    got: dict = {}

    def parse_assembly(text, *a, **kw):
        got["ir"] = text
        raise _Stop

    def compile_parts(km, *a, **kw):
        # x86 hands LLVM one module per kernel (for progress kernel by kernel): the snapshot is the whole
        # module, before it is cut
        got["ir"] = km.ir_text()
        raise _Stop

    def intercepted(sched, *a, **kw):
        got["schedule"] = sched
        with _patched(llvm, "parse_assembly", parse_assembly), \
                _patched(X86KernelModule, "compile_parts", compile_parts):
            return real(sched, *a, **kw)

    with _patched(seam_mod, seam, intercepted), _scratch_tempdir(), contextlib.suppress(_Stop):
        p.compile(cache=False, **compile_kw)
    if "ir" not in got:
        raise RuntimeError(f"process replay: the {seam_of} compile path never reached LLVM (see SEAMS)")
    return got["schedule"], got["ir"]


def _x86_snapshot(p: Pipeline) -> str:
    sched, ir = _capture(p, "x86", target=X86_TARGET, cpu=X86_CPU)
    return f"# x86 {X86_CPU}\n# schedule\n{format_schedule(sched)}# llvm ir (before optimisation)\n{ir}"


def _ptx_snapshot(p: Pipeline) -> str:
    sched, ir = _capture(p, "ptx", target=PTX_TARGET, arch=PTX_ARCH)
    return (f"# ptx {PTX_ARCH}\n# schedule\n{format_schedule(sched)}"
            f"# nvptx llvm ir (before optimisation and libdevice)\n{ir}")


_SNAPSHOTS = {"x86": _x86_snapshot, "ptx": _ptx_snapshot}


def snapshot(model: str, target: str) -> str:
    """The snapshot text of ``model`` (one of :data:`MODELS`) for ``target`` (one of :data:`TARGETS`)."""
    return _model_snapshots(model, [target])[target]


def _model_snapshots(model: str, targets: List[str]) -> Dict[str, str]:
    for t in targets:
        if t not in _SNAPSHOTS:
            raise ValueError(f"unknown replay target {t!r}; choose from {', '.join(TARGETS)}")
    p = load_pipeline(model)
    return {t: _SNAPSHOTS[t](p) for t in targets}


#: CPU seconds of a model's two snapshots (2-core Zen 5): the longest are started first.
COST = {"densenet121": 25, "inception_v1": 13, "resnet50": 12, "shufflenet": 6, "squeezenet": 5, TRANSFORMER: 1}


def take_snapshots(cases: List[Tuple[str, str]], jobs: Optional[int] = None) -> Dict[Tuple[str, str], str]:
    """The snapshots of ``cases`` ((model, target) pairs), one model per worker process (``jobs``, default
    $CUVIL_REPLAY_JOBS, else the CPU count): all six models take about 60 CPU seconds."""
    by_model: Dict[str, List[str]] = {}
    for m, t in cases:
        by_model.setdefault(m, []).append(t)
    order = sorted(by_model, key=lambda m: -COST.get(m, 0))
    jobs = min(jobs or int(os.environ.get("CUVIL_REPLAY_JOBS", 0)) or os.cpu_count() or 1, len(order))
    if jobs <= 1:
        done = {m: _model_snapshots(m, by_model[m]) for m in order}
    else:   # spawned, not forked: LLVM is initialised in this process
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {m: pool.submit(_model_snapshots, m, by_model[m]) for m in order}
            done = {m: f.result() for m, f in futures.items()}
    return {(m, t): done[m][t] for m, t in cases}


# ---------------------------------------------------------------------------------------------- goldens
def golden_path(model: str, target: str, directory: str = GOLDEN_DIR) -> str:
    return os.path.join(directory, f"{model}.{target}.txt.xz")


def write_golden(path: str, text: str) -> None:
    """xz-compressed (the format has no time stamp: the same text gives the same bytes). xz, not gzip: the
    IR repeats itself over megabytes (one micro-kernel per convolution), beyond gzip's 32 KB window; a
    DenseNet-121 x86 snapshot is 2.5 MB as gzip -9 and 0.2 MB as xz."""
    data = lzma.compress(text.encode("utf-8"), format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=6)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def read_golden(path: str) -> Optional[str]:
    """The golden text at ``path``, or None when there is none."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return lzma.decompress(f.read()).decode("utf-8")


def diff(expected: str, actual: str, name: str, limit: Optional[int] = 80) -> str:
    """A unified diff (golden -> now), cut to ``limit`` lines, with the first changed stage or function."""
    lines = list(difflib.unified_diff(expected.splitlines(), actual.splitlines(), f"golden/{name}", f"now/{name}",
                                      lineterm="", n=3))
    changed = _first_changed_unit(expected, actual)
    head = [f"{name}: first change in {changed}"] if changed else []
    if limit is not None and len(lines) > limit:
        lines = lines[:limit] + [f"... ({len(lines) - limit} more diff lines: "
                                 f"python -m cuvil.testing.replay --diff {name})"]
    return "\n".join(head + lines)


_UNIT = re.compile(r"^(stage \d+ \S+|define [^@]*@\"?[\w.$]+\"?)")


def _first_changed_unit(expected: str, actual: str) -> Optional[str]:
    """The stage or LLVM function holding the first differing line."""
    unit = None
    for a, b in zip(expected.splitlines() + [""], actual.splitlines() + [""]):
        m = _UNIT.match(a)
        if m:
            unit = m.group(1)
        if a != b:
            return unit or "the header"
    return None


def check(cases: List[Tuple[str, str]], directory: str = GOLDEN_DIR, limit: Optional[int] = 80,
          jobs: Optional[int] = None) -> Dict[Tuple[str, str], Optional[str]]:
    """For each case, None when its snapshot equals its golden, else a message with the diff."""
    now = take_snapshots(cases, jobs)
    out = {}
    for (model, target), actual in now.items():
        name = f"{model}.{target}"
        expected = read_golden(golden_path(model, target, directory))
        if expected is None:
            out[model, target] = f"{name}: no golden at {golden_path(model, target, directory)}"
        else:
            out[model, target] = None if actual == expected else diff(expected, actual, name, limit)
    return out


def _cases(names: List[str]) -> List[Tuple[str, str]]:
    all_cases = [(m, t) for m in MODELS for t in TARGETS]
    if not names:
        return all_cases
    out = []
    for n in names:
        picked = [(m, t) for m, t in all_cases if n in (m, f"{m}.{t}")]
        if not picked:
            raise SystemExit(f"unknown snapshot {n!r}: give MODEL or MODEL.TARGET "
                             f"({', '.join(MODELS)}; {', '.join(TARGETS)})")
        out += picked
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cuvil.testing.replay", description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="compare with the goldens; print a diff per mismatch")
    mode.add_argument("--update", action="store_true", help="rewrite the goldens from the current code")
    mode.add_argument("--diff", action="store_true", help="like --check, with the full diff")
    ap.add_argument("snapshots", nargs="*", help="MODEL or MODEL.TARGET (default: all)")
    ap.add_argument("--dir", default=GOLDEN_DIR, help="golden directory (default: tests/golden/replay)")
    ap.add_argument("--jobs", type=int, default=None, help="worker processes (default: the CPU count)")
    args = ap.parse_args(argv)
    cases = _cases(args.snapshots)
    if args.update:
        for (model, target), text in take_snapshots(cases, args.jobs).items():
            path = golden_path(model, target, args.dir)
            write_golden(path, text)
            print(f"wrote {path} ({len(text)} chars, {os.path.getsize(path)} bytes)")
        return 0
    failed = 0
    for (model, target), msg in check(cases, args.dir, None if args.diff else 80, args.jobs).items():
        print(f"{model}.{target}: {'ok' if msg is None else 'CHANGED'}")
        if msg:
            failed += 1
            print(msg)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

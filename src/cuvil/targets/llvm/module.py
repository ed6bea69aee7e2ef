"""The kernel module skeleton: one llvmlite module of kernels for a target machine, the declarations its
kernels share, loop metadata, and LLVM's one-time initialisation."""
from __future__ import annotations

import functools
import re
from typing import Dict, List, Optional, Sequence, Set

import llvmlite.binding as llvm
import llvmlite.ir as ir

from ...kernels.schedule import Stage
from .types import I1


@functools.cache
def initialize_native() -> None:
    """Initialise LLVM's host target (once)."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()


@functools.cache
def initialize_all() -> None:
    """Initialise every target LLVM was built with (once): NVPTX is not the host."""
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()


_LOOP_SELF = "cuvil.loop."
_LOOP_ID = re.compile(r'^(!\d+) = !\{ ?!"' + re.escape(_LOOP_SELF) + r'\d+", ', re.M)


def self_referential_loops(text: str) -> str:
    """``!7 = !{!"cuvil.loop.3", !6}`` -> ``!7 = distinct !{!7, !6}``: llvmlite cannot build a node that
    names itself."""
    return _LOOP_ID.sub(lambda m: f"{m.group(1)} = distinct !{{{m.group(1)}, ", text)


class LLVMKernelModule:
    """An llvmlite module for the target machine ``tm``; each backend's kernel module extends it with its
    kernel signature and stage shapes. ``dims_index`` / ``symbol_slots``: where a kernel finds the run-time
    values of shape symbols (the emitter's ``symbol``), None / empty for static shapes."""

    def __init__(self, name: str, tm, triple: str):
        self.module = ir.Module(name=name)
        self.module.triple = triple
        self.module.data_layout = str(tm.target_data)
        self.tm = tm
        self._decls: Dict[str, ir.Function] = {}
        self._loops = 0
        self.scratch_bytes = 0   # scratch the kernels need (per thread on x86, after the arena on the GPU)
        self.dims_index: Optional[int] = None   # bufs slot of the run-time symbol values (int64[])
        self.symbol_slots: Dict[str, int] = {}  # symbol -> its index in that array

    def loop_id(self, *flags: str) -> ir.Value:
        """A fresh ``llvm.loop`` node with boolean hints ``flags``; made self-referential (``distinct
        !{!self, ...}``, as LLVM requires of loop IDs) when the module is printed, see :meth:`ir_text`."""
        self._loops += 1
        hints = [self.module.add_metadata([ir.MetaDataString(self.module, f), I1(1)]) for f in flags]
        return self.module.add_metadata([ir.MetaDataString(self.module, f"{_LOOP_SELF}{self._loops}")] + hints)

    def declare(self, name: str, ret: ir.Type, args: Sequence[ir.Type]) -> ir.Function:
        """The function ``name`` (an intrinsic or library call), declared once per module."""
        if name not in self._decls:     # (one a helper declared straight into the module is reused)
            known = self.module.globals.get(name)
            self._decls[name] = known if known is not None else ir.Function(
                self.module, ir.FunctionType(ret, list(args)), name=name)
        return self._decls[name]

    def function(self, sym: str, args: Sequence[ir.Type]) -> ir.Function:
        """A new kernel function ``void sym(ptr bufs, ...)``; ``bufs`` (the buffer table) aliases nothing."""
        fn = ir.Function(self.module, ir.FunctionType(ir.VoidType(), list(args)), name=sym)
        fn.args[0].add_attribute("noalias")
        return fn

    def loop_shape(self, st: Stage) -> List:
        """The extents a generic loop nest runs over: the stage's buffer, its region's axis cut to the slice."""
        shape = list(st.buf.shape)
        if st.region is not None:    # the stage writes the slice [lo, hi) of one axis of its buffer
            axis, lo, hi = st.region
            shape[axis] = hi - lo
        return shape

    def ir_text(self) -> str:
        """The module's LLVM IR as text LLVM parses (loop IDs made self-referential)."""
        return self_referential_loops(str(self.module))

    def part_text(self, functions: Set[str]) -> str:
        """:meth:`ir_text` of a module holding only the kernels named ``functions`` (and every declaration and
        metadata node: LLVM drops those a part does not use). A part may call only kernels inside it."""
        m = self.module
        lines = [f'; ModuleID = "{m.name}"', f'target triple = "{m.triple}"',
                 f'target datalayout = "{m.data_layout}"', ""]
        lines += [t.get_declaration() for t in m.get_identified_types().values()]
        lines += [str(v) for v in m.globals.values()
                  if not isinstance(v, ir.Function) or v.is_declaration or v.name in functions]
        lines += [f"!{name} = !{{ {', '.join(op.get_reference() for op in md.operands)} }}"
                  for name, md in m.namedmetadata.items()]
        lines += [str(md) for md in m.metadata]
        return self_referential_loops("\n".join(lines))

"""The LLVM layer both backends build on: LLVM types and constants of Cuvil dtypes (``types``), the kernel
module skeleton (``module``: declarations, loop metadata, LLVM initialisation) and the emitter that turns a
tensor expression into LLVM IR (``emitter``), with hooks each target fills in (math calls, buffer bases).
``targets/x86`` and ``targets/ptx`` import it and never each other."""

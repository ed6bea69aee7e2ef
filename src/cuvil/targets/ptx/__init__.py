"""The GPU backend: scheduled stages lowered through llvmlite's NVPTX backend to PTX (one kernel per stage),
checked with ``ptxas`` where the CUDA toolkit is installed."""
from .codegen import KernelDesc, find_libdevice, generate_ptx
from .ptxas import KernelInfo, PtxasError, assemble, find_ptxas

__all__ = ["KernelDesc", "generate_ptx", "find_libdevice", "KernelInfo", "PtxasError", "assemble", "find_ptxas"]

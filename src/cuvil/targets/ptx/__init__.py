"""The GPU backend: scheduled stages lowered through llvmlite's NVPTX backend to PTX (one kernel per stage),
checked with ``ptxas`` where the CUDA toolkit is installed, written as a bundle directory (``bundle``) and
run through CUDA graphs on the driver API (``runtime``; cuda-python is imported only when a model loads)."""
from .bundle import compile_bundle, read_bundle
from .codegen import KernelDesc, generate_ptx
from .libdevice import find_libdevice
from .ptxas import KernelInfo, PtxasError, assemble, find_ptxas
from .runtime import CudaError, GpuModel, NoGpuError, load_bundle

__all__ = ["KernelDesc", "generate_ptx", "find_libdevice", "KernelInfo", "PtxasError", "assemble", "find_ptxas",
           "compile_bundle", "read_bundle", "GpuModel", "NoGpuError", "CudaError", "load_bundle"]

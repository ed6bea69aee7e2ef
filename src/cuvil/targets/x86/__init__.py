"""The x86-64 backend: llvmlite kernels, the C runtime, linking, the ctypes loader."""

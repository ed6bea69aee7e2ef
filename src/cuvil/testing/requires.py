"""pytest markers for tests that need a GPU or the CUDA toolkit: each skips with the reason printed (what is
missing and why), so a machine without them stays green and says what it did not run. Needs pytest (the
``test`` extra)::

    from cuvil.testing.requires import needs_gpu, needs_ptxas

    @needs_ptxas
    def test_my_bundle_assembles(): ...
"""
from typing import Optional

import pytest

from ..targets.ptx import find_libdevice, find_ptxas
from ..targets.ptx import runtime as rt


def gpu_missing() -> Optional[str]:
    """Why no CUDA GPU can be used here (the driver's or cuda-python's own words), or None when one can."""
    try:
        rt.driver()
    except rt.NoGpuError as e:
        return str(e)
    return None


#: Looked up once per process: every test module that asks gets the same answer.
NO_GPU = gpu_missing()
PTXAS = find_ptxas()
LIBDEVICE = find_libdevice()

needs_gpu = pytest.mark.skipif(NO_GPU is not None, reason=f"needs a CUDA GPU ({NO_GPU})")
needs_ptxas = pytest.mark.skipif(PTXAS is None, reason="ptxas not found (no CUDA toolkit): PTX cannot be assembled here")
needs_libdevice = pytest.mark.skipif(LIBDEVICE is None, reason="libdevice.10.bc not found (no CUDA toolkit)")

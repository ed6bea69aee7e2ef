"""Compile an ONNX model into a PTX bundle with chosen :class:`~cuvil.targets.ptx.tuning.PtxTuning` options
and run it once: the A/B helper of the GPU kernel tests (a kernel option on against off, the same feeds).
Needs a CUDA GPU at run time (pair it with :data:`cuvil.testing.requires.needs_gpu`)::

    y_new = run_ptx_bundle(model, feeds, tmp_path / "new")
    y_old = run_ptx_bundle(model, feeds, tmp_path / "old", scaled_operands=False)
"""
import os

from ..pipeline import Pipeline
from ..targets.ptx.tuning import PtxTuning


def run_ptx_bundle(model, feeds, out_dir, *, fma: bool = True, enable_fp16: bool = False, **tuning):
    """The first output of ``model`` on ``feeds``, compiled into the bundle directory ``out_dir`` with
    ``fma`` contraction, float16 compute where ``enable_fp16`` and ``PtxTuning(**tuning)``; the loaded bundle
    is closed before returning."""
    from ..targets.ptx.bundle import compile_bundle
    from ..targets.ptx.runtime import load_bundle
    path = os.fspath(out_dir)
    compile_bundle(Pipeline.from_onnx(model).optimize().graph, path, fma=fma, enable_fp16=enable_fp16,
                   tuning=PtxTuning(**tuning))
    m = load_bundle(path)
    try:
        return m.run(*feeds)[0]
    finally:
        m.close()

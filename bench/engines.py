"""The peer engines of bench/run_all.py, each as a no-argument callable that runs one inference on fixed inputs:
onnxruntime (CPU provider) and OpenVINO in float32 (``INFERENCE_PRECISION_HINT=f32``: on CPUs with AMX or
AVX512-BF16 OpenVINO would otherwise run in bf16), both with the thread count given. OpenVINO is optional
(``pip install openvino``, or the ``bench`` extra): :func:`openvino_version` is None without it.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import numpy as np


def openvino_version() -> Optional[str]:
    try:
        import openvino
    except ImportError:
        return None
    return openvino.__version__


OPENVINO_MISSING = "openvino is not installed (pip install openvino, or pip install 'cuvil[bench]')"


def ort_session(model, threads: int):
    """``model``: an ``onnx.ModelProto`` or a path; onnxruntime with ``threads`` intra-op threads, one inter-op."""
    import onnx
    import onnxruntime as ort

    from cuvil.testing.oracles import ort_session as session
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return session(onnx.load(model) if isinstance(model, str) else model, so)


def ort_runner(sess, feeds: Dict[str, np.ndarray]) -> Callable[[], list]:
    used = {i.name for i in sess.get_inputs()}
    feeds = {k: v for k, v in feeds.items() if k in used}
    return lambda: sess.run(None, feeds)


def openvino_compiled(onnx_path: str, threads: int):
    """OpenVINO's CPU plugin on ``onnx_path``: float32, ``threads`` inference threads, latency mode."""
    import openvino as ov
    core = ov.Core()
    model = core.read_model(onnx_path)
    return core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads,
                                             "PERFORMANCE_HINT": "LATENCY"})


def openvino_runner(compiled, feeds: Dict[str, np.ndarray]) -> Callable[[], list]:
    """One infer request of ``compiled`` over ``feeds`` (by input name; inputs shared, not copied, as
    onnxruntime reads numpy arrays in place); returns the outputs in the model's order."""
    req = compiled.create_infer_request()
    names = [i.get_any_name() for i in compiled.inputs]
    missing = [n for n in names if n not in feeds]
    if missing:
        raise KeyError(f"OpenVINO's model has inputs {names}; no data for {missing}")
    mine = {n: np.ascontiguousarray(feeds[n]) for n in names}

    def run():
        res = req.infer(mine, share_inputs=True)
        return [res[o] for o in compiled.outputs]
    return run


def openvino_peer(onnx_path: str, threads: int, names: List[str], arrays: List[np.ndarray]):
    """The ``peers`` factory of :class:`cuvil.bench.BenchOptions`: inputs by the library's names, else by
    position (a CNN's single input)."""
    compiled = openvino_compiled(onnx_path, threads)
    feeds = dict(zip(names, arrays))
    inputs = [i.get_any_name() for i in compiled.inputs]
    if set(inputs) != set(names) and len(inputs) == len(arrays):
        feeds = dict(zip(inputs, arrays))
    return openvino_runner(compiled, feeds)


def time_blocks(engines: Dict[str, Callable[[], object]], blocks: int, per: int,
                clock: Callable[[], float] = None, log: Callable[[int, Dict[str, List[float]]], None] = None
                ) -> Dict[str, List[float]]:
    """Blocks of ``per`` runs of each engine, the engines' order reversed every other block; per engine the
    median of each block in ms (``clock``: time.perf_counter by default, time.thread_time for the calling
    thread's CPU time). ``log(block, results)`` after each block."""
    import statistics
    import time
    clock = clock or time.perf_counter
    res: Dict[str, List[float]] = {k: [] for k in engines}
    for blk in range(blocks):
        for name in (list(engines) if blk % 2 == 0 else list(engines)[::-1]):
            ts = []
            for _ in range(per):
                t0 = clock()
                engines[name]()
                ts.append(clock() - t0)
            res[name].append(statistics.median(ts) * 1e3)
        if log is not None:
            log(blk, res)
    return res

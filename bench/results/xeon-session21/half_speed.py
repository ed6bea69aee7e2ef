import numpy as np, onnx, sys, time, warnings
warnings.filterwarnings("ignore")
from onnxconverter_common import float16
import onnxruntime as ort
from cuvil import Pipeline
S = int(sys.argv[2]) if len(sys.argv) > 2 else 128
name = sys.argv[1]
m = onnx.load(f"tests/fixtures/exports/{name}.onnx")
h = float16.convert_float_to_float16(m, keep_io_types=False)
rng = np.random.default_rng(0)
def feeds_of(model, half):
    f = {}
    for i in model.graph.input:
        dims = [d.dim_value or (1 if k == 0 else S) for k, d in enumerate(i.type.tensor_type.shape.dim)]
        if i.type.tensor_type.elem_type == onnx.TensorProto.INT64:
            f[i.name] = (np.ones(dims) if "mask" in i.name else np.zeros(dims) if "type" in i.name else rng.integers(0, 100, dims)).astype(np.int64)
        else:
            f[i.name] = rng.standard_normal(dims).astype(np.float16 if half else np.float32)
    return f
for label, model, half in (("fp32", m, False), ("fp16", h, True)):
    feeds = feeds_of(model, half)
    art = Pipeline.from_onnx(model).optimize().compile(input_shapes={k: list(v.shape) for k, v in feeds.items()})
    mod = art.model(); xs = [feeds[i.name] for i in model.graph.input]
    so = ort.SessionOptions(); so.intra_op_num_threads = 1
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    def t_(f, n=10):
        f(); t = time.perf_counter()
        for _ in range(n): f()
        return (time.perf_counter() - t) / n * 1e3
    tc = t_(lambda: mod.run(*xs, num_threads=1)); to = t_(lambda: s.run(None, feeds))
    prof = mod.profile(*xs, runs=5, num_threads=1)
    steps = art.manifest["steps"]
    by = {}
    for st, tt in zip(steps, prof):
        k = f"{st.get('op')}/{st.get('kernel')}"; by[k] = by.get(k, 0) + tt
    top = sorted(by.items(), key=lambda kv: -kv[1])[:5]
    print(f"{name} S={S} {label}: cuvil {tc:.2f} ms, ort {to:.2f} ms; top: " + ", ".join(f"{k} {v*1e3:.2f}" for k, v in top))

"""A float16 model's MatMul (768 -> 3072, constant float16 weights) beside the float32 one, Cuvil and
onnxruntime at 1 thread, median of 7 alternating blocks of 10 calls (session 21; run from the checkout with
PYTHONPATH=src). Before session 21 the float16 product was a loop nest."""
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.targets.x86.cpu import cpu_label

print(cpu_label())
rng = np.random.default_rng(0)
K, N = 768, 3072
for dt, npdt in ((TensorProto.FLOAT, np.float32), (TensorProto.FLOAT16, np.float16)):
    W = numpy_helper.from_array((rng.standard_normal((K, N)) * 0.05).astype(npdt), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", dt, ["S", K])], [helper.make_tensor_value_info("y", dt, ["S", N])], [W])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    art = Pipeline.from_onnx(m).optimize().compile(shape_profiles={"S": (1, 128, 512)})
    mod = art.model()
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    for s in (1, 128):
        x = rng.standard_normal((s, K)).astype(npdt)
        y = mod.run(x, num_threads=1)[0]
        ref = x.astype(np.float64) @ numpy_helper.to_array(W).astype(np.float64)
        blocks = {"cuvil": [], "ort": []}
        for i in range(7):
            for name, f in (("cuvil", lambda: mod.run(x, num_threads=1)), ("ort", lambda: sess.run(None, {"x": x}))):
                t = time.perf_counter()
                for _ in range(10):
                    f()
                blocks[name].append((time.perf_counter() - t) / 10 * 1e3)
        kinds = [st.get("kernel") for st in art.manifest["steps"] if st.get("variant", "generic") == "generic"]
        print(f"{np.dtype(npdt).name} S={s}: cuvil {np.median(blocks['cuvil']):.3f} ms, onnxruntime {np.median(blocks['ort']):.3f} ms, "
              f"rel err {np.abs(y - ref).max() / np.abs(ref).max():.2e}, kernels {kinds}")

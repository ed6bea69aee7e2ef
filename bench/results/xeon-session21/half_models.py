import numpy as np, time, sys
from onnxconverter_common import float16
import onnxruntime as ort
from cuvil import Pipeline
from cuvil.testing import light_model
from cuvil.targets.x86.cpu import cpu_label
print(cpu_label())
for name in sys.argv[1:]:
    m = light_model(name, seed=0)
    h = float16.convert_float_to_float16(m, keep_io_types=False)
    t=time.time(); art = Pipeline.from_onnx(h).optimize().compile(); ct=time.time()-t
    kinds = {}
    for s in art.manifest["steps"]:
        if s.get("variant","generic") in ("generic",):
            kinds[s["kernel"]] = kinds.get(s["kernel"],0)+1
    x = np.random.default_rng(0).standard_normal([d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)
    mod = art.model()
    y = mod.run(x.astype(np.float16), num_threads=1)[0].astype(np.float64)
    s32 = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    so=ort.SessionOptions(); so.intra_op_num_threads=1
    s16 = ort.InferenceSession(h.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ref = s32.run(None, {m.graph.input[0].name: x})[0].astype(np.float64)
    r16 = s16.run(None, {m.graph.input[0].name: x.astype(np.float16)})[0].astype(np.float64)
    def t_(f, n=5):
        f(); t=time.perf_counter()
        for _ in range(n): f()
        return (time.perf_counter()-t)/n*1e3
    tc = t_(lambda: mod.run(x.astype(np.float16), num_threads=1)); to = t_(lambda: s16.run(None, {m.graph.input[0].name: x.astype(np.float16)}))
    print(f"{name}: compile {ct:.0f}s kernels {kinds}; cuvil fp16 {tc:.2f} ms, ort fp16 {to:.2f} ms; rel err vs fp32: cuvil {np.abs(y-ref).max()/np.abs(ref).max():.2e}, ort fp16 {np.abs(r16-ref).max()/np.abs(ref).max():.2e}; argmax equal {int(y.argmax())==int(ref.argmax())}")

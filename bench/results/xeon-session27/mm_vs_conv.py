"""bf16 on AMX: a 7x7-stage 1x1 convolution (512 -> 2048 and 2048 -> 512 at 7x7) against the same product as a
MatMul over the 49 positions (x[1, 49, C] @ W[C, M]), each narrowed to bf16 by hand, 1 thread, in-kernel and wall."""
import sys, time, numpy as np
sys.path.insert(0, "src")   # run from the repository root: python3 bench/results/xeon-session27/mm_vs_conv.py
from onnx import helper, TensorProto, numpy_helper
from cuvil import Pipeline
from cuvil.targets.x86.loader import load

def conv(c, m):
    w = numpy_helper.from_array((np.random.default_rng(0).standard_normal((m, c, 1, 1)) * 0.02).astype(np.float32), "W")
    g = helper.make_graph([helper.make_node("Conv", ["x", "W"], ["y"])], "c",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 7, 7])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, m, 7, 7])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), (1, c, 7, 7)

def mm(c, m):
    w = numpy_helper.from_array((np.random.default_rng(0).standard_normal((c, m)) * 0.02).astype(np.float32), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "m",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 49, c])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 49, m])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), (1, 49, c)

def build(model):
    p = Pipeline.from_onnx(model).optimize()
    for n in p.graph.nodes:
        if n.op in ("Conv", "MatMul"):
            n.precision = "bf16"
    lib = p.compile(cache=False)
    return load(lib.path, num_threads=1), lib.manifest

big = np.zeros(64 << 20, np.uint8)   # 64 MB to evict the weights between calls (as in the model, where 51 MB stream)
for c, m in ((512, 2048), (2048, 512)):
    libs = {}
    for name, (model, shape) in (("conv", conv(c, m)), ("matmul", mm(c, m))):
        lib, man = build(model)
        x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        libs[name] = (lib, x, [s.get("kernel") for s in man["steps"]], [s.get("path") for s in man["steps"]])
    res = {k: [] for k in libs}
    for r in range(15):
        for k, (lib, x, _, _) in libs.items():
            big.view(np.uint64).sum()   # read 64 MB: the weights are cold, as in a whole-model run
            t = time.perf_counter(); lib.run(x, num_threads=1); res[k].append(time.perf_counter() - t)
    for k, (lib, x, kinds, paths) in libs.items():
        ms = 1e3 * np.median(res[k])
        print(f"{c}->{m} at 7x7 as {k:6s}: {ms:.3f} ms ({c * m * 2 / 1e6:.1f} MB weights: {c * m * 2 / ms / 1e6:.1f} GB/s) kernels {kinds} {paths}")

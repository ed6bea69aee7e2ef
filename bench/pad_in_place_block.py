"""A/B of producers writing into their 3x3 reader's padded buffer (X86Tuning(pad_in_place=True)) against the
padded copy (the default), on ResNet-50's stage-1 bottleneck (1x1 256->64, 3x3 64->64, 1x1 64->256, bf16 on the
host's bf16 kernels, 56x56, batch 1), one process, libraries alternated per round: each step's in-kernel time,
best of ROUNDS rounds (5 runs each), 1 thread.

    PYTHONPATH=src python3 bench/pad_in_place_block.py [ROUNDS]
"""
import sys
import numpy as np
from onnx import TensorProto, helper, numpy_helper
from cuvil import Pipeline
from cuvil.targets.x86.tuning import X86Tuning
from cuvil.targets.x86.loader import load
from cuvil.targets.x86.cpu import cpu_label

def model(cin=256, mid=64, hw=56):
    rng = np.random.default_rng(0)
    inits, nodes = [], []
    def conv(name, x, ci, co, k):
        w = (rng.standard_normal((co, ci, k, k)) * np.sqrt(2.0 / (ci * k * k))).astype(np.float32)
        inits.extend([numpy_helper.from_array(w, name + "_w"), numpy_helper.from_array(np.zeros(co, np.float32), name + "_b")])
        nodes.append(helper.make_node("Conv", [x, name + "_w", name + "_b"], [name], kernel_shape=[k, k], pads=[k // 2] * 4))
        nodes.append(helper.make_node("Relu", [name], [name + "_r"]))
        return name + "_r"
    a = conv("a", "x", cin, mid, 1); b = conv("b", a, mid, mid, 3); c = conv("c", b, mid, cin, 1)
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, hw, hw])],
                          [helper.make_tensor_value_info(c, TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
m = model()
print(cpu_label(), '| load', __import__('os').getloadavg())
libs = {}
for lab, ip in (("copy", False), ("inplace", True)):
    art = Pipeline.from_onnx(m).optimize().compile(precision="bf16", input_ranges={"x": (-4, 4)}, tuning=X86Tuning(pad_in_place=ip))
    libs[lab] = (load(art.path, num_threads=1), art.manifest["steps"])
x = np.random.default_rng(1).uniform(-4, 4, (1, 256, 56, 56)).astype(np.float32)
prof = {k: [] for k in libs}
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 100):
    for k in (list(libs) if i % 2 == 0 else list(libs)[::-1]):
        prof[k].append(libs[k][0].profile(x, runs=5, num_threads=1))
for k, (lib, steps) in libs.items():
    mn = np.array(prof[k]).min(0) * 1e6
    print(k, " ".join(f"{s['kernel']}:{s.get('shape')}={t:.0f}us" for s, t in zip(steps, mn)), f"total={mn.sum():.0f}")

import numpy as np, time
from onnx import helper, TensorProto, numpy_helper
from cuvil import Pipeline
import onnxruntime as ort
rng=np.random.default_rng(0)
C,M,H=64,64,56
w=(rng.standard_normal((M,C,3,3))/24).astype(np.float16); b=rng.standard_normal(M).astype(np.float16)
g=helper.make_graph([helper.make_node("Conv",["x","w","b"],["c"],pads=[1,1,1,1],name="conv"),helper.make_node("Relu",["c"],["y"])],"g",
  [helper.make_tensor_value_info("x",TensorProto.FLOAT16,[1,C,H,H])],[helper.make_tensor_value_info("y",TensorProto.FLOAT16,[1,M,H,H])],
  [numpy_helper.from_array(w,"w"),numpy_helper.from_array(b,"b")])
m=helper.make_model(g,opset_imports=[helper.make_opsetid("",17)])
art=Pipeline.from_onnx(m).optimize().compile()
print([ (s["kernel"], s.get("stage")) for s in art.manifest["steps"]])
x=rng.standard_normal((1,C,H,H)).astype(np.float16)
mod=art.model(); y=mod.run(x,num_threads=1)[0]
xp=np.pad(x.astype(np.float64),[(0,0),(0,0),(1,1),(1,1)])
cols=np.stack([xp[0,:,i:i+H,j:j+H] for i in range(3) for j in range(3)],1).reshape(C*9,H*H)
ref=np.maximum((w.astype(np.float64).reshape(M,C*9)@cols+b.astype(np.float64)[:,None]).reshape(1,M,H,H),0)
print("max ulp-ish err", np.abs(y.astype(np.float64)-ref).max(), "vs |ref| max", np.abs(ref).max(), "mismatch vs rounded ref:", np.mean(y!=ref.astype(np.float16)))
t=time.perf_counter()
for _ in range(10): mod.run(x,num_threads=1)
print("cuvil ms", (time.perf_counter()-t)/10*1e3)
so=ort.SessionOptions(); so.intra_op_num_threads=1
s=ort.InferenceSession(m.SerializeToString(),so,providers=["CPUExecutionProvider"])
t=time.perf_counter()
for _ in range(10): s.run(None,{"x":x})
print("ort ms", (time.perf_counter()-t)/10*1e3)

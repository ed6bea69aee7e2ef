import numpy as np, time, ml_dtypes
from onnx import helper, TensorProto, numpy_helper
from cuvil import Pipeline
rng=np.random.default_rng(0)
bf=ml_dtypes.bfloat16
K,N=768,3072
W=(rng.standard_normal((K,N))*0.05).astype(bf)
Wt=helper.make_tensor("W",TensorProto.BFLOAT16,[K,N],W.view(np.uint16).tobytes(),raw=True)
g=helper.make_graph([helper.make_node("MatMul",["x","W"],["y"])],"g",[helper.make_tensor_value_info("x",TensorProto.BFLOAT16,["S",K])],[helper.make_tensor_value_info("y",TensorProto.BFLOAT16,["S",N])],[Wt])
m=helper.make_model(g,opset_imports=[helper.make_opsetid("",17)])
try:
    art=Pipeline.from_onnx(m).optimize().compile(shape_profiles={"S":(1,128,512)})
    mod=art.model()
    for s in (1,128):
        x=rng.standard_normal((s,K)).astype(bf)
        y=mod.run(x,num_threads=1)[0]
        ref=x.astype(np.float64)@W.astype(np.float64)
        t=time.perf_counter()
        for _ in range(5): mod.run(x,num_threads=1)
        print("bf16 matmul S",s,"%.2f ms"%((time.perf_counter()-t)/5*1e3),"rel err %.1e"%(np.abs(y.astype(np.float64)-ref).max()/np.abs(ref).max()),[st["kernel"] for st in art.manifest["steps"]][:3])
except Exception as e: print("matmul failed", type(e).__name__, str(e)[:300])
C,M,H=64,64,56
w=(rng.standard_normal((M,C,3,3))/24).astype(bf)
wt=helper.make_tensor("w",TensorProto.BFLOAT16,[M,C,3,3],w.view(np.uint16).tobytes(),raw=True)
g=helper.make_graph([helper.make_node("Conv",["x","w"],["y"],pads=[1,1,1,1])],"g",[helper.make_tensor_value_info("x",TensorProto.BFLOAT16,[1,C,H,H])],[helper.make_tensor_value_info("y",TensorProto.BFLOAT16,[1,M,H,H])],[wt])
m=helper.make_model(g,opset_imports=[helper.make_opsetid("",17)])
try:
    art=Pipeline.from_onnx(m).optimize().compile()
    x=rng.standard_normal((1,C,H,H)).astype(bf); mod=art.model(); y=mod.run(x,num_threads=1)[0]
    t=time.perf_counter()
    for _ in range(3): mod.run(x,num_threads=1)
    print("bf16 conv %.2f ms"%((time.perf_counter()-t)/3*1e3), [st["kernel"] for st in art.manifest["steps"]])
except Exception as e: print("conv failed", type(e).__name__, str(e)[:300])

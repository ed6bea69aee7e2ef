"""ptx/launch_deps.py: which kernels of a bundle may run at once, and the captured graph over several streams.

The dependencies are checked against an independent statement of the hazards (every pair of kernels whose bytes
conflict is ordered, through the transitively reduced lists), the stream assignment on random dependency graphs,
and the capture (through test_gpu_bundle's fake driver) by replaying its launches, event records and waits: a
launch may only be enqueued where everything it depends on is ordered before it on its stream."""
import random

import numpy as np
import pytest

from cuvil import Pipeline
from cuvil.errors import CuvilError
from cuvil.kernels.schedule import WEIGHTS
from cuvil.targets.ptx import runtime as rt
from cuvil.targets.ptx.bundle import read_bundle
from cuvil.targets.ptx.codegen import build_ptx, gpu_schedule
from cuvil.targets.ptx.tuning import DEFAULT_TUNING
from cuvil.targets.ptx.launch_deps import assign_streams, kernel_dependencies, launch_layout, touches_only_its_stages
from cuvil.testing import light_model
from cuvil.testing.hf_models import bert_model, gpt2_decode_model
from cuvil.testing.requires import needs_libdevice
from test_gpu_bundle import FakeDriver

TARGET = "nvptx64-nvidia-cuda"


@pytest.fixture(scope="module")
def bert_bundle():
    p = Pipeline.from_onnx(bert_model(vocab=101, hidden=64, layers=2, heads=2, ffn=128, max_pos=64)).optimize()
    return p.compile(TARGET, arch="sm_90", cache=False, fixed={"batch": 1, "sequence": 32})


def _ancestors(after):
    anc = []
    for deps in after:
        a = set()
        for d in deps:
            a |= anc[d] | {d}
        anc.append(a)
    return anc


@needs_libdevice
def test_q_k_v_products_wait_only_for_their_layernorm(bert_bundle):
    plan, man = read_bundle(bert_bundle.path)
    ks = plan["kernels"]
    anc = _ancestors([k["after"] for k in ks])
    for layer in range(2):
        qkv = [j for j, k in enumerate(ks) if k["stage"].startswith(f"encoder.layer.{layer}.attention.self.")]
        assert len(qkv) == 3, [k["stage"] for k in ks]
        # the three read the same LayerNorm output and write their own buffers: one wait each, none on another
        assert len({tuple(ks[j]["after"]) for j in qkv}) == 1 and len(ks[qkv[0]]["after"]) == 1
        assert not any(i in anc[j] for i in qkv for j in qkv)
        # ... and the scores product after them waits for (at least) Q and K
        later = [j for j in range(qkv[-1] + 1, len(ks)) if sum(i in anc[j] for i in qkv) >= 2]
        assert later
    assert man["launch_graph"]["widest_level"] >= 3
    assert man["launch_graph"]["critical_path"] < len(ks)


def _bytes(b):
    """(slot, first byte, past last byte) of a buffer as the test states it: its storage's range from the view's
    first element."""
    n = int(np.prod(b.shape)) * b.dtype.itemsize if b.pitch is None else \
        (sum((d - 1) * s for d, s in zip(b.shape, b.pitch)) + 1) * b.dtype.itemsize
    return b.base, b.offset, b.offset + n


@pytest.mark.parametrize("name", ["squeezenet", "inception_v1", "bert"])
def test_every_conflicting_pair_is_ordered(name):
    """Kernel j reads or writes bytes an earlier kernel i writes, or writes bytes i reads (the arena plan reuses
    the bytes of dead tensors): j must wait for i, directly or through the reduced lists; a kernel that may
    touch the shared scratch area (split-K) is ordered against every other."""
    if name == "bert":
        p = Pipeline.from_onnx(bert_model(vocab=101, hidden=64, layers=2, heads=2, ffn=128, max_pos=64)).optimize()
        g = p.specialize({"batch": 2, "sequence": 20}).optimize().graph
    else:
        g = Pipeline.from_onnx(light_model(name)).optimize().graph
    tuning = DEFAULT_TUNING.resolved(True)
    sched = gpu_schedule(g, tuning=tuning)
    res = build_ptx(sched, "sm_90", fma=True, tuning=tuning)
    kinds = [d.kind for d in res.kernels]
    read_only = {WEIGHTS} | {b.base for b in sched.inputs}
    after = kernel_dependencies(res.kernel_stages, kinds, read_only=sorted(read_only))
    assert after is not None and len(after) == len(kinds)
    anc = _ancestors(after)
    acc = []
    for sts in res.kernel_stages:
        r = [_bytes(b) for st in sts for b in st.reads if b.base not in read_only]
        w = [_bytes(st.buf) for st in sts]
        acc.append((r, w))

    def clash(a, b):
        return any(x[0] == y[0] and max(x[1], y[1]) < min(x[2], y[2]) for x in a for y in b)
    ordered = free = 0
    for j in range(len(kinds)):
        for i in range(j):
            must = (not touches_only_its_stages(kinds[i]) or not touches_only_its_stages(kinds[j])
                    or clash(acc[i][1], acc[j][0]) or clash(acc[i][1], acc[j][1]) or clash(acc[i][0], acc[j][1]))
            if must:
                assert i in anc[j], (i, j, res.kernels[i].stage, res.kernels[j].stage)
                ordered += 1
            elif i not in anc[j]:
                free += 1
    assert ordered and free, "the models have both dependent and independent kernels"


def _check_streams(after, where, waits):
    """Replay the assignment: a launch is enqueued on its stream after that stream's earlier launches and the
    launches it waits for; every dependency must be among them."""
    before = {}
    done_at = []
    for j, deps in enumerate(after):
        s = where[j]
        known = set(before.get(s, set()))
        for d in waits[j]:
            known |= done_at[d] | {d}
        assert set(deps) <= known, (j, deps, known)
        done_at.append(known)
        before[s] = known | {j}


def test_streams_honour_every_dependency():
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(1, 40)
        after = [sorted(rng.sample(range(j), k=min(j, rng.randint(0, 3)))) for j in range(n)]
        for streams in (1, 2, 4):
            where, waits = assign_streams(after, streams)
            assert all(0 <= s < streams for s in where)
            _check_streams(after, where, waits)
    # independent chains spread over streams; a chain stays on one stream without waits
    where, waits = assign_streams([[], [], [], [0], [1], [2], [3, 4, 5]], 4)
    assert where[:3] == [0, 1, 2] and where[3:6] == [0, 1, 2] and where[6] in (0, 1, 2)
    assert waits[:6] == [[]] * 6 and len(waits[6]) == 2


def test_a_kernel_without_work_passes_its_dependencies_on():
    ks = [{"after": []}, {"after": [0]}, {"after": [1]}, {"after": [0]}]
    where, waits, waited = launch_layout(ks, [ks[0], ks[2], ks[3]], 4)   # kernel 1 has no elements
    # kernel 2 (launch 1) waited for kernel 1, which waited for kernel 0 (launch 0)
    _check_streams([[], [0], [0]], where, waits)
    assert launch_layout(ks, ks, 1) is None and launch_layout([{"n": 1}], [{"n": 1}], 4) is None


@needs_libdevice
def test_capture_over_streams_orders_every_dependency(bert_bundle, monkeypatch):
    plan, _ = read_bundle(bert_bundle.path)
    ks = plan["kernels"]
    names = [k["name"] for k in ks]
    x = {"input_ids": np.ones((1, 32), np.int64), "attention_mask": np.ones((1, 32), np.int64),
         "token_type_ids": np.zeros((1, 32), np.int64)}
    for streams in (4, 1):
        drv = FakeDriver()
        monkeypatch.setattr(rt, "driver", lambda: drv)
        m = rt.load_bundle(bert_bundle.path, streams=streams)
        m.run(x)
        at = [i for i, e in enumerate(drv.order) if e[0] == "launch"]
        assert [drv.order[i][2] for i in at] == names * 2     # the eager pass, then the capture
        main = drv.order[at[0]][1]
        assert all(drv.order[i][1] == main for i in at[:len(ks)])
        # replay the capture (after the eager pass's last launch): what each stream is ordered after
        before, state, j = {main: set()}, {}, 0
        for e in drv.order[at[len(ks) - 1] + 1:]:
            if e[0] == "launch":
                s = e[1]
                assert set(ks[j]["after"]) <= before.get(s, set()), (j, ks[j]["stage"])
                before[s] = before.get(s, set()) | {j}
                j += 1
            elif e[0] == "record":
                state[id(e[1])] = set(before.get(e[2], set()))
            else:
                before[e[1]] = before.get(e[1], set()) | state.get(id(e[2]), set())
        assert j == len(ks) and before[main] == set(range(len(ks))), "every stream joined the caller's at the end"
        used = {drv.order[i][1] for i in at[len(ks):]}
        assert (len(used) > 1) == (streams > 1)
        # streams and events are made before the capture begins, never inside it
        b, e = drv.calls.index("cuStreamBeginCapture"), drv.calls.index("cuStreamEndCapture")
        assert not {"cuStreamCreate", "cuEventCreate"} & set(drv.calls[b:e])
        m.close()
        assert drv.calls.count("cuStreamDestroy") == len(used)
        assert drv.calls.count("cuEventDestroy") == drv.calls.count("cuEventCreate") >= (3 if streams > 1 else 1)


@needs_libdevice
def test_run_device_outputs_may_not_overlap_inputs_or_outputs(bert_bundle, monkeypatch):
    drv = FakeDriver()
    monkeypatch.setattr(rt, "driver", lambda: drv)
    m = rt.load_bundle(bert_bundle.path)
    try:
        ins = [int(drv.cuMemAlloc(1 << 16)[1]) for _ in m.inputs]
        outs = [int(drv.cuMemAlloc(1 << 16)[1]) for _ in m.outputs]
        m.run_device(ins, outs)
        with pytest.raises(CuvilError, match=r"output 'last_hidden_state' .* overlaps input 'input_ids'"):
            m.run_device(ins, [ins[0] + 8] + outs[1:])
        with pytest.raises(CuvilError, match="overlaps output"):
            m.run_device(ins, [outs[0], outs[0] + 16])
        m.run_device([ins[0]] * len(ins), outs)      # inputs may share memory: they are only read
    finally:
        m.close()


def test_a_damaged_plan_is_refused_naming_the_kernel():
    for bad in ([1], [-1], ["0"], 0, [True]):
        ks = [{"name": "k0", "after": []}, {"name": "k1", "after": bad}]
        with pytest.raises(CuvilError, match=r"kernel 1 \(k1\) has \"after\""):
            launch_layout(ks, ks, 4)


@pytest.mark.parametrize("name", ["inception_v1", "bert_fp16", "bert_tf32", "gpt2_decode"])
def test_every_proved_access_lies_in_its_kernels_bytes(name, monkeypatch):
    """Not the sets the dependencies are built from: every access the memory-safety proof bounds (the kernels'
    own patterns too: tensor-core tiles, implicit-GEMM windows, attention partials) lies inside the bytes its
    kernel was placed by, or in the scratch area after the arena and the kernel is a barrier."""
    import cuvil.targets.ptx.codegen as cg
    from cuvil.kernels.bounds import stage_accesses
    from cuvil.kernels.schedule import ARENA
    from cuvil.targets.ptx.bounds_patterns import GpuPatterns
    seen = {}
    prove = cg.prove_gpu_stages

    def spy(sched, stages, km, *a, **k):
        seen["km"] = km
        return prove(sched, stages, km, *a, **k)
    monkeypatch.setattr(cg, "prove_gpu_stages", spy)
    kw = {}
    if name == "gpt2_decode":    # attention split over blocks, its partials and per-row counters in the scratch
        from cuvil.targets.ptx.attention import fuse_attention
        p = Pipeline.from_onnx(gpt2_decode_model(vocab=1001, hidden=96, layers=2, heads=4, ffn=387, max_pos=512))
        g = fuse_attention(p.optimize().specialize({"batch": 1, "past_sequence": 300,
                                                     "total_sequence": 301}).optimize().graph)[0]
    elif name.startswith("bert"):     # (S = 32: split-K products among the others)
        p = Pipeline.from_onnx(bert_model(vocab=101, hidden=256, layers=2, heads=4, ffn=1024, max_pos=64)).optimize()
        g = p.specialize({"batch": 1, "sequence": 32}).optimize().graph
        if name.endswith("fp16"):
            from cuvil.rewrite_rules.precision import to_half
            from cuvil.targets.ptx.attention import attention_in_half, fuse_attention
            g, _ = fuse_attention(g, 64)
            g, _ = to_half(g)
            attention_in_half(g)
        else:
            kw["allow_tf32"] = True
    else:
        g = Pipeline.from_onnx(light_model(name)).optimize().graph
    tuning = DEFAULT_TUNING.resolved(True)      # (as compile_bundle: the fused attention kernels on)
    sched = gpu_schedule(g, tuning=tuning)
    res = build_ptx(sched, "sm_90", fma=True, tuning=tuning, **kw)
    km = seen["km"]
    pats = GpuPatterns(km)
    read_only = {WEIGHTS} | {b.base for b in sched.inputs}
    checked = 0
    for d, sts in zip(res.kernels, res.kernel_stages):
        mine = [_bytes(b) for st in sts for b in list(st.reads) + [st.buf] if b.base not in read_only]
        for st in sts:
            for a in stage_accesses(st, pats):
                if a.buf.base in read_only:
                    continue
                x = _bytes(a.buf)
                checked += 1
                if any(y[0] == x[0] and y[1] <= x[1] and x[2] <= y[2] for y in mine):
                    continue
                assert a.buf.base == ARENA and x[1] >= km.scratch_offset and not touches_only_its_stages(d.kind), \
                    (d.kind, st.name, a.kind, a.buf.name, x)
    assert checked > len(res.kernels)
    kinds = {d.kind for d in res.kernels}
    assert {"bert_fp16": "attention_mma", "bert_tf32": "matmul_splitk_tf32", "gpt2_decode": "attention",
            "inception_v1": "conv_splitk"}[name] in kinds, kinds


def test_streams_must_be_a_small_positive_integer(monkeypatch, tmp_path):
    for bad in (0, -1, 17, 2.0, True):
        with pytest.raises(CuvilError, match="streams must be an integer from 1 to 16"):
            rt.GpuModel(str(tmp_path), streams=bad)

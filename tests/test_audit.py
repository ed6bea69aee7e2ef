"""The audit log (issue 24, part 6): JSON lines appended under flock, whole lines from concurrent processes,
every event kind recorded by the code that does the work, never a tensor."""
import json
import os

import numpy as np
import pytest

import cuvil
from cuvil import Pipeline, audit
from cuvil.errors import CuvilError

DEMO = os.path.join(os.path.dirname(cuvil.__file__), "data", "demo_cnn.onnx")


@pytest.fixture
def log(tmp_path):
    path = tmp_path / "audit.jsonl"
    audit.configure(path)
    yield path
    audit.reset()


def test_an_event_is_one_json_line_with_time_user_pid_and_outcome(log):
    audit.record("verify", artifact="lib/libx.so", digest="ab" * 32, outcome="refused", reason="altered: libx.h")
    (e,) = audit.read(log)
    assert e["event"] == "verify" and e["outcome"] == "refused" and e["reason"] == "altered: libx.h"
    assert e["digest"] == "sha256:" + "ab" * 32 and e["artifact"] == os.path.abspath("lib/libx.so")
    assert e["time"].endswith("+00:00") and e["pid"] == os.getpid() and e["user"]
    assert os.stat(log).st_mode & 0o777 == 0o600


def test_off_by_default_and_the_environment_variable_turns_it_on(tmp_path, monkeypatch):
    audit.reset()
    monkeypatch.delenv(audit.ENV, raising=False)
    audit.record("load", artifact="x.so")
    assert not audit.enabled()
    monkeypatch.setenv(audit.ENV, str(tmp_path / "env.jsonl"))
    audit.record("load", artifact="x.so", digest=lambda: "cd" * 32)
    assert audit.read(tmp_path / "env.jsonl")[0]["digest"] == "sha256:" + "cd" * 32
    audit.configure(None)                       # off, whatever the environment says
    audit.record("load", artifact="x.so")
    assert len(audit.read(tmp_path / "env.jsonl")) == 1
    audit.reset()


def test_no_tensor_reaches_the_log(log):
    with pytest.raises(TypeError, match="never tensors"):
        audit.record("load", artifact="x.so", inputs=np.zeros(3))
    with pytest.raises(ValueError):
        audit.record("inference", artifact="x.so")
    assert not log.exists() or audit.read(log) == []


def test_a_log_that_cannot_be_written_is_an_error_with_the_next_step(tmp_path):
    with pytest.raises(CuvilError, match="cannot append") as e:
        audit.configure(tmp_path / "no" / "such" / "dir" / "audit.jsonl")
    assert audit.ENV in e.value.hint
    audit.reset()


def _writer(path, n, k):
    audit.configure(path)
    for i in range(n):
        audit.record("load", artifact=f"lib{k}.so", reason="x" * 6000, seq=i)


def test_concurrent_writers_in_several_processes_give_whole_lines(tmp_path):
    import multiprocessing
    path, n, procs = tmp_path / "audit.jsonl", 150, 4
    ctx = multiprocessing.get_context("fork")       # separate processes, each its own open file description
    ps = [ctx.Process(target=_writer, args=(str(path), n, k)) for k in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(timeout=120)
    assert [p.exitcode for p in ps] == [0] * procs
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == n * procs + 1
    events = [json.loads(line) for line in lines[:-1]]          # each line whole: parses, 6000 x's intact
    assert all(len(e["reason"]) == 6000 for e in events)
    for k in range(procs):
        seq = [e["seq"] for e in events if e["artifact"].endswith(f"lib{k}.so")]
        assert seq == list(range(n))                              # each writer's lines, all, in its order


def test_each_event_kind_is_recorded_where_the_work_happens(log, tmp_path):
    pytest.importorskip("model_signing", reason="the sign extra is not installed (pip install 'cuvil[sign]')")
    art = Pipeline.from_onnx(DEMO).compile()
    so = art.save(tmp_path / "libdemo.so")
    cuvil.keygen(tmp_path / "key.pem", tmp_path / "pub.pem")
    cuvil.sign(so, tmp_path / "key.pem")
    m = cuvil.load(so, verify=tmp_path / "pub.pem")
    m.run(np.zeros((1, 3, 16, 16), np.float32))
    with open(tmp_path / "libdemo.h", "ab") as f:
        f.write(b"\n")
    with pytest.raises(cuvil.signing.SignatureError):
        cuvil.load(so, verify=tmp_path / "pub.pem")
    events = audit.read(log)
    kinds = [e["event"] for e in events]
    assert set(audit.EVENTS) <= set(kinds)
    lib_digest = cuvil.signing.artifact_digest(so)
    by = {(e["event"], e["outcome"]): e for e in events}
    assert by[("sign", "ok")]["digest"] == by[("verify", "ok")]["digest"] == "sha256:" + lib_digest
    assert by[("load", "ok")]["verified"] is True and by[("load", "ok")]["digest"] == "sha256:" + lib_digest
    assert by[("session-create", "ok")]["num_threads"] == 0
    assert "libdemo.h" in by[("verify", "refused")]["reason"] and ("load", "refused") in by
    assert by[("compile", "ok")]["digest"] == "sha256:" + lib_digest

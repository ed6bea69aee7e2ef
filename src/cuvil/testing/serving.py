"""Helpers of the serving campaigns (bench/serving.py) and their bounded tests (tests/test_serve_load.py,
tests/test_serve_cluster.py): malformed Open Inference Protocol requests of every kind a server must refuse
with a 400, and the replicas of a Ray Serve deployment (node, pid, resident memory) to place, watch and kill.

Ray is imported inside the replica functions only; the malformed requests need none.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

import numpy as np

#: The kinds of malformed request :func:`malformed_requests` makes, each one the server must refuse with a 400,
#: and a word its message must carry (case-insensitive), so that a refusal for another reason does not count.
MALFORMED_KINDS = {"unknown model": "model", "unknown input": "input", "missing input": "input",
                   "wrong dtype": "dtype", "wrong rank": "rank", "wrong dim": "dim", "out of profile": "profile",
                   "malformed JSON": "json", "not a JSON object": "json", "bad binary size": "binary_data_size",
                   "oversized body": "limit"}

_DTYPES = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32, "UINT8": np.uint8,
           "INT8": np.int8, "BOOL": np.bool_, "FP16": np.float16}


def _request(inputs: list[dict], blobs: list[bytes]) -> tuple[bytes, dict[str, str]]:
    head = json.dumps({"inputs": inputs}).encode()
    if not blobs:
        return head, {"Content-Type": "application/json"}
    return head + b"".join(blobs), {"Content-Type": "application/octet-stream",
                                    "Inference-Header-Content-Length": str(len(head))}


def _tensor(name: str, datatype: str, shape: list[int], rng, binary: bool) -> tuple[dict, list[bytes]]:
    a = (rng.standard_normal(shape) if datatype.startswith("FP") else rng.integers(0, 4, shape)).astype(_DTYPES[datatype])
    if binary:
        raw = a.tobytes()
        return {"name": name, "datatype": datatype, "shape": shape, "parameters": {"binary_data_size": len(raw)}}, [raw]
    return {"name": name, "datatype": datatype, "shape": shape, "data": a.reshape(-1).tolist()}, []


def malformed_requests(meta: dict[str, Any], shape: list[int], n: int, seed: int = 0, max_body: int = 1 << 20,
                       symbol_max: int | None = None) -> Iterator[tuple[str, str, bytes, dict[str, str]]]:
    """``n`` random malformed infer requests for the one-input model ``meta`` (its OIP metadata), whose valid
    input shape is ``shape``; ``(kind, model_name, body, headers)`` each, the kinds in turn (``MALFORMED_KINDS``),
    each with random sizes, JSON or binary tensors. ``symbol_max``: the profile's largest batch (``out of
    profile`` sends one more; that kind is skipped without it); ``max_body``: the server's body limit."""
    rng = np.random.default_rng(seed)
    name, inp = meta["name"], meta["inputs"][0]
    dt = inp["datatype"]
    kinds = [k for k in MALFORMED_KINDS if k != "out of profile" or symbol_max is not None]
    for i in range(n):
        kind = kinds[i % len(kinds)]
        binary = bool(rng.integers(0, 2))
        model, sh = name, list(shape)
        if kind == "unknown model":
            model = f"no-such-model-{rng.integers(1 << 30)}"
            t, b = _tensor(inp["name"], dt, sh, rng, binary)
        elif kind == "unknown input":
            t, b = _tensor(f"{inp['name']}_{rng.integers(1000)}", dt, sh, rng, binary)
        elif kind == "missing input":
            body, headers = _request([], [])
            yield kind, model, body, headers
            continue
        elif kind == "wrong dtype":
            other = [d for d in ("FP64", "INT64", "INT32", "UINT8", "FP16") if d != dt]
            t, b = _tensor(inp["name"], other[int(rng.integers(len(other)))], sh, rng, binary)
        elif kind == "wrong rank":
            extra = sh + [int(rng.integers(1, 3))] if rng.integers(0, 2) else sh[1:]
            t, b = _tensor(inp["name"], dt, extra, rng, binary)
        elif kind == "wrong dim":
            fixed = [k for k, d in enumerate(inp["shape"]) if d >= 0]
            k = fixed[int(rng.integers(len(fixed)))] if fixed else len(sh) - 1
            sh[k] += int(rng.integers(1, 4))
            t, b = _tensor(inp["name"], dt, sh, rng, binary)
        elif kind == "out of profile":   # binary: JSON numbers of a large batch could pass the body limit first
            sh[0] = int(symbol_max) + int(rng.integers(1, 4))
            t, b = _tensor(inp["name"], dt, sh, rng, True)
        elif kind == "malformed JSON":
            good, _ = _request([_tensor(inp["name"], dt, sh, rng, False)[0]], [])
            cut = int(rng.integers(1, len(good)))
            body = good[:cut] if rng.integers(0, 2) else bytes(rng.integers(0, 256, int(rng.integers(1, 200)),
                                                                            dtype=np.uint8))
            yield kind, model, body, {"Content-Type": "application/json"}
            continue
        elif kind == "not a JSON object":
            body = json.dumps([1, 2, 3] if rng.integers(0, 2) else "inputs").encode()
            yield kind, model, body, {"Content-Type": "application/json"}
            continue
        elif kind == "bad binary size":
            t, b = _tensor(inp["name"], dt, sh, rng, True)
            t["parameters"]["binary_data_size"] += int(rng.integers(1, 64)) * (1 if rng.integers(0, 2) else -1)
        else:   # oversized body: a valid header, then more bytes than the limit
            t, b = _tensor(inp["name"], dt, sh, rng, True)
            b = [bytes(max_body + 1 + int(rng.integers(0, 1024)))]
            t["parameters"]["binary_data_size"] = len(b[0])
        body, headers = _request([t], b)
        yield kind, model, body, headers


# -- replicas of a Ray Serve deployment ------------------------------------------------------------------------

def replicas(deployment: str, app: str = "cuvil") -> list[dict[str, Any]]:
    """The live replicas of ``deployment`` in the Serve application ``app``: ``{"actor_id", "name", "node_id",
    "pid"}`` each, from Ray's control store (the connected driver's ``ray``; no dashboard needed)."""
    import ray
    out = []
    for a in ray._private.state.actors().values():   # the GCS's actor table (ray.util.state needs the dashboard)
        if a.get("State") != "ALIVE" or a.get("ActorClassName") != f"ServeReplica:{app}:{deployment}":
            continue
        out.append({"actor_id": a["ActorID"], "name": a.get("Name"), "node_id": a["Address"]["NodeID"],
                    "pid": a.get("Pid")})
    return sorted(out, key=lambda r: r["actor_id"])


def serve_processes() -> dict[str, int]:
    """Every process of the connected local Ray instance that serves: ``{label: pid}`` for Serve's HTTP proxy,
    its controller, each replica (``replica APP/DEPLOYMENT #k``), and Ray's own GCS server and raylet (those only
    where this driver started the instance). For CPU accounting per hop (:func:`cpu_seconds`)."""
    import ray
    out: dict[str, int] = {}
    count: dict[str, int] = {}
    for a in sorted(ray._private.state.actors().values(), key=lambda a: a["ActorID"]):
        cls, pid = a.get("ActorClassName") or "", a.get("Pid")
        if a.get("State") != "ALIVE" or not pid:
            continue
        if cls.startswith("ServeReplica:"):
            label = "replica " + "/".join(cls.split(":")[1:])
        elif cls in ("ProxyActor", "ServeController"):
            label = {"ProxyActor": "HTTP proxy", "ServeController": "Serve controller"}[cls]
        else:
            continue
        count[label] = count.get(label, 0) + 1
        out[f"{label} #{count[label]}" if label.startswith("replica") or count[label] > 1 else label] = pid
    node = getattr(ray._private.worker, "_global_node", None)
    for kind in ("gcs_server", "raylet"):
        for k, info in enumerate(getattr(node, "all_processes", {}).get(kind, []) if node else []):
            out[kind + (f" #{k + 1}" if k else "")] = info.process.pid
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process on this machine has used (``/proc/PID/stat``), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it (by the parent pids in /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def rss_kb(pid: int) -> int:
    """The resident set of a process on this machine (``VmRSS``, KiB)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise ValueError(f"no VmRSS for pid {pid}")


def kill_replica(replica: dict[str, Any]) -> None:
    """Kills a replica's process outright (SIGKILL, as a crash would): Serve's controller notices and starts
    another. The replica must run on this machine."""
    import signal
    os.kill(int(replica["pid"]), signal.SIGKILL)

"""Tamper campaign (issue 24): what a loader does with an artifact an attacker altered.

    PYTHONPATH=src python3 bench/tamper.py                      # ~500 variants, markdown table on stdout
    PYTHONPATH=src python3 bench/tamper.py --per-artifact 20 --artifacts demo,external
    PYTHONPATH=src python3 bench/tamper.py --out bench/results/2026-12-02-tamper.md

A few artifacts are compiled and signed (cuvil.signing): the demo CNN, a light model (squeezenet, seeded
random weights), the demo with external weights (``libNAME.weights``), the demo with AES-256-GCM encrypted
weights, and a GPU bundle of the demo (PTX and a cubin from ptxas; skipped without ptxas). Each is copied and
altered in several hundred ways, as the issue's attacker did: byte flips in the library's code (.text),
constants and embedded weights (.rodata), dynamic symbols and strings, ELF and program headers; truncation
and appended bytes; manifest, header, SBOM and provenance edits (one JSON value, or one byte); flips,
truncation and header edits of the external weights; files added, removed, replaced by a symbolic link or a
FIFO; the signature edited, swapped for another artifact's, or made with another key over the altered files.

Each variant is loaded in a child process (forked from a process that already imported Cuvil, so the
campaign is quick), ``cuvil.load(path, verify=PUB)`` and then one run on a fixed input, with a time limit:
a crash (a signal) or a hang (killed at the limit) is observed in the child, not suffered. Outcomes:

- ``refused``: a :class:`cuvil.errors.CuvilError` (a SignatureError when verified), a message and a hint;
- ``ran, same``: loaded and ran, outputs equal to the untouched artifact's (bitwise);
- ``ran, different``: loaded and ran, outputs differ: the silent failure;
- ``accepted``: passed verification but could not run here (a GPU bundle on a host without a GPU);
- ``traceback``: another exception (an unclear error); ``crashed``: killed by a signal; ``hung``.

The same variants loaded without ``verify=`` (the unverified path) are counted beside, for contrast. The goal:
every variant refused on the verified path; no crash, no hang, no traceback.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pickle
import random
import re
import shutil
import signal
import stat
import struct
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import numpy as np

import cuvil
from cuvil import Pipeline
from cuvil.errors import CuvilError
from cuvil.signing import artifact_files, signature_path
from cuvil.targets.x86.cpu import cpu_label

DEMO = os.path.join(os.path.dirname(cuvil.__file__), "data", "demo_cnn.onnx")
ARTIFACTS = ("demo", "light", "external", "encrypted", "gpu")
OUTCOMES = ("refused", "ran, same", "ran, different", "accepted", "traceback", "crashed", "hung")


# -- the artifacts -------------------------------------------------------------------------------------------

class Subject:
    """A signed artifact in ``folder``: ``path`` (libNAME.so or NAME.cuvil), its ``weights_key`` (encrypted
    weights), the ``input`` it runs on and ``kind`` (x86 / bundle)."""

    def __init__(self, name: str, path: str, kind: str, inputs: List[np.ndarray], weights_key=None):
        self.name, self.path, self.kind, self.inputs, self.weights_key = name, path, kind, inputs, weights_key
        self.reference = None

    @property
    def folder(self) -> str:
        return os.path.dirname(self.path) if self.kind == "x86" else self.path


def _inputs(model_inputs) -> List[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal([d if isinstance(d, int) else 1 for d in i.shape]).astype(np.float32)
            for i in model_inputs]


def build(names, work: str, key: str) -> List[Subject]:
    out = []
    for name in names:
        folder = os.path.join(work, "signed", name)
        os.makedirs(folder)
        kw = {}
        if name == "light":
            from cuvil.testing.models import light_model
            art = Pipeline.from_onnx(light_model("squeezenet")).compile(prefix="squeezenet")
        elif name == "gpu":
            if shutil.which("ptxas") is None:
                print("no ptxas: the GPU bundle is left out", file=sys.stderr)
                continue
            art = Pipeline.from_onnx(DEMO).compile(target="nvptx64-nvidia-cuda", arch="sm_90", fixed={"N": 1})
            path = art.save(os.path.join(folder, "demo.cuvil"))
            cuvil.sign(path, key)
            import onnx
            m = onnx.load(DEMO)
            shape = [1] + [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim[1:]]
            out.append(Subject(name, path, "bundle", [np.random.default_rng(0).standard_normal(shape)
                                                      .astype(np.float32)]))
            continue
        elif name == "external":
            art = Pipeline.from_onnx(DEMO).compile(external_weights=True)
        elif name == "encrypted":
            kw["weights_key"] = os.path.join(work, "weights.key")
            if not os.path.exists(kw["weights_key"]):
                with open(kw["weights_key"], "wb") as f:
                    f.write(os.urandom(32))
            art = Pipeline.from_onnx(DEMO).compile(encrypt_weights=kw["weights_key"])
        else:
            art = Pipeline.from_onnx(DEMO).compile()
        path = art.save(os.path.join(folder, os.path.basename(art.path)))
        cuvil.sign(path, key)
        with open(os.path.splitext(path)[0] + ".manifest.json") as f:
            man = json.load(f)
        shapes = [[d if isinstance(d, int) else 1 for d in i["shape"]] for i in man["inputs"]]
        rng = np.random.default_rng(0)
        out.append(Subject(name, path, "x86", [rng.standard_normal(s).astype(np.float32) for s in shapes], **kw))
    return out


# -- altering a copy --------------------------------------------------------------------------------------------

def _elf_sections(data: bytes) -> Dict[str, tuple]:
    """{name: (offset, size)} of a little-endian ELF64 file's sections."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    stroff = secs[shstrndx][4]
    out = {}
    for s in secs:
        end = data.index(b"\0", stroff + s[0])
        if s[1] != 8 and s[5] > 0:            # not NOBITS
            out[data[stroff + s[0]:end].decode()] = (s[4], s[5])
    return out


def _flip(path: str, rng: random.Random, lo: int, hi: int) -> str:
    with open(path, "r+b") as f:
        f.seek(0, 2)
        hi = min(hi, f.tell())
        pos = rng.randrange(lo, hi)
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ (1 << rng.randrange(8))]))
    return f"byte {pos}"


def _truncate(path: str, rng: random.Random) -> str:
    n = os.path.getsize(path)
    keep = rng.choice([0, 1, 16, 64, n // 4, n // 2, n - 4096, n - 1, rng.randrange(n)])
    keep = max(0, min(keep, n - 1))
    with open(path, "r+b") as f:
        f.truncate(keep)
    return f"to {keep} of {n} bytes"


def _append(path: str, rng: random.Random) -> str:
    with open(path, "ab") as f:
        f.write(bytes(rng.randrange(256) for _ in range(rng.choice([1, 7, 4096]))))
    return "bytes appended"


def _json_edit(path: str, rng: random.Random) -> str:
    """Change one leaf value of a JSON file (a number, a string, a boolean)."""
    with open(path) as f:
        doc = json.load(f)
    leaves = []

    def walk(node, trail):
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            if isinstance(v, (dict, list)):
                walk(v, trail + [k])
            else:
                leaves.append((node, k, trail + [k]))
    walk(doc, [])
    node, k, trail = rng.choice(leaves)
    v = node[k]
    if isinstance(v, bool):
        node[k] = not v
    elif isinstance(v, int):
        node[k] = v + rng.choice([-1, 1, 7])
    elif isinstance(v, float):
        node[k] = v * 1.5 + 1
    elif isinstance(v, str):
        node[k] = (v[:-1] + ("0" if v[-1:] != "0" else "1")) if v else "x"
    else:
        node[k] = 0
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return "/".join(map(str, trail))


def _replace_by_link(path: str, rng: random.Random) -> str:
    hidden = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".real")
    os.rename(path, hidden)
    os.symlink(os.path.basename(hidden), path)
    return "a symbolic link to the same bytes"


def _replace_by_fifo(path: str, rng: random.Random) -> str:
    if os.path.lexists(path):
        os.unlink(path)
    os.mkfifo(path)
    return "a FIFO"


def mutations(subject: Subject, subjects: List[Subject], attacker_key: str) -> List[tuple]:
    """(family, target file name, function(copy_path, rng) -> detail) of every kind this artifact allows."""
    files = artifact_files(subject.path)
    sig = os.path.basename(signature_path(subject.path))
    out = []
    if subject.kind == "x86":
        so = os.path.basename(subject.path)
        with open(subject.path, "rb") as f:
            secs = _elf_sections(f.read())
        for sec, weight in ((".text", 6), (".rodata", 6), (".data.rel.ro", 1), (".dynsym", 1), (".dynstr", 1),
                            (".eh_frame", 1), (".dynamic", 1)):
            if sec in secs:
                off, size = secs[sec]
                out += [("code/data flip " + sec, so,
                         (lambda o, s: lambda p, r: _flip(p, r, o, o + s))(off, size))] * weight
        out += [("ELF header flip", so, lambda p, r: _flip(p, r, 0, 64))] * 2
        out += [("program headers flip", so, lambda p, r: _flip(p, r, 64, 64 + 56 * 8))] * 2
        out += [("truncation", so, _truncate)] * 3 + [("appended bytes", so, _append)]
        for role, fam in (("manifest.json", "manifest"), (".h", "header"), (".cdx.json", "SBOM"),
                          (".intoto.json", "provenance"), (".weights", "weights file")):
            name = next((n for n in files if n.endswith(role)), None)
            if name is None:
                continue
            if fam == "weights file":
                out += [(fam + " flip (header)", name, lambda p, r: _flip(p, r, 0, 128))] * 3
                out += [(fam + " flip (payload)", name, lambda p, r: _flip(p, r, 4096, 1 << 40))] * 5
                out += [(fam + " truncation", name, _truncate)] * 2
                out += [(fam + " removed", name, lambda p, r: os.unlink(p) or "removed")]
            elif name.endswith(".json"):
                out += [(fam + " edit", name, _json_edit)] * 3 + [(fam + " flip", name, lambda p, r: _flip(p, r, 0, 1 << 40))]
            else:
                out += [(fam + " flip", name, lambda p, r: _flip(p, r, 0, 1 << 40))] * 2
            out += [(fam + " removed", name, lambda p, r: os.unlink(p) or "removed")]
        if not any(n.endswith(".weights") for n in files):
            other = next((s for s in subjects if s.kind == "x86" and any(n.endswith(".weights")
                                                                         for n in artifact_files(s.path))), None)
            if other is not None:
                src = os.path.splitext(other.path)[0] + ".weights"
                out += [("file added (a weights file)", os.path.splitext(so)[0] + ".weights",
                         lambda p, r, src=src: shutil.copyfile(src, p) and "another build's weights file")]
        out += [("replaced by a symbolic link", so, _replace_by_link),
                ("replaced by a symbolic link", next(n for n in files if n.endswith("manifest.json")), _replace_by_link),
                ("replaced by a FIFO", next(n for n in files if n.endswith(".h")), _replace_by_fifo)]
    else:
        names = sorted(files)
        for name in names:
            w = 4 if name.endswith((".ptx", ".cubin", ".bin")) else 1
            out += [("bundle file flip", name, lambda p, r: _flip(p, r, 0, 1 << 40))] * w
            if name.endswith(".json"):
                out += [("bundle JSON edit", name, _json_edit)] * 2
            out += [("bundle file truncation", name, _truncate)]
        out += [("bundle file removed", n, lambda p, r: os.unlink(p) or "removed") for n in names]
        out += [("file added", "extra.ptx", lambda p, r: open(p, "w").write("// added") and "added"),
                ("replaced by a symbolic link", "plan.json", _replace_by_link),
                ("replaced by a FIFO", "manifest.json", _replace_by_fifo)]
    # the signature itself
    out += [("signature flip", sig, lambda p, r: _flip(p, r, 0, 1 << 40))] * 3
    out += [("signature JSON edit", sig, _json_edit)] * 3
    out += [("signature truncation", sig, _truncate), ("signature removed", sig, lambda p, r: os.unlink(p) or "removed"),
            ("signature replaced by a FIFO", sig, _replace_by_fifo)]
    others = [s for s in subjects if s is not subject]
    if others:
        out += [("signature of another artifact", sig,
                 lambda p, r: shutil.copyfile(signature_path(r.choice(others).path), p) and "swapped")]
    # another key: a valid signature, by the attacker, over altered files
    out += [("altered and re-signed with another key", "*", lambda p, r: None)] * 3
    return out


def make_variant(subject: Subject, mutation, dest: str, rng: random.Random, attacker_key: str) -> str:
    """A copy of the signed artifact at ``dest`` with one mutation applied; what was done."""
    fam, target, fn = mutation
    if subject.kind == "x86":
        shutil.copytree(subject.folder, dest)
        path = os.path.join(dest, os.path.basename(subject.path))
        base = dest
    else:
        path = os.path.join(dest, os.path.basename(subject.path))
        shutil.copytree(subject.path, path)
        base = path
    if target == "*":      # re-signed with another key over a flipped library / bundle file
        victim = path if subject.kind == "x86" else os.path.join(path, "weights.bin")
        _flip(victim, rng, 0, os.path.getsize(victim))
        cuvil.sign(path, attacker_key)
        return "library/weights.bin flipped, signed with the attacker's key"
    return str(fn(os.path.join(base, target), rng) or "")


# -- loading in a child ---------------------------------------------------------------------------------------

def _child(path: str, verify, weights_key, inputs) -> tuple:
    try:
        kw = {"weights_key": weights_key} if weights_key else {}
        m = cuvil.load(path, verify=verify, **kw)
        try:
            out = m.run(*inputs)
        except CuvilError as e:
            return ("refused", f"run: {e.message}")
        return ("ran", [np.asarray(o) for o in out])
    except CuvilError as e:
        if type(e).__name__ == "NoGpuError":
            return ("accepted", str(e.message))
        return ("refused", f"{type(e).__name__}: {e.message}" + (f" (next: {e.hint})" if e.hint else ""))
    except BaseException as e:  # noqa: BLE001 - what the campaign measures
        return ("traceback", f"{type(e).__name__}: {e}")


def run_isolated(path: str, verify, weights_key, inputs, timeout: float) -> tuple:
    """Run :func:`_child` in a forked process; ('crashed', signal) or ('hung', seconds) when it dies or does
    not finish."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                      # the child: never returns
        os.close(r)
        try:
            signal.alarm(0)
            res = pickle.dumps(_child(path, verify, weights_key, inputs))
            view = memoryview(res)
            while view:
                view = view[os.write(w, view):]
        finally:
            os._exit(0)
    os.close(w)
    os.set_blocking(r, False)
    chunks, deadline = [], time.monotonic() + timeout
    while True:
        try:
            b = os.read(r, 1 << 20)
            if b:
                chunks.append(b)
        except BlockingIOError:
            b = None
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            try:
                while True:
                    b = os.read(r, 1 << 20)
                    if not b:
                        break
                    chunks.append(b)
            except BlockingIOError:
                pass
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return ("hung", f"killed after {timeout:.0f} s")
        if b is None:
            time.sleep(0.002)
    os.close(r)
    if os.WIFSIGNALED(status):
        return ("crashed", signal.Signals(os.WTERMSIG(status)).name)
    if not chunks:
        return ("crashed", f"exit {os.WEXITSTATUS(status)} without a result")
    return pickle.loads(b"".join(chunks))


def classify(res: tuple, reference) -> tuple:
    kind, detail = res
    if kind != "ran":
        return kind, detail
    if reference is None:
        return "ran, same", ""
    same = len(detail) == len(reference) and all(a.shape == b.shape and a.dtype == b.dtype and
                                                 np.array_equal(a, b, equal_nan=True)
                                                 for a, b in zip(detail, reference))
    return ("ran, same" if same else "ran, different"), ""


# -- the campaign ---------------------------------------------------------------------------------------------

def campaign(names=ARTIFACTS, per_artifact: int = 100, seed: int = 0, timeout: float = 10.0, work: Optional[str] = None,
             unverified: bool = True, log=None) -> dict:
    """Build, sign, alter and load; ``{"rows": [...], "subjects": [...]}`` (one row per variant)."""
    own = work is None
    work = work or tempfile.mkdtemp(prefix="cuvil-tamper-")
    try:
        keys = os.path.join(work, "keys")
        cuvil.keygen(os.path.join(keys, "key.pem"), os.path.join(keys, "pub.pem"))
        cuvil.keygen(os.path.join(keys, "attacker.pem"), os.path.join(keys, "attacker.pub.pem"))
        pub = os.path.join(keys, "pub.pem")
        subjects = build(names, work, os.path.join(keys, "key.pem"))
        rows = []
        rng = random.Random(seed)
        for s in subjects:
            ref = run_isolated(s.path, pub, s.weights_key, s.inputs, timeout * 3)
            if ref[0] == "ran":
                s.reference = ref[1]
            elif ref[0] != "accepted":
                raise RuntimeError(f"the untouched signed {s.name} does not load verified: {ref}")
            muts = mutations(s, subjects, os.path.join(keys, "attacker.pem"))
            # each kind once (evenly spaced when fewer variants than kinds), then kinds drawn at random
            picks = ([muts[i * len(muts) // per_artifact] for i in range(per_artifact)] if per_artifact <= len(muts)
                     else muts + [rng.choice(muts) for _ in range(per_artifact - len(muts))])
            for i, mut in enumerate(picks):
                dest = os.path.join(work, "v", f"{s.name}-{i}")
                vr = random.Random(rng.random())
                try:
                    detail = make_variant(s, mut, dest, vr, os.path.join(keys, "attacker.pem"))
                except Exception as e:  # noqa: BLE001 - a mutation that cannot apply (a tiny file)
                    shutil.rmtree(dest, ignore_errors=True)
                    continue
                path = os.path.join(dest, os.path.basename(s.path))
                row = {"artifact": s.name, "family": mut[0], "file": mut[1], "detail": detail}
                row["verified"], row["verified_detail"] = classify(
                    run_isolated(path, pub, s.weights_key, s.inputs, timeout), s.reference)
                if unverified:
                    row["unverified"], row["unverified_detail"] = classify(
                        run_isolated(path, None, s.weights_key, s.inputs, timeout), s.reference)
                rows.append(row)
                if log:
                    log(row)
                _rmtree(dest)
        return {"rows": rows, "subjects": [s.name for s in subjects]}
    finally:
        if own:
            _rmtree(work)


def _rmtree(path: str) -> None:
    for dirpath, dirnames, files in os.walk(path):
        for n in files:
            p = os.path.join(dirpath, n)
            if stat.S_ISFIFO(os.lstat(p).st_mode):
                os.unlink(p)
    shutil.rmtree(path, ignore_errors=True)


def table(result: dict, unverified: bool = True) -> str:
    rows = result["rows"]
    paths = ["verified"] + (["unverified"] if unverified else [])
    lines = [f"CPU: {cpu_label()}  ",
             f"{len(rows)} tampered artifacts ({', '.join(result['subjects'])}); each loaded in a child process "
             f"and run once.", ""]
    head = "| outcome | " + " | ".join(f"`cuvil.load(path{', verify=PUB' if p == 'verified' else ''})`"
                                       for p in paths) + " |"
    lines += [head, "|---|" + "---:|" * len(paths)]
    counts = {p: collections.Counter(r[p] for r in rows) for p in paths}
    for o in OUTCOMES:
        if any(counts[p][o] for p in paths) or o in ("refused", "ran, different", "crashed", "hung"):
            lines.append(f"| {o} | " + " | ".join(str(counts[p][o]) for p in paths) + " |")
    lines += ["", "By kind of tampering (verified refused / total; unverified: ran different, crashed, hung, "
                  "traceback):", "", "| artifact | tampering | n | verified refused | unverified: different / "
                                     "crashed / hung / traceback |", "|---|---|---:|---:|---|"]
    groups = collections.OrderedDict()
    for r in rows:
        groups.setdefault((r["artifact"], r["family"]), []).append(r)
    for (a, fam), rs in groups.items():
        c = collections.Counter(r.get("unverified") for r in rs)
        lines.append(f"| {a} | {fam} | {len(rs)} | {sum(r['verified'] == 'refused' for r in rs)} | "
                     + (f"{c['ran, different']} / {c['crashed']} / {c['hung']} / {c['traceback']}" if unverified else "-")
                     + " |")
    worst = [r for r in rows if r.get("unverified") in ("hung", "crashed", "traceback", "ran, different")]
    if worst:
        lines += ["", "Unverified loads that hung, crashed, raised a traceback or ran with different outputs:", ""]
        lines += [f"- {r['artifact']} {r['family']} ({r['file']}: {r['detail']}): {r['unverified']} "
                  f"{str(r['unverified_detail'])[:160]}" for r in worst]
    bad = [r for r in rows if r["verified"] != "refused"]
    if bad:
        lines += ["", "Verified loads NOT refused:", ""]
        lines += [f"- {r['artifact']} {r['family']} ({r['file']}: {r['detail']}): {r['verified']} {r['verified_detail']}"
                  for r in bad]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifacts", default=",".join(ARTIFACTS), help=f"comma-separated, of {', '.join(ARTIFACTS)}")
    ap.add_argument("--per-artifact", type=int, default=100, help="variants per artifact (default 100)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds before a load counts as hung")
    ap.add_argument("--no-unverified", action="store_true", help="skip the unverified contrast")
    ap.add_argument("--out", help="also write the markdown table here")
    ap.add_argument("--examples", type=int, default=0, help="print this many refusal messages")
    a = ap.parse_args(argv)
    t0 = time.time()
    res = campaign(a.artifacts.split(","), a.per_artifact, a.seed, a.timeout, unverified=not a.no_unverified)
    text = table(res, not a.no_unverified)
    text += f"\n{time.time() - t0:.0f} s (`PYTHONPATH=src python3 bench/tamper.py --per-artifact {a.per_artifact} " \
            f"--artifacts {a.artifacts} --seed {a.seed}`)\n"
    if a.examples:
        seen = set()
        text += "\nSome refusals of the verified load, as the user sees them (one per kind of message):\n\n"
        for r in res["rows"]:
            msg = re.sub(r"/\S*/cuvil-tamper-[^/]+/v/[^/]+/", "", r["verified_detail"])
            kind = re.sub(r"\S+\.(so|h|json|weights|sig|ptx|bin|cubin)\b|\(.*", "", msg)[:60]
            if kind not in seen and len(seen) < a.examples:
                seen.add(kind)
                text += f"- {r['artifact']}, {r['family']}: {msg[:220]}\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    bad = sum(r["verified"] != "refused" for r in res["rows"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

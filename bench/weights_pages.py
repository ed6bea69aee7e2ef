"""How a library's weights sit in the page cache, and what it costs a model that streams them: the GPT-2 decode
step (every weight read once a token) from four copies of one library, in one process, alternating:

- ``2M``: written 2 MiB at a time (``Artifact.save``, ``link.write_library``): cached in 2 MiB folios, mapped
  one page-table entry per 2 MiB;
- ``4K``: written 4 KiB at a time (what ``cp`` or an unpacker may leave): small folios, 4 KiB entries;
- ``evicted``: written like ``2M``, then dropped from the page cache (``posix_fadvise(DONTNEED)``, as memory
  pressure or a proactive reclaimer does) and read back by the first run, with the session's advice
  (``MADV_HUGEPAGE`` on the embedded weights, runtime.c ``advise_weights``);
- ``evicted, no advice``: the same with ``CUVIL_HUGE_PAGES=0`` while its session is created (its arena then
  stays in 4 KiB pages too: a decode step's arena is small).

Per copy: the mapping's resident and 2 MiB-mapped sizes (/proc/self/smaps FilePmdMapped), then per thread
count and past length the p50 over rounds of 20 runs, and each copy's time over ``2M``'s.

    PYTHONPATH=src python3 bench/weights_pages.py [--lib libgpt2.so] [--past 128,1023] [--threads 1,2] [--rounds 9]

Without ``--lib`` the full-size GPT-2 decode library (``cuvil.testing.hf_models``, one library for past
1..1023) is compiled first (~50 s). The CPU model is printed first; read the ratios of one run.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import tempfile
import time

from cuvil.targets.x86.cpu import cpu_label
from cuvil.targets.x86.link import write_library
from cuvil.targets.x86.loader import load
from cuvil.testing.hf_models import GPT2_DECODE_PROFILE, GPT2_SMALL, gpt2_decode_model, text_feeds


def _copy_4k(src: str, dst: str) -> None:
    with open(src, "rb", buffering=0) as f, open(dst, "wb", buffering=0) as out:
        while chunk := f.read(4096):
            out.write(chunk)
    os.chmod(dst, 0o755)


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _mapped(path: str) -> dict:
    """MB of the library's mapping: resident, and mapped in 2 MiB page-table entries."""
    tot, cur = {"Rss": 0, "FilePmdMapped": 0}, None
    with open(f"/proc/{os.getpid()}/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split()
                cur = parts[5] if len(parts) >= 6 else ""
            elif cur == path and line.split(":")[0] in tot:
                tot[line.split(":")[0]] += int(line.split()[1])
    return {k: v / 1024 for k, v in tot.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", help="a GPT-2 decode library (its manifest beside it); built when left out")
    ap.add_argument("--past", default="128,1023")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args(argv)
    model = gpt2_decode_model(**GPT2_SMALL)
    with tempfile.TemporaryDirectory(prefix="cuvil-weights-pages-") as tmp:
        src = a.lib
        if src is None:
            from cuvil import Pipeline
            os.environ.setdefault("CUVIL_CACHE_DIR", os.path.join(tmp, "cache"))
            p = Pipeline.from_onnx(model).optimize()
            src = os.path.join(tmp, "libgpt2.so")
            p.compile(shape_profiles={k: v for k, v in GPT2_DECODE_PROFILE.items() if k in p.graph.symbols}).save(src)
        manifest = src[:-3] + ".manifest.json"
        copies = {}
        for name, tag in (("2M", "a"), ("4K", "b"), ("evicted", "c"), ("evicted, no advice", "d")):
            path = os.path.realpath(os.path.join(tmp, f"lib{tag}.so"))
            (_copy_4k if name == "4K" else write_library)(src, path)
            shutil.copyfile(manifest, path[:-3] + ".manifest.json")
            if name.startswith("evicted"):
                _evict(path)
            copies[name] = path
        print(f"{cpu_label()} | GPT-2 decode step, B = 1 | load {os.getloadavg()[0]:.2f}")
        for t in (int(x) for x in a.threads.split(",")):
            libs = {}
            for name, path in copies.items():
                old = os.environ.get("CUVIL_HUGE_PAGES")
                if name == "evicted, no advice":
                    os.environ["CUVIL_HUGE_PAGES"] = "0"
                try:
                    libs[name] = load(path, num_threads=t)
                    libs[name].run(**{k: v for k, v in text_feeds(model, 1, 1).items()
                                      if k in {x.name for x in libs[name].inputs}})   # the session, created now
                finally:
                    if old is None:
                        os.environ.pop("CUVIL_HUGE_PAGES", None)
                    else:
                        os.environ["CUVIL_HUGE_PAGES"] = old
            for past in (int(x) for x in a.past.split(",")):
                feeds = text_feeds(model, 1, past)
                feeds = {k: v for k, v in feeds.items() if k in {x.name for x in libs["2M"].inputs}}
                for lib in libs.values():
                    lib.run(**feeds)
                times = {k: [] for k in libs}
                order = list(libs)
                for r in range(a.rounds):
                    for k in order if r % 2 == 0 else order[::-1]:
                        t0 = time.perf_counter()
                        for _ in range(20):
                            libs[k].run(**feeds)
                        times[k].append(1e3 * (time.perf_counter() - t0) / 20)
                base = statistics.median(times["2M"])
                print(f"  {t} thread(s), past {past}: " + "; ".join(
                    f"{k} {statistics.median(v):.2f} ms ({statistics.median(v) / base:.2f}x)" for k, v in times.items()))
            for name, path in copies.items():
                m = _mapped(path)
                print(f"    {name}: resident {m['Rss']:.0f} MB, in 2 MiB pages {m['FilePmdMapped']:.0f} MB")
            for lib in libs.values():
                lib.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What every compile and every fresh Cuvil process pays before any real work, side by side in one run
(medians of interleaved repetitions, thread or child CPU seconds beside wall time; the CPU and load printed):

1. ``proved_rules(builtin_rules())``, which each compile runs: memoised per rule object (the default) against the
   same call with the memos emptied first (each rule's key, parsed verdict and restricted form rebuilt, as before).
2. A fresh ``python -c "import cuvil.cli"`` (every ``cuvil`` command; the docs' blocks run ~100 of them in the
   gate): from a copy of ``src/`` without ``__pycache__`` under ``PYTHONDONTWRITEBYTECODE=1`` (every module
   compiled from source, as when the calling shell sets it) against the same copy with its ``.pyc`` files; and
   with Hypothesis imported on top (what every ``cuvil`` process paid before ``cuvil verify`` imported it lazily).

    PYTHONPATH=src python3 bench/gate_overheads.py [--reps 9]
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")


def _proved_rules(reps: int) -> None:
    from cuvil.rewrite_rules import verdicts as V
    rules = V.builtin_rules()
    V.proved_rules(rules, on_unproved="skip")
    store = V._default_store()

    def emptied():
        store._parsed.clear()
        store.restricted._memo.clear()
        V._RULE_KEYS._memo.clear()

    memo, cold = [], []
    for _ in range(reps):
        for out, before in ((memo, None), (cold, emptied)):
            if before:
                before()
            t0, w0 = time.thread_time(), time.perf_counter()
            V.proved_rules(rules, on_unproved="skip")
            out.append((time.thread_time() - t0, time.perf_counter() - w0))
    for name, xs in (("memoised (now)", memo), ("memos emptied (before)", cold)):
        print(f"proved_rules({len(rules)} built-in rules), {name}: {1e3 * statistics.median(x[0] for x in xs):.2f} ms "
              f"thread CPU, {1e3 * statistics.median(x[1] for x in xs):.2f} ms wall")


def _child(code: str, env: dict) -> tuple:
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    w0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, time.perf_counter() - w0


def _imports(reps: int) -> None:
    with tempfile.TemporaryDirectory(prefix="cuvil-gate-overheads-") as tmp:
        src = os.path.join(tmp, "src")
        shutil.copytree(SRC, src, ignore=shutil.ignore_patterns("__pycache__"))
        base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        base["PYTHONPATH"] = src
        nopyc = {**base, "PYTHONDONTWRITEBYTECODE": "1"}

        def clear():
            for root, dirs, _ in os.walk(src):
                if "__pycache__" in dirs:
                    shutil.rmtree(os.path.join(root, "__pycache__"))
                    dirs.remove("__pycache__")

        rows = {"no .pyc (PYTHONDONTWRITEBYTECODE=1)": [], "with .pyc": [], "with .pyc, + Hypothesis": []}
        _child("import cuvil.cli", base)
        for _ in range(reps):
            clear()
            rows["no .pyc (PYTHONDONTWRITEBYTECODE=1)"].append(_child("import cuvil.cli", nopyc))
            _child("import cuvil.cli, hypothesis", base)              # writes the .pyc files again
            rows["with .pyc"].append(_child("import cuvil.cli", base))
            rows["with .pyc, + Hypothesis"].append(_child(
                "import cuvil.cli, cuvil.verify, cuvil.testing.strategies", base))
        hyp = subprocess.run([sys.executable, "-c", "import cuvil.cli, sys; print('hypothesis' in sys.modules)"],
                             env=base, capture_output=True, text=True).stdout.strip()
    for name, xs in rows.items():
        print(f"fresh `import cuvil.cli`, {name}: {statistics.median(x[0] for x in xs):.2f} s CPU, "
              f"{statistics.median(x[1] for x in xs):.2f} s wall")
    print(f"Hypothesis imported by `import cuvil.cli`: {hyp}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9, help="interleaved repetitions (default 9)")
    args = ap.parse_args()
    from cuvil.targets.x86.cpu import cpu_label
    print(f"CPU: {cpu_label()}; {os.cpu_count()} cores; load average at start {os.getloadavg()[0]:.2f}")
    _proved_rules(max(args.reps, 15))
    _imports(args.reps)
    print(f"load average at end {os.getloadavg()[0]:.2f}; medians of interleaved repetitions")


if __name__ == "__main__":
    main()

"""A pytest plugin that writes each test's CPU seconds (the test process and the children it waited for) and
wall seconds, one JSON line per test, to ``$CPUPROF_OUT`` (default ``cpu_profile.jsonl``). CPU time, unlike the
wall time of ``--durations``, does not grow when other work shares the machine, so it ranks what the suite costs
(the basis of the ``slow`` marks, :mod:`cuvil.testing.slow`)::

    PYTHONPATH=src:scripts CPUPROF_OUT=/tmp/prof.jsonl python3 -m pytest -q -n 2 -p pytest_cpu_profile
    python3 scripts/pytest_cpu_profile.py /tmp/prof.jsonl          # CPU seconds per module, then the top tests

Processes a test does not wait for (a Ray cluster's workers) are not counted.

``--costs FILE`` writes each module's CPU seconds to FILE (``tests/module_cpu_seconds.json``), from which
``tests/conftest.py`` hands pytest-xdist the costliest modules first; ``--exclude IDS`` (a file of test ids, one a
line: ``pytest --co -q -m slow``) leaves out tests the gate skips::

    python3 scripts/pytest_cpu_profile.py --costs tests/module_cpu_seconds.json --exclude slow_ids.txt /tmp/prof.jsonl"""
import collections
import json
import os
import resource
import sys
import time

_START = {}


def _cpu() -> float:
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def pytest_runtest_protocol(item, nextitem):
    _START[item.nodeid] = (_cpu(), time.perf_counter())


def pytest_runtest_logfinish(nodeid, location):
    c0, w0 = _START.pop(nodeid, (None, None))
    if c0 is None:
        return
    with open(os.environ.get("CPUPROF_OUT", "cpu_profile.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps({"id": nodeid, "cpu": _cpu() - c0, "wall": time.perf_counter() - w0}) + "\n")


def module_costs(rows) -> dict:
    """Module path -> CPU seconds of its tests, costliest first."""
    by = collections.Counter()
    for r in rows:
        by[r["id"].split("::")[0]] += r["cpu"]
    return {mod: round(cpu, 1) for mod, cpu in by.most_common()}


def main(argv) -> None:
    costs = exclude = None
    paths = list(argv)
    for flag in ("--costs", "--exclude"):
        if flag in paths:
            k = paths.index(flag)
            value = paths[k + 1]
            del paths[k:k + 2]
            if flag == "--costs":
                costs = value
            else:
                with open(value, encoding="utf-8") as f:
                    exclude = {ln.strip() for ln in f if "::" in ln}
    rows = [json.loads(line) for p in paths for line in open(p, encoding="utf-8") if line.strip()]
    rows = [r for r in rows if not exclude or r["id"] not in exclude]
    if costs:
        with open(costs, "w", encoding="utf-8") as f:
            json.dump(module_costs(rows), f, indent=1)
            f.write("\n")
    by = collections.defaultdict(lambda: [0.0, 0])
    for r in rows:
        by[r["id"].split("::")[0]][0] += r["cpu"]
        by[r["id"].split("::")[0]][1] += 1
    print(f"{sum(r['cpu'] for r in rows):.0f} s of CPU in {len(rows)} tests")
    for mod, (cpu, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[:30]:
        print(f"{cpu:8.1f} s {n:5d} tests  {mod}")
    for r in sorted(rows, key=lambda r: -r["cpu"])[:30]:
        print(f"{r['cpu']:8.1f} s  {r['id']}")


if __name__ == "__main__":
    main(sys.argv[1:])

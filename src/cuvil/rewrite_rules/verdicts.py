"""Proof verdicts: shipped with the package for the built-in rules, cached on disk for user rules.

Verdicts are keyed by :func:`cuvil.rewrite_rules.prove.rule_key` (the rule's text and the semantics'
versions), so an edited rule or changed op semantics is proved again. ``rules/verdicts.json`` holds the
built-in rules' verdicts; a test re-proves them all and fails when the file is stale.
"""
from __future__ import annotations

import importlib.resources
import json
import os
import tempfile
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import attrs

from ..dsl.ast import Compare, FuncCall, ListLit, Rule, Var
from ..dsl.parser import load_rules
from .commutativity import COMMUTATIVE_OPS, DOMAINS, all_facts, domains_of, fact_key, prove_fact
from .prove import ALL_DTYPES, DEFAULT_TIMEOUT_MS, RuleRejectedError, Verdict, ops_in, prove_rule, rule_key, var_kinds

SHIPPED_NAME = "verdicts.json"


def builtin_rules_dir() -> str:
    """Installed: the package ``cuvil.rules`` (mapped from the repository's ``rules/``); in a source tree
    used without installing (``PYTHONPATH=src``): the repository's ``rules/`` itself."""
    try:
        # Through importlib.resources, not `import cuvil.rules`: the rules are data, and an import statement
        # would read (to import-linter and grimp) as importing the cuvil package itself, a layer above this one.
        return os.path.abspath(str(importlib.resources.files("cuvil.rules")))
    except ModuleNotFoundError:
        here = os.path.dirname(os.path.abspath(__file__))
        return os.path.normpath(os.path.join(here, "..", "..", "..", "rules"))


_BUILTIN: Dict[tuple, List[Rule]] = {}


def builtin_rules() -> List[Rule]:
    """The built-in rules, parsed once per process (re-read if a file changes)."""
    d = builtin_rules_dir()
    files = sorted(f for f in os.listdir(d) if f.endswith(".rule"))
    key = tuple((f, os.stat(os.path.join(d, f)).st_mtime_ns) for f in files)
    if key not in _BUILTIN:
        _BUILTIN.clear()
        _BUILTIN[key] = load_rules(d)
    return list(_BUILTIN[key])


def user_cache_path() -> str:
    base = os.environ.get("CUVIL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cuvil")
    return os.path.join(base, "proofs.json")


def _read(path: str) -> Dict[str, dict]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: str, data: Dict[str, dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


class _PerRule:
    """A memo of values computed from a rule object and a verdict, by identity (both are kept, so their ids are
    not reused): every compile runs the same built-in rule objects through :func:`proved_rules`, and their keys,
    verdicts and restricted forms cost ~10 ms per compile when recomputed. Cleared when it grows large (rules
    loaded afresh for each compile of a long-running process)."""

    LIMIT = 4096

    def __init__(self):
        self._memo: Dict[Tuple[int, int], tuple] = {}

    def get(self, rule: Rule, verdict: Optional[Verdict], make):
        key = (id(rule), id(verdict))
        hit = self._memo.get(key)
        if hit is not None and hit[0] is rule and hit[1] is verdict:
            return hit[2]
        value = make()
        if len(self._memo) >= self.LIMIT:
            self._memo.clear()
        self._memo[key] = (rule, verdict, value)
        return value


_RULE_KEYS = _PerRule()


def _key(rule: Rule) -> str:
    """:func:`rule_key`, memoised per rule object."""
    return _RULE_KEYS.get(rule, None, lambda: rule_key(rule))


class VerdictStore:
    """Shipped verdicts (read-only) in front of the user's cache (read-write)."""

    def __init__(self, shipped_path: Optional[str] = None, cache_path: Optional[str] = None):
        self.shipped_path = shipped_path or os.path.join(builtin_rules_dir(), SHIPPED_NAME)
        self.cache_path = cache_path or user_cache_path()
        self.shipped = _read(self.shipped_path)
        self.cache = _read(self.cache_path)
        self._parsed: Dict[str, Verdict] = {}      # rule key -> its record as a Verdict (records never change)
        self.restricted = _PerRule()               # restrict_to_proof's results (they depend on the store's facts)

    def get(self, rule: Rule) -> Optional[Verdict]:
        key = _key(rule)
        v = self._parsed.get(key)
        if v is None:
            d = self.shipped.get(key) or self.cache.get(key)
            if not d:
                return None
            v = self._parsed[key] = Verdict.from_json(d)
        return v

    def put(self, v: Verdict) -> None:
        if v.status == "unknown":
            return  # a timeout may succeed with more time: never cache it
        self._put(v.key, v.to_json())

    def get_fact(self, key: str) -> Optional[dict]:
        """A commutativity fact's record (:mod:`cuvil.rewrite_rules.commutativity`), shipped or cached."""
        return self.shipped.get(key) or self.cache.get(key)

    def put_fact(self, key: str, record: dict) -> None:
        if record["status"] != "unknown":
            self._put(key, record)

    def _put(self, key: str, record: dict) -> None:
        self.cache[key] = record
        self._parsed.pop(key, None)
        try:
            _write(self.cache_path, self.cache)
        except OSError:
            pass  # an unwritable cache costs time, not correctness


# Verdicts reached in this process, unknown ones included, so repeated optimize() calls do not retry them.
_SESSION: Dict[str, Verdict] = {}
_SESSION_FACTS: Dict[str, dict] = {}


def fact_proved(op: str, domain: str, store: Optional["VerdictStore"] = None) -> bool:
    """Whether ``op`` is proved commutative in ``domain``: from the store (shipped or cached), else proved
    now (and cached)."""
    key = fact_key(op, domain)
    record = (store.get_fact(key) if store is not None else None) or _SESSION_FACTS.get(key)
    if record is None:
        record = prove_fact(op, domain)
        _SESSION_FACTS[key] = record
        if store is not None:
            store.put_fact(key, record)
    return record["status"] == "proved"


def verdicts(rules: Sequence[Rule], *, store: Optional[VerdictStore] = None, use_cache: bool = True,
             timeout_ms: int = DEFAULT_TIMEOUT_MS) -> List[Tuple[Verdict, bool]]:
    """(verdict, came from the cache) for each rule, proving what no cache holds."""
    if use_cache and store is None:
        store = _default_store()
    out = []
    for r in rules:
        v = store.get(r) if store is not None else None
        if v is None and use_cache:
            v = _SESSION.get(_key(r))
        if v is not None and v.rule == r.name:
            out.append((v, True))
            continue
        v = prove_rule(r, timeout_ms)
        _SESSION[v.key] = v
        if store is not None:
            store.put(v)
        out.append((v, False))
    return out


_STORE: Optional[VerdictStore] = None


def _default_store() -> VerdictStore:
    global _STORE
    if _STORE is None or _STORE.cache_path != user_cache_path():
        _STORE = VerdictStore()
    return _STORE


def proved_rules(rules: Sequence[Rule], *, on_unproved: str = "error", allow_bounded: bool = False,
                 proofs: Optional[Dict[str, Verdict]] = None, **kw) -> List[Rule]:
    """The rules that may run, each restricted to the element types its proof covers.

    Proved rules run; ``bounded`` ones too, except bounded ``prove exact`` rules whose ops sum (their
    bit-exactness was checked on small shapes only), which run only with ``allow_bounded``. Refuted and
    unknown rules raise RuleRejectedError (``on_unproved="skip"``: they are left out). ``proofs``, when
    given, receives the verdict of every rule returned."""
    ok, bad = [], []
    for r, (v, _) in zip(rules, verdicts(rules, **kw)):
        if v.runnable(allow_bounded):
            ok.append((r, v))
        elif v.status in ("refuted", "unknown"):
            bad.append((r, v))
    if bad and on_unproved == "error":
        lines = [f"{r.loc}: rule {r.name} is {v.status} ({'prove ' + v.obligation})"
                 + (f": {v.counterexample}" if v.counterexample else f": {v.detail}" if v.detail else "")
                 for r, v in bad]
        raise RuleRejectedError("rules that are not proved may not run:\n" + "\n".join(lines))
    if proofs is not None:
        proofs.update({r.name: v for r, v in ok})
    store = kw.get("store") or _default_store()
    return [store.restricted.get(r, v, lambda r=r, v=v: restrict_to_proof(r, v, store)) for r, v in ok]


def restrict_to_proof(rule: Rule, v: Verdict, store: Optional[VerdictStore] = None) -> Rule:
    """``rule`` with a ``dtype(x) in [...]`` guard on each of its float operands, naming the element types
    ``v`` covers (none added when the proof covers every type), and the same types as ``Rule.dtypes``, which
    the matcher checks on every float-capable value of the match: the operands that have no name
    (wildcards, literals) and the intermediate values too. Kernel rules rewrite scalar expressions and keep
    their operands' types (exact ones run on float32 only, see cuvil.kernels.kernel_rules).

    ``Rule.commutative`` names the ops (Add, Mul) whose operands the matcher may swap: those proved
    commutative in every domain the rule's matches live in (the reals for ``prove real``, each covered
    element type for ``prove exact``), read from ``store`` (default: the shipped verdicts and the user's
    cache) or proved now."""
    store = store or _default_store()
    if rule.on == "kernel":
        domains = ("real",) if rule.proof == "real" else ("float",)
    else:
        domains = domains_of(rule.proof, v.dtypes, tuple(v.dtypes) == ALL_DTYPES)
    # Only the ops the pattern has; a domain without a fact (a bool-only guard, say) allows no swapping.
    present = {c.op for c in ops_in(rule.lhs)} & set(COMMUTATIVE_OPS)
    commutative = frozenset(op for op in sorted(present)
                            if domains and all(d in DOMAINS and fact_proved(op, d, store) for d in domains))
    rule = attrs.evolve(rule, commutative=commutative)
    if rule.on == "kernel" or tuple(v.dtypes) == ALL_DTYPES:
        return rule
    allowed = ListLit(tuple(Var(d, rule.loc) for d in v.dtypes), rule.loc)
    kinds = var_kinds(rule)
    leaves = sorted({n for n, k in kinds.items() if k == "float"})
    extra = tuple(Compare("in", FuncCall("dtype", (Var(n, rule.loc),), rule.loc), allowed, rule.loc) for n in leaves)
    return attrs.evolve(rule, guards=tuple(rule.guards) + extra, dtypes=tuple(v.dtypes))


def write_shipped(rules: Iterable[Rule], path: Optional[str] = None, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> List[Verdict]:
    """Prove ``rules`` and the commutativity facts from scratch and write their verdicts as the shipped file."""
    vs = [v for v, _ in verdicts(list(rules), use_cache=False, timeout_ms=timeout_ms)]
    _write(path or os.path.join(builtin_rules_dir(), SHIPPED_NAME), {**all_facts(), **{v.key: v.to_json() for v in vs}})
    return vs

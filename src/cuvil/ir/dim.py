"""Symbolic dimensions.

A dimension is a Python ``int`` or a :class:`SymExpr`: an integer polynomial over named symbols and opaque
atoms (floor division, modulo, max, min). Polynomials are kept in a canonical form, so two expressions
that are equal as polynomials compare equal (``N*2 + 1 == 1 + 2*N``). Any expression that turns out to be
constant collapses back to a plain ``int``, so static shapes stay plain tuples of ints.
"""
from __future__ import annotations

import ast
import math
import re
from typing import Dict, Iterable, Mapping, Tuple, Union

import attrs
import numpy as np

# Default range of a symbol that no profile bounds (documented in docs/architecture.md).
DEFAULT_MIN = 1
DEFAULT_MAX = 4096

# A symbol's name: an identifier, or dotted identifiers/numbers as models spell them (``x.2`` for axis 2 of
# input ``x``, ``p2o.DynamicDimension.0``). Shape expressions print and parse these names as they are; C
# code never uses them as identifiers (symbols are slots there).
_SYMBOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*")


def is_symbol_name(text) -> bool:
    """Whether ``text`` can name a symbol: ``N``, ``batch_size``, ``x.2``, ``p2o.DynamicDimension.0``."""
    return isinstance(text, str) and _SYMBOL_NAME.fullmatch(text) is not None


def symbol_name(text: str) -> str:
    """The symbol a spelling names (an ONNX ``dim_param`` may be any string): the spelling itself where it can
    name a symbol (``batch_size``, ``p2o.DynamicDimension.0``, ``x.2``); other characters (``batch size``)
    become ``_``, and a leading digit gets a ``_`` in front."""
    s = re.sub(r"[^0-9A-Za-z_.]", "_", text.strip())
    s = re.sub(r"\.(?=\.|$)|^\.", "_", s) or "dim"
    s = "_" + s if s[0].isdigit() else s
    return s if is_symbol_name(s) else re.sub(r"[^0-9A-Za-z_]", "_", s)


@attrs.frozen
class Symbol:
    """A named dimension with an inclusive range ``[min, max]`` and an optimisation point ``opt``; with
    ``multiple`` > 1 its values are only the multiples of ``multiple`` in the range (a detector whose
    feature pyramid needs H and W divisible by 32). min, opt and max are then multiples too."""

    name: str
    min: int = DEFAULT_MIN
    max: int = DEFAULT_MAX
    opt: int | None = None
    multiple: int = 1

    def __attrs_post_init__(self):
        if not is_symbol_name(self.name):
            raise ValueError(f"symbol name {self.name!r} is not an identifier or dotted name (x.2)")
        if not (0 <= self.min <= self.max):
            raise ValueError(f"symbol {self.name}: empty range [{self.min}, {self.max}]")
        if self.opt is not None and not (self.min <= self.opt <= self.max):
            raise ValueError(f"symbol {self.name}: opt {self.opt} outside [{self.min}, {self.max}]")
        if self.multiple < 1:
            raise ValueError(f"symbol {self.name}: multiple {self.multiple} is not >= 1")
        off = [v for v in (self.min, self.opt, self.max) if v is not None and v % self.multiple]
        if off:
            raise ValueError(f"symbol {self.name}: {off[0]} is not a multiple of {self.multiple}")

    def admits(self, value: int) -> bool:
        """Whether ``value`` is in the symbol's profile: in ``[min, max]`` and a multiple of ``multiple``."""
        return self.min <= value <= self.max and value % self.multiple == 0

    def profile_text(self) -> str:
        """``[32, 1280]``, or ``[32, 1280], multiples of 32``: the profile as messages print it."""
        return f"[{self.min}, {self.max}]" + (f", multiples of {self.multiple}" if self.multiple > 1 else "")

    @property
    def tuned(self) -> int:
        """The value kernels are tuned and specialised for: ``opt``, else ``min``."""
        return self.opt if self.opt is not None else self.min


# --- atoms -------------------------------------------------------------------------------------------

@attrs.frozen(order=True)
class Atom:
    """A leaf of a polynomial: a symbol name, or an opaque operation on sub-expressions."""

    kind: str  # "sym", "floordiv", "mod", "max", "min"
    args: Tuple = ()

    def __str__(self):
        if self.kind == "sym":
            return self.args[0]
        if self.kind in ("floordiv", "mod"):
            a, b = (_paren(x) for x in self.args)
            return f"{a}{'/' if self.kind == 'floordiv' else '%'}{b}"
        return f"{self.kind}({', '.join(str(a) for a in self.args)})"


def _paren(x) -> str:
    s = str(x)
    return s if isinstance(x, int) or is_symbol_name(s) or s.isdigit() else f"({s})"


Monomial = Tuple[Atom, ...]  # sorted, with repetition for powers


def _atom_key(a: "Atom"):
    """Total order over atoms (their arguments may be expressions, which have no ``<``)."""
    return (a.kind, tuple(_key(x) for x in a.args))


def _mono_key(m) -> tuple:
    return tuple(_atom_key(a) for a in m)


def _key(x):
    """Total order over ints and expressions, used to sort atom arguments canonically."""
    return (0, x, "") if isinstance(x, int) else (1, 0, str(x))


class SymExpr:
    """An integer polynomial over atoms. Immutable; use the arithmetic operators to build new ones."""

    __slots__ = ("terms", "_hash")

    def __init__(self, terms: Mapping[Monomial, int]):
        self.terms: Tuple[Tuple[Monomial, int], ...] = tuple(sorted(
            ((m, c) for m, c in terms.items() if c != 0), key=lambda t: (len(t[0]), _mono_key(t[0]))))
        self._hash = hash(self.terms)

    # construction ----------------------------------------------------------------------------------
    @staticmethod
    def symbol(name: str) -> "SymExpr":
        return SymExpr({(Atom("sym", (name,)),): 1})

    @staticmethod
    def _atom(kind: str, *args) -> "Dim":
        return SymExpr({(Atom(kind, tuple(args)),): 1})

    # queries -------------------------------------------------------------------------------------------
    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        if isinstance(other, SymExpr):
            return self.terms == other.terms
        return False  # a SymExpr is never constant: constants collapse to int

    def __ne__(self, other):
        return not self == other

    def __bool__(self):
        return True

    def __repr__(self):
        return f"SymExpr({self})"

    def __str__(self):
        parts = []
        for mono, coef in reversed(self.terms):  # highest degree first
            if not mono:
                body = str(abs(coef))
            else:
                wrap = len(mono) > 1 or coef != 1  # a/b*c would read as a/(b*c), -a/b as (-a)/b
                body = "*".join(_paren(a) if wrap and a.kind in ("floordiv", "mod") else str(a) for a in mono)
                if abs(coef) != 1:
                    body = f"{abs(coef)}*{body}"
            sign = "-" if coef < 0 else "+"
            parts.append((sign, body))
        first_sign, first = parts[0]
        out = ("-" if first_sign == "-" else "") + first
        for sign, body in parts[1:]:
            out += f" {sign} {body}"
        return out

    @property
    def free_symbols(self) -> frozenset:
        out = set()
        for mono, _ in self.terms:
            for a in mono:
                out |= _atom_symbols(a)
        return frozenset(out)

    def evaluate(self, env: Mapping[str, int]) -> int:
        total = 0
        for mono, coef in self.terms:
            prod = coef
            for a in mono:
                prod *= _eval_atom(a, env)
            total += prod
        return total

    # arithmetic (with another kind of operand, e.g. a kernel index expression, NotImplemented lets the
    # other operand's reflected method build the result) ----------------------------------------------
    def __add__(self, other):
        return add(self, other) if _is_dim(other) else NotImplemented

    __radd__ = __add__

    def __sub__(self, other):
        return add(self, mul(other, -1)) if _is_dim(other) else NotImplemented

    def __rsub__(self, other):
        return add(other, mul(self, -1)) if _is_dim(other) else NotImplemented

    def __mul__(self, other):
        return mul(self, other) if _is_dim(other) else NotImplemented

    __rmul__ = __mul__

    def __neg__(self):
        return mul(self, -1)

    def __floordiv__(self, other):
        return floordiv(self, other) if _is_dim(other) else NotImplemented

    def __rfloordiv__(self, other):
        return floordiv(other, self) if _is_dim(other) else NotImplemented

    def __mod__(self, other):
        return mod(self, other) if _is_dim(other) else NotImplemented


def _is_dim(x) -> bool:
    return isinstance(x, (int, SymExpr, np.integer))


Dim = Union[int, SymExpr]


def _atom_symbols(a: Atom) -> set:
    if a.kind == "sym":
        return {a.args[0]}
    out = set()
    for x in a.args:
        if isinstance(x, SymExpr):
            out |= x.free_symbols
    return out


def _eval_atom(a: Atom, env) -> int:
    if a.kind == "sym":
        try:
            return int(env[a.args[0]])
        except KeyError:
            raise KeyError(f"no value for symbol {a.args[0]}") from None
    vals = [evaluate(x, env) for x in a.args]
    if a.kind == "floordiv":
        return vals[0] // vals[1]
    if a.kind == "mod":
        return vals[0] % vals[1]
    if a.kind == "max":
        return max(vals)
    if a.kind == "min":
        return min(vals)
    raise ValueError(a.kind)


def _poly(x) -> Dict[Monomial, int]:
    if isinstance(x, SymExpr):
        return dict(x.terms)
    if isinstance(x, (int,)) and not isinstance(x, bool):
        return {(): int(x)} if x else {}
    if isinstance(x, np.integer):
        return {(): int(x)} if x else {}
    raise TypeError(f"not a dimension: {x!r}")


def _make(terms: Dict[Monomial, int]) -> Dim:
    terms = {m: c for m, c in terms.items() if c}
    if not terms:
        return 0
    if list(terms) == [()]:
        return terms[()]
    return SymExpr(terms)


def as_dim(x) -> Dim:
    """Normalise an int, numpy integer, symbol name or expression string into a dimension."""
    if isinstance(x, str):
        return parse_dim(x)
    return _make(_poly(x))


def add(a, b) -> Dim:
    out = _poly(a)
    for m, c in _poly(b).items():
        out[m] = out.get(m, 0) + c
    return _make(out)


def mul(a, b) -> Dim:
    pa, pb = _poly(a), _poly(b)
    out: Dict[Monomial, int] = {}
    for ma, ca in pa.items():
        for mb, cb in pb.items():
            m = tuple(sorted(ma + mb, key=_atom_key))
            out[m] = out.get(m, 0) + ca * cb
    return _make(out)


def _content(p: Dict[Monomial, int]) -> int:
    return math.gcd(*p.values()) if p else 0


def floordiv(a, b) -> Dim:
    """``a // b`` (floor division), exact when every coefficient of ``a`` divides by the constant ``b``."""
    a, b = as_dim(a), as_dim(b)
    if isinstance(b, int):
        if b == 0:
            raise ZeroDivisionError("dimension divided by zero")
        if b == 1:
            return a
        if isinstance(a, int):
            return a // b
        pa = _poly(a)
        if b > 0 and all(c % b == 0 for c in pa.values()):
            return _make({m: c // b for m, c in pa.items()})
        # (k*b*X + r) // b == k*X + r // b for symbols >= 0 when r is constant in [0, b)
        const = pa.get((), 0)
        if b > 0 and all(c % b == 0 for m, c in pa.items() if m):
            return add(_make({m: c // b for m, c in pa.items() if m}), const // b)
        if b > 0 and not 0 <= const < b:
            # Canonical form: (P + r) // b == (P + r mod b) // b + r div b, so equal sizes print alike.
            q, r = divmod(const, b)
            return add(floordiv(add(a, r - const), b), q)
    else:
        if a == b:
            return 1
        pa, pb = _poly(a), _poly(b)
        # exact division by a single monomial: (N*C) // N == C
        if len(pb) == 1:
            (mb, cb), = pb.items()
            if all(_divides_mono(mb, m) and c % cb == 0 for m, c in pa.items()):
                return _make({_strip_mono(m, mb): c // cb for m, c in pa.items()})
    return SymExpr._atom("floordiv", a, b)


def ceildiv(a, b) -> Dim:
    b = as_dim(b)
    if isinstance(b, int) and b > 0:
        return floordiv(add(a, b - 1), b)  # same canonical form as explicit padding arithmetic
    return -floordiv(-as_dim(a), b)


def _divides_mono(d: Monomial, m: Monomial) -> bool:
    rest = list(m)
    for a in d:
        if a in rest:
            rest.remove(a)
        else:
            return False
    return True


def _strip_mono(m: Monomial, d: Monomial) -> Monomial:
    rest = list(m)
    for a in d:
        rest.remove(a)
    return tuple(rest)


def mod(a, b) -> Dim:
    a, b = as_dim(a), as_dim(b)
    if isinstance(a, int) and isinstance(b, int):
        return a % b
    if isinstance(b, int) and b > 0 and all(c % b == 0 for c in _poly(a).values()):
        return 0
    return SymExpr._atom("mod", a, b)


def _extremum(kind: str, pick, xs) -> Dim:
    """max/min of dimensions: constants folded, duplicates removed, argument order canonical."""
    xs = [as_dim(x) for x in xs]
    ints = [x for x in xs if isinstance(x, int)]
    syms = []
    for x in xs:
        if isinstance(x, SymExpr) and x not in syms:
            syms.append(x)
    if not syms:
        return pick(ints)
    args = ([pick(ints)] if ints else []) + sorted(syms, key=_key)
    return args[0] if len(args) == 1 else SymExpr._atom(kind, *args)


def dmax(*xs) -> Dim:
    return _extremum("max", max, xs)


def dmin(*xs) -> Dim:
    return _extremum("min", min, xs)


def is_static(d) -> bool:
    return isinstance(d, int)


def evaluate(d: Dim, env: Mapping[str, int]) -> int:
    return d if isinstance(d, int) else d.evaluate(env)


def map_atoms(d: Dim, fn) -> Dim:
    """``d`` rebuilt, canonical, with every atom ``a`` of its polynomial replaced by the dim ``fn(a)``."""
    if isinstance(d, int):
        return d
    total: Dim = 0
    for mono, coef in d.terms:
        prod: Dim = coef
        for a in mono:
            prod = mul(prod, fn(a))
        total = add(total, prod)
    return total


def substitute(d: Dim, env: Mapping[str, Dim]) -> Dim:
    """``d`` with the symbols of ``env`` replaced by their dims (ints or expressions), kept canonical."""
    return map_atoms(d, lambda a: _substitute_atom(a, env))


def _substitute_atom(a: Atom, env) -> Dim:
    if a.kind == "sym":
        return env.get(a.args[0], SymExpr({(a,): 1}))
    args = [substitute(x, env) for x in a.args]
    return {"floordiv": floordiv, "mod": mod, "max": dmax, "min": dmin}[a.kind](*args)


def with_multiples(d: Dim, multiples: Mapping[str, int]) -> Dim:
    """``d`` in a canonical form that knows each symbol ``S`` of ``multiples`` is ``m*k`` (``{"H": 32}``): the
    sizes a stride-2 pyramid computes from H (``((H + 1)/2 + 1)/2``, ``2*(H/8)``) are all the one expression
    ``H/4`` then, so equal sizes compare equal and broadcasts between them are decided. ``d`` is rewritten
    over ``k`` (the algebra then divides exactly) and each ``c*k`` back as ``(c/g)*(S/(m/g))``,
    ``g = gcd(c, m)``."""
    multiples = {k: m for k, m in multiples.items() if m > 1}
    if isinstance(d, int) or not (free_symbols(d) & multiples.keys()):
        return d
    quotient = {k: f"{k}.__k{m}" for k, m in multiples.items()}
    over_k = substitute(d, {k: mul(m, SymExpr.symbol(quotient[k])) for k, m in multiples.items()})
    back = {q: (k, multiples[k]) for k, q in quotient.items()}
    return _from_quotients(over_k, back)


def _from_quotients(d: Dim, back: Mapping[str, Tuple[str, int]]) -> Dim:
    if isinstance(d, int):
        return d
    total: Dim = 0
    for mono, coef in d.terms:
        prod: Dim = 1
        for a in mono:
            if a.kind == "sym" and a.args[0] in back:
                name, m = back[a.args[0]]
                g = math.gcd(coef, m)
                coef //= g
                prod = mul(prod, floordiv(SymExpr.symbol(name), m // g))
            elif a.kind == "sym":
                prod = mul(prod, SymExpr({(a,): 1}))
            else:
                args = [_from_quotients(x, back) for x in a.args]
                prod = mul(prod, {"floordiv": floordiv, "mod": mod, "max": dmax, "min": dmin}[a.kind](*args))
        total = add(total, mul(coef, prod))
    return total


def free_symbols(d: Dim) -> frozenset:
    return frozenset() if isinstance(d, int) else d.free_symbols


def product(dims: Iterable[Dim]) -> Dim:
    out: Dim = 1
    for d in dims:
        out = mul(out, d)
    return out


def bounds(d: Dim, ranges: Mapping[str, Tuple[int, int]]) -> Tuple[int, int]:
    """Interval of ``d`` when each symbol ranges over ``ranges[name] = (lo, hi)``."""
    if isinstance(d, int):
        return d, d
    lo = hi = 0
    for mono, coef in d.terms:
        mlo, mhi = coef, coef
        for a in mono:
            alo, ahi = _atom_bounds(a, ranges)
            cands = (mlo * alo, mlo * ahi, mhi * alo, mhi * ahi)
            mlo, mhi = min(cands), max(cands)
        lo, hi = lo + mlo, hi + mhi
    return lo, hi


def _atom_bounds(a: Atom, ranges) -> Tuple[int, int]:
    if a.kind == "sym":
        if a.args[0] not in ranges:  # a size known only at run time (a Range's length from data)
            raise ValueError(f"cannot bound {a}: {a.args[0]!r} has no range")
        return ranges[a.args[0]]
    bs = [bounds(x, ranges) for x in a.args]
    if a.kind == "max":
        return max(b[0] for b in bs), max(b[1] for b in bs)
    if a.kind == "min":
        return min(b[0] for b in bs), min(b[1] for b in bs)
    (alo, ahi), (blo, bhi) = bs
    if a.kind == "floordiv" and blo > 0:
        cands = [alo // blo, alo // bhi, ahi // blo, ahi // bhi]
        return min(cands), max(cands)
    if a.kind == "mod" and blo > 0:
        return 0, bhi - 1
    raise ValueError(f"cannot bound {a}")


# --- parsing -----------------------------------------------------------------------------------------

def parse_dim(text: str) -> Dim:
    """Parse ``"N"``, ``"2*N + 1"``, ``"(H - 1)/2 + 1"`` (``/`` is floor division), ``"max(A, B)"``; dotted
    symbol names (``x.2 * 2``) included."""
    dotted: Dict[str, str] = {}   # placeholder identifier -> dotted name

    def placeholder(m):   # Python would read x.2 as an attribute access or a syntax error
        for k, v in dotted.items():
            if v == m.group(0):
                return k
        key = f"__cuvil_dotted_{len(dotted)}"
        dotted[key] = m.group(0)
        return key

    source = _DOTTED_IN_TEXT.sub(placeholder, text.strip())
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"bad dimension expression {text!r}: {e.msg}") from None
    return _from_ast(tree, text, dotted)


_DOTTED_IN_TEXT = re.compile(r"(?<![A-Za-z0-9_.])[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)+")


def _from_ast(n, text, dotted: Mapping[str, str]) -> Dim:
    if isinstance(n, ast.Constant) and isinstance(n.value, int) and not isinstance(n.value, bool):
        return n.value
    if isinstance(n, ast.Name):
        return SymExpr.symbol(dotted.get(n.id, n.id))
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
        return mul(_from_ast(n.operand, text, dotted), -1)
    if isinstance(n, ast.BinOp):
        a, b = _from_ast(n.left, text, dotted), _from_ast(n.right, text, dotted)
        ops = {ast.Add: add, ast.Sub: lambda x, y: add(x, mul(y, -1)), ast.Mult: mul,
               ast.Div: floordiv, ast.FloorDiv: floordiv, ast.Mod: mod}
        if type(n.op) in ops:
            return ops[type(n.op)](a, b)
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("max", "min"):
        args = [_from_ast(a, text, dotted) for a in n.args]
        return dmax(*args) if n.func.id == "max" else dmin(*args)
    raise ValueError(f"bad dimension expression {text!r}")


def dim_str(d: Dim) -> str:
    return str(d)

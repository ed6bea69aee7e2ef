"""Text -> rule AST. Syntax errors and the semantic checks of :mod:`cuvil.dsl.validate` are reported as
``path:line:col: message`` with the offending line; nothing else escapes, whatever the input."""
from __future__ import annotations

import functools
import os
from typing import Iterable, List, Union

import lark
from lark import Lark, Transformer, v_args

from .ast import PHASES, Coalesce, Compare, FuncCall, ListLit, Loc, Num, OpCall, OptionalVar, Rule, Var, Wildcard
from .errors import RuleError
from .validate import validate_rules

GRAMMAR = os.path.join(os.path.dirname(__file__), "rule.lark")

_TOKEN_NAMES = {
    "NAME": "a name", "INT": "an integer", "NUMBER": "a number", "LPAR": "'('", "RPAR": "')'", "COMMA": "','",
    "EQUAL": "'='", "COMPOP": "a comparison", "PLUS": "'+'", "MINUS": "'-'", "STAR": "'*'", "SLASH": "'/'",
    "LSQB": "'['", "RSQB": "']'", "RULE": "'rule'", "WHEN": "'when'", "PROVE": "'prove'", "BENEFIT": "'benefit'",
    "ON": "'on'", "AND": "'and'", "__ANON_0": "'=>'", "DOUBLE_DOT": "'..'", "$END": "end of file",
    "QMARK": "'?'",
}


@functools.lru_cache(maxsize=1)
def _lark() -> Lark:
    with open(GRAMMAR) as f:
        return Lark(f.read(), parser="lalr", propagate_positions=True, maybe_placeholders=False)


class _ToAst(Transformer):
    def __init__(self, path: str, source: str):
        super().__init__()
        self.path, self.source = path, source

    def _loc(self, meta_or_tok) -> Loc:
        if isinstance(meta_or_tok, Loc):  # an AST node's own location (its column is ``col``, not ``column``)
            return Loc(self.path, meta_or_tok.line, meta_or_tok.col)
        line = getattr(meta_or_tok, "line", 0) or 0
        col = getattr(meta_or_tok, "column", 0) or 0
        return Loc(self.path, line, col)

    def _err(self, msg, where):
        loc = self._loc(where)
        raise RuleError(msg, loc.path, loc.line, loc.col, self.source)

    @v_args(meta=True)
    def rule(self, meta, items):
        name = items[0]
        benefit, on, guards = 1, "graph", ()
        rest = list(items[1:])
        while rest and isinstance(rest[0], tuple) and rest[0][0] in ("benefit", "on"):
            tag, val = rest.pop(0)
            if tag == "benefit":
                benefit = val
            else:
                on = val
        lhs = rest.pop(0)
        if rest and isinstance(rest[0], tuple) and rest[0][0] == "when":
            guards = rest.pop(0)[1]
        rhs, proof = rest
        if not isinstance(lhs, OpCall):
            self._err("a rule's pattern must be an op application, e.g. Relu(x)", getattr(lhs, "loc", meta))
        text = self.source[meta.start_pos:meta.end_pos] if meta.start_pos is not None else ""
        return Rule(str(name), benefit, on, lhs, tuple(guards), rhs, proof, self._loc(meta), text)

    def benefit(self, items):
        return ("benefit", int(items[0]))

    def on_clause(self, items):
        tok = items[0]
        if str(tok) not in PHASES:
            self._err(f"'on' takes {', '.join(PHASES[:-1])} or {PHASES[-1]}, not {str(tok)!r}", tok)
        return ("on", str(tok))

    def when(self, items):
        return ("when", tuple(items))

    @v_args(meta=True)
    def guard(self, meta, items):
        if len(items) == 1:
            return items[0]
        left, op, right = items
        return Compare(str(op), left, right, self._loc(meta))

    @v_args(meta=True)
    def in_guard(self, meta, items):
        left, right = items
        return Compare("in", left, right, self._loc(meta))

    def prove(self, items):
        tok = items[0]
        if str(tok) not in ("exact", "real"):
            self._err(f"'prove' takes exact or real, not {str(tok)!r}", tok)
        return str(tok)

    def _binop(op):
        @v_args(meta=True)
        def f(self, meta, items):
            return OpCall(op, tuple(items), (), None, self._loc(meta))
        return f

    add, sub, mul, div = _binop("Add"), _binop("Sub"), _binop("Mul"), _binop("Div")

    @v_args(meta=True)
    def neg(self, meta, items):
        (x,) = items
        if isinstance(x, Num):
            return Num(-x.value, x.loc)
        return OpCall("Neg", (x,), (), None, self._loc(meta))

    def num(self, items):
        tok = items[0]
        s = str(tok)
        value = float(s) if any(c in s for c in ".eEna") else int(s)
        return Num(value, self._loc(tok))

    def name(self, items):
        tok = items[0]
        if str(tok) == "_":
            return Wildcard(self._loc(tok))
        return Var(str(tok), self._loc(tok))

    @v_args(meta=True)
    def list(self, meta, items):
        return ListLit(tuple(items), self._loc(meta))

    @v_args(meta=True)
    def coalesce(self, meta, items):
        left, right = items
        return Coalesce(left, right, self._loc(meta))

    def optional(self, items):
        tok = items[0]
        if str(tok) == "_":
            self._err("_? is not an input: name the optional input (b?)", tok)
        return OptionalVar(str(tok), self._loc(tok))

    def kwarg(self, items):
        return ("kw", str(items[0]), items[1], items[0])

    def rest(self, items):
        return ("rest", str(items[0]), items[0])

    @v_args(meta=True)
    def call(self, meta, items):
        fname = items[0]
        args, kws, rest = [], [], None
        for a in items[1:]:
            if isinstance(a, tuple) and a[0] == "kw":
                if any(k == a[1] for k, _ in kws):
                    self._err(f"attribute {a[1]!r} given twice", a[3])
                kws.append((a[1], a[2]))
            elif isinstance(a, tuple) and a[0] == "rest":
                if rest is not None:
                    self._err("only one ..rest per call", a[2])
                rest = a[1]
            else:
                if kws or rest:
                    self._err("positional inputs must come before attributes", _Pos(a.loc) if hasattr(a, "loc") else meta)
                args.append(a)
        loc = self._loc(fname)
        if str(fname)[:1].isupper():
            return OpCall(str(fname), tuple(args), tuple(kws), rest, loc)
        if kws or rest:
            self._err(f"{fname}(...) takes no attributes", fname)
        return FuncCall(str(fname), tuple(args), loc)


class _Pos:
    def __init__(self, loc: Loc):
        self.line, self.column = loc.line, loc.col


def parse_rules(source: str, path: str = "<string>", *, validate: bool = True) -> List[Rule]:
    """Parse (and check against the op registry) the rules in ``source``."""
    try:
        tree = _lark().parse(source)
    except lark.exceptions.UnexpectedInput as e:
        raise _syntax_error(e, source, path) from None
    except RecursionError:
        raise RuleError("expression nested too deeply", path, 1, 1, source) from None
    except lark.exceptions.LarkError as e:  # pragma: no cover - defensive: any other parse failure
        raise RuleError(f"cannot parse: {e}", path, 1, 1, source) from None
    try:
        rules = list(_ToAst(path, source).transform(tree).children)
    except lark.exceptions.VisitError as e:
        if isinstance(e.orig_exc, RuleError):
            raise e.orig_exc from None
        if isinstance(e.orig_exc, RecursionError):
            raise RuleError("expression nested too deeply", path, 1, 1, source) from None
        raise
    except RecursionError:
        raise RuleError("expression nested too deeply", path, 1, 1, source) from None
    if validate:
        try:
            validate_rules(rules, source)
        except RecursionError:
            raise RuleError("expression nested too deeply", path, 1, 1, source) from None
    return rules


def _syntax_error(e: lark.exceptions.UnexpectedInput, source: str, path: str) -> RuleError:
    line, col = getattr(e, "line", 1) or 1, getattr(e, "column", 1) or 1
    if isinstance(e, lark.exceptions.UnexpectedCharacters):
        ch = source[e.pos_in_stream] if e.pos_in_stream is not None and e.pos_in_stream < len(source) else "?"
        msg = f"unexpected character {ch!r}"
    elif isinstance(e, lark.exceptions.UnexpectedEOF):
        msg = "unexpected end of file: the rule is incomplete"
    elif isinstance(e, lark.exceptions.UnexpectedToken):
        tok = e.token
        if tok.type == "$END":
            msg = "unexpected end of file: the rule is incomplete"
        else:
            msg = f"unexpected {str(tok)!r}"
        expected = sorted({_TOKEN_NAMES.get(t, repr(t)) for t in (e.expected or ()) if not t.startswith("__")})
        if expected and len(expected) <= 6:
            msg += f"; expected {', '.join(expected)}"
    else:
        msg = "syntax error"
    return RuleError(msg, path, line, col, source)


def load_rules(paths: Union[str, os.PathLike, Iterable[Union[str, os.PathLike]]]) -> List[Rule]:
    """Rules from ``.rule`` files and directories (their ``*.rule`` files, sorted); names must be unique."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: List[str] = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            files += sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".rule"))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise RuleError("no such rule file or directory", p, 0, 0,
                            hint="give .rule files or folders of them; `cuvil rules check` alone proves the built-in rules")
    rules: List[Rule] = []
    seen = {}
    for f in files:
        with open(f, encoding="utf-8") as fh:
            text = fh.read()
        for r in parse_rules(text, f):
            if r.name in seen:
                raise RuleError(f"rule {r.name!r} is already defined at {seen[r.name]}", r.loc.path, r.loc.line, r.loc.col, text)
            seen[r.name] = r.loc
            rules.append(r)
    return rules

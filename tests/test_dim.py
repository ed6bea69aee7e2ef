import pytest

from cuvil.ir.dim import (SymExpr, Symbol, bounds, ceildiv, dmax, evaluate, floordiv, mod, parse_dim, product)

N, S, H = (SymExpr.symbol(x) for x in "NSH")


def test_polynomials_are_canonical():
    assert N * 2 + 1 == 1 + 2 * N
    assert (N + S) * 2 == 2 * S + 2 * N
    assert str(2 * N + 1) == "2*N + 1"
    assert str(N * S - 3) == "N*S - 3"
    assert hash(N * 2) == hash(2 * N)


def test_constants_collapse_to_int():
    d = N + 3 - N
    assert d == 3 and isinstance(d, int)
    assert product([2, 3, 4]) == 24 and isinstance(product([2, 3]), int)


def test_floordiv_exact_and_opaque():
    assert floordiv(4 * N + 8, 4) == N + 2
    assert floordiv(4 * N + 9, 4) == N + 2          # (4N + 9) // 4 == N + 2 for every integer N
    assert floordiv(N * S * 12, 3 * S) == 4 * N
    assert floordiv(N * 12, N * 12) == 1
    opaque = floordiv(H - 1, 2) + 1
    assert str(opaque) == "(H + 1)/2"          # constants normalised into [0, 2): one form per size
    assert opaque == ceildiv(H, 2)
    for h in (1, 2, 7, 224):
        assert evaluate(opaque, {"H": h}) == (h - 1) // 2 + 1
    assert ceildiv(H, 2) != floordiv(H, 2)
    assert floordiv(H - 7, 3) == floordiv(H + 2, 3) - 3
    assert evaluate(ceildiv(H, 2), {"H": 7}) == 4
    with pytest.raises(ZeroDivisionError):
        floordiv(N, 0)


def test_mod_max_min():
    assert mod(6 * N, 3) == 0
    assert evaluate(mod(N, 4), {"N": 10}) == 2
    assert dmax(N, 1, N, 3) == dmax(3, N)
    assert dmax(2, 5) == 5
    assert evaluate(dmax(N, S), {"N": 2, "S": 9}) == 9


def test_parse_roundtrip():
    for text in ("N", "2*N + 1", "(H + 1)/2 + 1", "N*S", "max(N, S)", "-N + 4"):
        d = parse_dim(text)
        assert parse_dim(str(d)) == d
    assert parse_dim("N*2+1") == 2 * N + 1
    with pytest.raises(ValueError):
        parse_dim("N +")
    with pytest.raises(ValueError):
        parse_dim("f(N)")


def test_bounds_interval():
    assert bounds(2 * N + 1, {"N": (1, 8)}) == (3, 17)
    assert bounds(N * S, {"N": (1, 4), "S": (2, 3)}) == (2, 12)
    assert bounds(floordiv(H - 1, 2) + 1, {"H": (1, 9)}) == (1, 5)


def test_symbol_ranges_are_checked():
    assert Symbol("N", 1, 64, 8).opt == 8
    with pytest.raises(ValueError):
        Symbol("N", 5, 2)
    with pytest.raises(ValueError):
        Symbol("bad name")
    with pytest.raises(ValueError):
        Symbol("N", 1, 4, 9)

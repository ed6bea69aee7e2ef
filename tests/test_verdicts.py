"""Proof verdicts: shipped for the built-in rules (and current), cached for user rules, enforced in
optimize()."""
import json
import os

import pytest

import cuvil.rewrite_rules.verdicts as verdicts_mod
from cuvil import Pipeline
from cuvil.cli import main as cli_main
from cuvil.rewrite_rules.prove import RuleRejectedError, prove_rule, rule_key
from cuvil.rewrite_rules.verdicts import SHIPPED_NAME, builtin_rules, builtin_rules_dir

DEMO = os.path.join(os.path.dirname(__file__), "..", "src", "cuvil", "data", "demo_cnn.onnx")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(verdicts_mod, "_SESSION", {})
    monkeypatch.setattr(verdicts_mod, "_STORE", None)


def test_shipped_verdicts_are_current_and_proved():
    """CI re-proves every built-in rule: a stale or missing shipped verdict fails here."""
    with open(os.path.join(builtin_rules_dir(), SHIPPED_NAME)) as f:
        shipped = json.load(f)
    rules = builtin_rules()
    assert len(rules) >= 40
    stale = [r.name for r in rules if rule_key(r) not in shipped]
    assert not stale, f"rules/verdicts.json is stale for {stale}: run cuvil rules check --no-cache --write-verdicts"
    for r in rules:
        v = prove_rule(r)
        assert v.status == "proved", (r.name, v.status, v.counterexample, v.detail)
        assert shipped[rule_key(r)]["status"] == "proved"
    assert set(shipped) == {rule_key(r) for r in rules}, "verdicts.json holds verdicts of rules that no longer exist"


def test_fresh_install_proves_nothing(monkeypatch):
    def no_proving(*a, **k):
        raise AssertionError("a built-in rule was proved at first use")
    monkeypatch.setattr(verdicts_mod, "prove_rule", no_proving)
    opt = Pipeline.from_onnx(DEMO).optimize()
    assert opt.report.applied["fold_conv_bn"] == 2


def test_user_rules_are_proved_once_then_cached(tmp_path, monkeypatch):
    rule = tmp_path / "mine.rule"
    rule.write_text("# Relu(Relu(x)) -> Relu(x), my copy\nrule my_relu_relu benefit 50\n  Relu(Relu(x)) => Relu(x)\n  prove exact\n")
    calls = []
    real = verdicts_mod.prove_rule
    monkeypatch.setattr(verdicts_mod, "prove_rule", lambda r, *a: calls.append(r.name) or real(r, *a))
    Pipeline.from_onnx(DEMO).optimize(rules=rule)
    assert calls == ["my_relu_relu"]
    cache = json.loads(open(os.environ["CUVIL_CACHE_DIR"] + "/proofs.json").read())
    assert any(v["rule"] == "my_relu_relu" and v["status"] == "proved" for v in cache.values())
    monkeypatch.setattr(verdicts_mod, "_SESSION", {})
    monkeypatch.setattr(verdicts_mod, "_STORE", None)
    Pipeline.from_onnx(DEMO).with_rules(rule).optimize()
    assert calls == ["my_relu_relu"], "the cached verdict should have been used"


def test_refuted_user_rule_may_not_run(tmp_path):
    rule = tmp_path / "bad.rule"
    rule.write_text("rule add_zero\n  Add(x, 0) => x\n  prove exact\n")
    with pytest.raises(RuleRejectedError, match=r"bad.rule:1:1: rule add_zero is refuted .*x = -0.0: lhs = \+0.0, rhs = -0.0"):
        Pipeline.from_onnx(DEMO).optimize(rules=rule)
    # skipping is explicit
    Pipeline.from_onnx(DEMO).optimize(rules=rule, on_unproved="skip")


def test_cli_rules_check_exit_codes(tmp_path, capsys):
    good = tmp_path / "good.rule"
    good.write_text("rule neg_neg2\n  Neg(Neg(x)) => x\n  prove exact\n")
    assert cli_main(["rules", "check", str(good)]) == 0
    out = capsys.readouterr().out
    assert "neg_neg2" in out and "prove exact" in out and "proved" in out and "1/1 proved" in out
    bad = tmp_path / "refuted.rule"
    bad.write_text("rule add_zero\n  Add(x, 0) => x\n  prove exact\n")
    assert cli_main(["rules", "check", str(bad)]) == 1
    assert "counterexample: x = -0.0" in capsys.readouterr().out
    typo = tmp_path / "typo.rule"
    typo.write_text("rule r1\n  Rleu(x) => x\n  prove exact\n")
    assert cli_main(["rules", "check", str(typo)]) == 2
    assert f"{typo}:2:3: unknown op 'Rleu'" in capsys.readouterr().err

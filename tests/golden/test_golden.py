"""Golden tests: each model in tests/golden/models/ is imported and optimized; the printed IR must equal
tests/golden/expected/<name>.ir. Refresh with `pytest tests/golden --update-golden` after a deliberate
change, and review the diff like code."""
import os

import pytest

from cuvil import Pipeline
from cuvil.rewrite_rules.verdicts import builtin_rules, verdicts

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = sorted(f[:-5] for f in os.listdir(os.path.join(HERE, "models")) if f.endswith(".onnx"))
# Snapshots of rules that are only checked on bounded instances and claim bit-exactness over a sum
# (fold_matmul_add_to_gemm): off by default, so these models opt in to keep showing what the rule does.
ALLOW_BOUNDED = {"matmul_add_gemm"}


@pytest.mark.parametrize("name", MODELS)
def test_optimized_ir(name, update_golden):
    p = Pipeline.from_onnx(os.path.join(HERE, "models", f"{name}.onnx"))
    text = p.optimize(allow_bounded=name in ALLOW_BOUNDED).print_ir()
    path = os.path.join(HERE, "expected", f"{name}.ir")
    if update_golden or not os.path.exists(path):
        with open(path, "w") as f:
            f.write(text)
        if not update_golden:
            pytest.fail(f"{path} did not exist; written now, review it and commit it")
    with open(path) as f:
        assert text == f.read(), f"printed IR of {name} changed; run pytest --update-golden if intended"


def test_bounded_order_dependent_rule_is_off_by_default():
    """Without the opt-in, the Gemm fold fires only if its verdict lets it run by default (a bounded
    ``prove exact`` rule over a sum does not; a generic proof would)."""
    rule = next(r for r in builtin_rules() if r.name == "fold_matmul_add_to_gemm")
    (v, _), = verdicts([rule])
    text = Pipeline.from_onnx(os.path.join(HERE, "models", "matmul_add_gemm.onnx")).optimize().print_ir()
    assert ("Gemm(" in text) == v.on_by_default
    assert v.on_by_default or (v.status == "bounded" and v.order_dependent)

"""Golden tests: each model in tests/golden/models/ is imported and optimized; the printed IR must equal
tests/golden/expected/<name>.ir. Refresh with `pytest tests/golden --update-golden` after a deliberate
change, and review the diff like code."""
import os

import pytest

from cuvil import Pipeline

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = sorted(f[:-5] for f in os.listdir(os.path.join(HERE, "models")) if f.endswith(".onnx"))


@pytest.mark.parametrize("name", MODELS)
def test_optimized_ir(name, update_golden):
    text = Pipeline.from_onnx(os.path.join(HERE, "models", f"{name}.onnx")).optimize().print_ir()
    path = os.path.join(HERE, "expected", f"{name}.ir")
    if update_golden or not os.path.exists(path):
        with open(path, "w") as f:
            f.write(text)
        if not update_golden:
            pytest.fail(f"{path} did not exist; written now, review it and commit it")
    with open(path) as f:
        assert text == f.read(), f"printed IR of {name} changed; run pytest --update-golden if intended"

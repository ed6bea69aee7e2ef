import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # test helpers (infer_harness, golden cases)


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/expected/* from the current output")


@pytest.fixture
def update_golden(request):
    return request.config.getoption("--update-golden")

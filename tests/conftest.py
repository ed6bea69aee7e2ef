import os

import pytest
from hypothesis import settings

# Hypothesis profiles: the default is quick; CI (CUVIL_HYPOTHESIS_PROFILE=ci) runs a fixed seed and more.
settings.register_profile("default", max_examples=15, deadline=None)
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("CUVIL_HYPOTHESIS_PROFILE", "default"))


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite the goldens (tests/golden/expected/*, tests/golden/replay/*) from the current output")


@pytest.fixture
def update_golden(request):
    return request.config.getoption("--update-golden")

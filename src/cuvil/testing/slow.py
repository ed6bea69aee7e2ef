"""The extended suite: tests marked ``slow`` run only with ``CUVIL_SLOW_TESTS=1`` (or ``pytest -m slow``).

The gate (``.ci/run``, the README's ``pytest -q -n auto``) skips them, each with its reason printed: a slow test
costs tens of seconds of CPU and repeats, on a larger model or a longer run, what a cheaper test of the gate
checks, and its marker says which (``@pytest.mark.slow(reason="104 s in CI; ...")``). ``tests/conftest.py``
applies the rule; a module whose fixture builds for several tests at once asks :func:`slow_tests_run` which
cases to build."""
import os

#: Set to 1 to run the extended suite.
SLOW_ENV = "CUVIL_SLOW_TESTS"


def slow_tests_run(config=None) -> bool:
    """Whether this run includes the tests marked ``slow``: with ``CUVIL_SLOW_TESTS=1``, or when pytest's ``-m``
    (``config``: the pytest config) names the marker without negating it (``pytest -m slow``)."""
    if os.environ.get(SLOW_ENV) == "1":
        return True
    expr = (config.getoption("markexpr", "") or "") if config is not None else ""
    return "slow" in expr and "not slow" not in expr

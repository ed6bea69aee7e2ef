"""`pip install -e '.[test]'` installs everything the tests import: each third-party module imported under
tests/ or src/cuvil/testing/ comes from a distribution in install_requires or the test extra, or from an
optional extra whose tests skip with a reason naming it (the GPU's cuda-python, torch). The README's test
command says so; the test extra once lacked PyYAML and 13 tests skipped."""
import ast
import configparser
import glob
import importlib.metadata
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Extras whose tests skip, with a reason naming the extra, when it is not installed.
OPTIONAL_EXTRAS = ("gpu", "torch", "plot")
#: Imported module -> distribution, for modules installed by no distribution here (an optional extra absent).
KNOWN = {"torch": "torch", "cuda": "cuda-python", "onnxscript": "onnxscript", "matplotlib": "matplotlib"}


def requirement_names(text: str) -> set:
    return {re.split(r"[\s<>=!~\[;]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")
            for line in text.strip().splitlines() if line.strip()}


def setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    extras = {k: requirement_names(v) for k, v in cfg["options.extras_require"].items()}
    return requirement_names(cfg["options"]["install_requires"]), extras


def imported_top_modules():
    files = glob.glob(os.path.join(ROOT, "tests", "**", "*.py"), recursive=True)
    files += glob.glob(os.path.join(ROOT, "src", "cuvil", "testing", "*.py"))
    local = {os.path.splitext(os.path.basename(p))[0] for p in files}
    found = {}
    for path in files:
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local and top != "cuvil":
                    found.setdefault(top, os.path.relpath(path, ROOT))
    return found


def distribution_of(module: str, index) -> str:
    dists = index.get(module) or [KNOWN.get(module, module)]
    return dists[0].lower().replace("_", "-")


def test_every_test_import_is_installed_by_the_test_extra():
    required, extras = setup_cfg()
    test_deps = required | extras["test"]
    optional = set().union(*(extras[e] for e in OPTIONAL_EXTRAS))
    index = importlib.metadata.packages_distributions()
    # import-linter brings grimp, which tests/test_layers.py imports
    test_deps |= {"grimp"} if "import-linter" in test_deps else set()
    missing = {m: (distribution_of(m, index), where) for m, where in imported_top_modules().items()
               if distribution_of(m, index) not in test_deps | optional}
    assert not missing, ("imported by tests but installed by neither install_requires nor the test extra "
                         f"(add them to setup.cfg's test extra): {missing}")


def test_the_test_extra_has_the_oracle_and_the_linter():
    _, extras = setup_cfg()
    assert {"pytest", "onnxruntime", "import-linter"} <= extras["test"]

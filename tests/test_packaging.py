"""setup.cfg lists its packages (the rules directory ships as the data package cuvil.rules, which `find:`
cannot express): every Python package under src/cuvil must be listed, or a wheel install lacks it while
the editable install the tests use still finds it."""
import configparser
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_package_is_listed_in_setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    listed = set(cfg["options"]["packages"].split())
    src = os.path.join(ROOT, "src")
    found = {os.path.relpath(d, src).replace(os.sep, ".")
             for d, _, files in os.walk(os.path.join(src, "cuvil")) if "__init__.py" in files}
    assert found - listed == set(), f"add these to [options] packages in setup.cfg: {sorted(found - listed)}"
    assert "cuvil.rules" in listed

"""Every `rule` block in docs/rules.md parses, and proves or is refuted as its first line says; the
README's Python example runs."""
import os
import re

import pytest

from cuvil.dsl.parser import parse_rules
from cuvil.rewrite_rules.prove import prove_rule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def blocks(path, lang):
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


RULE_BLOCKS = blocks("docs/rules.md", "rule")


def test_docs_have_rule_examples():
    assert len(RULE_BLOCKS) >= 6


@pytest.mark.parametrize("src", RULE_BLOCKS, ids=[re.search(r"rule (\w+)", b).group(1) for b in RULE_BLOCKS])
def test_rule_example(src):
    expect = re.match(r"# expect: (\w+)", src).group(1)
    (rule,) = parse_rules(src, "docs/rules.md")
    v = prove_rule(rule)
    # a generic proof supersedes a bounded check: an example documented as bounded may be proved
    assert v.status == expect or (expect, v.status) == ("bounded", "proved"), (v.status, v.counterexample, v.detail)
    if expect == "refuted":
        assert v.counterexample


def test_add_zero_counterexample_reads_as_documented():
    (rule,) = parse_rules("rule add_zero Add(x, 0) => x prove exact")
    assert prove_rule(rule).counterexample == "x = -0.0: lhs = +0.0, rhs = -0.0"


def test_readme_python_example_runs(monkeypatch):
    (code,) = [b for b in blocks("README.md", "python") if "Pipeline.from_onnx" in b][:1]
    monkeypatch.chdir(ROOT)
    exec(compile(code, "README.md", "exec"), {})


def test_targets_python_example_runs(monkeypatch, capsys):
    (code,) = [b for b in blocks("docs/targets.md", "python") if "PtxOptions" in b]
    monkeypatch.chdir(ROOT)
    exec(compile(code, "docs/targets.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "sm_80 False"
    assert out[1].startswith("arch is an option of the nvptx64-nvidia-cuda target only, not of x86_64-linux-gnu")


def test_shapes_doc_runs_in_order(tmp_path, monkeypatch, capsys):
    """docs/shapes.md: its python blocks and `cuvil` command lines run in order in one scratch folder; a bare
    block after a command holds lines that command prints."""
    import shlex

    from cuvil.cli import main as cli_main

    text = open(os.path.join(ROOT, "docs/shapes.md"), encoding="utf-8").read()
    monkeypatch.chdir(tmp_path)
    env, printed = {}, ""
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        if lang == "python":
            exec(compile(body, "docs/shapes.md", "exec"), env)
        elif lang == "sh":
            for line in body.strip().splitlines():
                capsys.readouterr()
                assert cli_main(shlex.split(line)[1:]) == 0, (line, capsys.readouterr().err)
                printed = capsys.readouterr().out
        else:
            for line in body.strip("\n").splitlines():
                assert line in printed.splitlines(), (line, printed)

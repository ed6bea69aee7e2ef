"""A newcomer's walk through README.md and docs/*.md: every ```sh and ```python block runs as written.

The convention (README.md's "Documentation that runs" section says it once for writers):
- Blocks run in document order, in one scratch folder per document into which the checkout's top-level
  entries are symlinked (``src/cuvil/data/demo_cnn.onnx``, ``examples/c/run_model.c`` resolve as in a clone);
  what a block writes stays in that folder.
- ``sh``: one ``bash -e -o pipefail`` script per block, where ``cuvil`` is ``python -m cuvil`` on this
  checkout (PYTHONPATH=src) and ``python3``/``python``/``pytest`` are this interpreter. ``cuvil`` runs as a fork
  of one process that has imported the command line (:mod:`cuvil.testing.warm_cli`: the same ``main`` with the
  command's arguments, directory, environment and streams; a fresh process where the start-up environment
  differs, e.g. ``PYTHONHASHSEED``); ``CUVIL_DOCS_FRESH=1`` starts every command afresh. ``python``: exec'd
  in one namespace per document, so later blocks see earlier names.
- A ``text`` block after a run block (the next block of the page; prose may come between) lists lines that
  block prints (stdout and stderr): each must appear, ``...`` inside a line matching anything. Other
  languages (console, yaml, json, c, rule) and bare blocks are not run.
- An HTML comment right before a block's fence marks it: ``<!-- needs: gpu, torch, ptxas, cc, libcrypto, sign, slow,
  install, edits-checkout -->`` (skipped, with that reason, only when the need is absent; ``slow`` runs with
  CUVIL_DOCS_SLOW=1, ``install`` with CUVIL_DOCS_INSTALL=1, ``edits-checkout`` never: it would rewrite the
  checkout's own files through the links), ``<!-- exit: N -->`` (the block must end with
  status N: an error example), ``<!-- excerpt: PATH -->`` (a python block quoting PATH: not run, each of
  its lines must occur in that file).

A block is one test (``README.md:L50-sh``); selecting one runs the blocks before it in its document first.
"""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import textwrap
from typing import Dict, List, NamedTuple, Optional

import pytest

from cuvil.testing.slow import slow_tests_run
from cuvil.testing.warm_cli import WarmCli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
RUN_LANGS = ("sh", "python")
BLOCK_TIMEOUT_S = 600
FENCE = re.compile(r"^([ \t]*)```(\w*)[ \t]*\n(.*?)^\1```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*(needs|exit|excerpt):\s*(.*?)\s*-->")


class Block(NamedTuple):
    document: str
    line: int
    lang: str
    body: str
    needs: tuple
    exit: int
    excerpt: Optional[str]
    expect: Optional[str]       # the body of the ``text`` block after it (the next block of the page)


def parse(document: str) -> List[Block]:
    text = open(os.path.join(ROOT, document), encoding="utf-8").read()
    fences = list(FENCE.finditer(text))
    blocks = []
    for k, m in enumerate(fences):
        lang = m.group(2)
        if lang not in RUN_LANGS:
            continue
        before = text[:m.start()].rstrip().splitlines()
        markers = {}
        while before and MARKER.fullmatch(before[-1].strip()):
            kind, value = MARKER.fullmatch(before.pop().strip()).groups()
            markers[kind] = value
        expect = None
        if k + 1 < len(fences) and fences[k + 1].group(2) == "text":
            expect = textwrap.dedent(fences[k + 1].group(3))
        blocks.append(Block(document, text[:m.start()].count("\n") + 1, lang, textwrap.dedent(m.group(3)),
                            tuple(n.strip() for n in markers.get("needs", "").split(",") if n.strip()),
                            int(markers.get("exit", 0)), markers.get("excerpt"), expect))
    return blocks


BLOCKS = [b for d in DOCUMENTS for b in parse(d)]


def _gpu_absent() -> Optional[str]:
    try:
        from cuvil.targets.ptx import runtime
        runtime.driver()
    except Exception as e:          # no cuda-python, no driver or no device: all mean "no GPU here"
        return f"needs a CUDA GPU ({e})"
    return None


def _ptxas_absent() -> Optional[str]:
    from cuvil.targets.ptx import find_ptxas
    return None if find_ptxas() else "needs ptxas (the CUDA toolkit)"


NEEDS = {
    "gpu": _gpu_absent,
    # the torch extra is torch and onnxscript (the dynamo exporter): torch alone fails in torch.onnx.export
    "torch": lambda: None if all(importlib.util.find_spec(m) for m in ("torch", "onnxscript"))
    else "needs torch and onnxscript (pip install -e '.[torch]')",
    "ptxas": _ptxas_absent,
    "cc": lambda: None if shutil.which("cc") else "needs a C compiler (cc)",
    "libcrypto": lambda: (None if any(os.path.isfile(os.path.join(d, "openssl", "evp.h")) for d in
                                      ("/usr/include", "/usr/local/include")) else "needs OpenSSL's libcrypto headers"),
    "sign": lambda: None if importlib.util.find_spec("model_signing") else "needs pip install 'cuvil[sign]'",
    "edits-checkout": lambda: "rewrites committed files of the checkout: run it by hand",
    "slow": lambda: (None if os.environ.get("CUVIL_DOCS_SLOW") == "1" or slow_tests_run()
                     else "slow on 2 cores: set CUVIL_DOCS_SLOW=1 (or CUVIL_SLOW_TESTS=1, the extended suite) to run it"),
    "install": lambda: (None if os.environ.get("CUVIL_DOCS_INSTALL") == "1"
                        else "changes the Python environment: set CUVIL_DOCS_INSTALL=1 (in a throwaway venv) to run it"),
}


def absent_need(block: Block) -> Optional[str]:
    for need in block.needs:
        if need not in NEEDS:
            pytest.fail(f"{block.document}:{block.line}: unknown need {need!r}; known: {', '.join(NEEDS)}")
        why = NEEDS[need]()
        if why:
            return why
    return None


class Walk:
    """One document's scratch folder and Python namespace, and which of its blocks have run."""

    def __init__(self, document: str, folder: str, warm: Optional[WarmCli] = None):
        self.document, self.folder = document, folder
        self.namespace: Dict[str, object] = {"__name__": "__main__"}
        self.done: Dict[int, Optional[str]] = {}       # line -> None (ran) or the reason it was skipped
        self.shims = os.path.join(folder, ".newcomer-bin")
        os.makedirs(self.shims)
        for name in sorted(os.listdir(ROOT)):
            if not name.startswith(".") and name not in ("build", "dist"):
                os.symlink(os.path.join(ROOT, name), os.path.join(folder, name))
        if warm is not None:        # `cuvil` as a fork of a process that imported it (cuvil.testing.warm_cli)
            warm.write_client(self.shims, sys.executable)
        for name, cmd in (("cuvil", f'"{sys.executable}" -m cuvil'), ("python3", f'"{sys.executable}"'),
                          ("python", f'"{sys.executable}"'), ("pytest", f'"{sys.executable}" -m pytest')):
            path = os.path.join(self.shims, name)
            if os.path.exists(path):
                continue
            with open(path, "w") as f:
                f.write(f'#!/bin/sh\nexec {cmd} "$@"\n')
            os.chmod(path, 0o755)

    def run(self, block: Block) -> None:
        """Run the blocks before ``block`` not yet run, then ``block``; fail or skip as ``block`` does."""
        for b in BLOCKS:
            if b.document != self.document or b.line > block.line:
                continue
            if b.line not in self.done:
                why = absent_need(b) if not b.excerpt else None
                self.done[b.line] = why
                if why is None:
                    self._execute(b)
            if b.line == block.line and self.done[b.line]:
                pytest.skip(f"{b.document}:{b.line}: {self.done[b.line]}")

    def _execute(self, b: Block) -> None:
        where = f"{b.document}:{b.line}"
        if b.excerpt:
            source = open(os.path.join(ROOT, b.excerpt), encoding="utf-8").read()
            missing = [ln for ln in b.body.splitlines() if ln.strip() and ln.strip() not in source]
            assert not missing, f"{where}: the excerpt's lines are not in {b.excerpt}: {missing}"
            return
        if b.lang == "sh":
            env = dict(block_env(), PATH=self.shims + os.pathsep + os.environ.get("PATH", ""))
            res = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", b.body], cwd=self.folder, env=env,
                                 capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
            printed, status = res.stdout + res.stderr, res.returncode
        else:
            out = io.StringIO()
            cwd = os.getcwd()
            os.chdir(self.folder)
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                    exec(compile(b.body, where, "exec"), self.namespace)
            finally:
                os.chdir(cwd)
            printed, status = out.getvalue(), 0
        assert status == b.exit, f"{where}: exit status {status}, the document expects {b.exit}\n{b.body}\n--- printed:\n{printed[-4000:]}"
        if b.expect:
            lines = [ln.rstrip() for ln in printed.splitlines()]
            for want in b.expect.strip("\n").splitlines():
                pattern = re.compile(".*".join(re.escape(part) for part in want.strip().split("...")))
                assert any(pattern.fullmatch(ln.strip()) for ln in lines), \
                    f"{where}: the document shows {want.strip()!r}, the block printed:\n{printed[-4000:]}"


def block_env() -> Dict[str, str]:
    """The environment of an ``sh`` block (before its PATH puts the shims first)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src")] +
                                                       [p for p in [os.environ.get("PYTHONPATH")] if p]))


@pytest.fixture(scope="module")
def walks(tmp_path_factory):
    """One Walk per document. Their ``cuvil`` commands are forks of one process that imported the command line
    (:mod:`cuvil.testing.warm_cli`; ~60 commands in the gate, each saving the 1.6-2.5 s of CPU a fresh import
    costs); ``CUVIL_DOCS_FRESH=1`` runs each as a fresh ``python -m cuvil`` instead."""
    made: Dict[str, Walk] = {}
    warm: List[WarmCli] = []

    def walk(document: str) -> Walk:
        if document not in made:
            if not warm and os.environ.get("CUVIL_DOCS_FRESH") != "1":
                warm.append(WarmCli(block_env()))
            made[document] = Walk(document, str(tmp_path_factory.mktemp(re.sub(r"\W", "_", document))),
                                  warm[0] if warm else None)
        return made[document]
    yield walk
    for w in warm:
        w.close()


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.document}:L{b.line}-{b.lang}" for b in BLOCKS])
def test_block_runs_as_written(walks, block):
    walks(block.document).run(block)


def test_every_document_has_runnable_blocks():
    """The README walks a newcomer from install to a compiled library: at least install, demo and compile."""
    readme = [b for b in BLOCKS if b.document == "README.md"]
    assert len(readme) >= 8
    assert any("cuvil demo" in b.body for b in readme)
    assert any("cuvil compile" in b.body and not b.needs for b in readme)


def test_markers_are_known():
    """A misspelt marker would silently run or skip a block: every ``<!-- ...: -->`` comment must be one of ours
    and sit right before a run block."""
    for d in DOCUMENTS:
        lines = open(os.path.join(ROOT, d), encoding="utf-8").read().splitlines()
        for line, text in enumerate(lines, 1):
            m = re.fullmatch(r"<!--\s*(\w[\w-]*)\s*:.*-->", text.strip())
            if not m:
                continue
            assert m.group(1) in ("needs", "exit", "excerpt"), f"{d}:{line}: unknown marker {m.group(1)!r}"
            marked = [b for b in BLOCKS if b.document == d and 0 < b.line - line <= 3]
            assert marked, f"{d}:{line}: a marker must sit right before a ```sh or ```python block"

"""PyTorch input: ``Pipeline.from_torch`` (nn.Module, dynamo exporter), ``.pt2`` ExportedPrograms and ``.pt``
TorchScript files, compiled for x86 and checked against torch itself at several shapes of one library.

torch is the optional ``torch`` extra: these tests run where it is installed (the GPU machine) and are skipped
elsewhere, with the reason printed; the one test that needs torch absent checks the error a user gets then.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from cuvil import Pipeline
from cuvil.artifact import load
from cuvil.errors import CuvilError, ModelLoadError

HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed (the optional cuvil[torch] "
                                                        "extra); these tests run on a machine that has it")


def _net():
    import torch

    class Net(torch.nn.Module):
        """A small CNN + MLP head: Conv, BatchNorm, ReLU, pooling, flatten over a symbolic batch, Linear, GELU."""

        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(8)
            self.fc = torch.nn.Linear(8, 5)

        def forward(self, x):
            y = torch.relu(self.bn(self.conv(x)))
            y = torch.nn.functional.adaptive_avg_pool2d(y, 1).flatten(1)
            return torch.nn.functional.gelu(self.fc(y))

    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():                                     # non-trivial running statistics
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 2.0)
    return net


def _check_batches(pipeline, net, batches):
    import torch
    art = pipeline.compile(cache=False)
    model = load(art.path)
    try:
        for b in batches:
            x = np.random.default_rng(b).standard_normal((b, 3, 16, 16)).astype(np.float32)
            (got,) = model.run(x)
            with torch.no_grad():
                want = net(torch.from_numpy(x)).numpy()
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    finally:
        model.close()


@needs_torch
def test_from_torch_keeps_the_dims_symbol_and_range(tmp_path):
    import torch
    net = _net()
    batch = torch.export.Dim("batch", min=1, max=8)
    p = Pipeline.from_torch(net, (torch.randn(2, 3, 16, 16),), dynamic_shapes={"x": {0: batch}})
    assert "batch" in p.graph.symbols
    sym = p.graph.symbols["batch"]
    assert (sym.min, sym.max) == (1, 8)
    _check_batches(p.optimize(), net, (1, 3, 8))


@needs_torch
def test_exported_program_file(tmp_path):
    import torch
    net = _net()
    batch = torch.export.Dim("batch", min=1, max=16)
    ep = torch.export.export(net, (torch.randn(2, 3, 16, 16),), dynamic_shapes={"x": {0: batch}})
    path = tmp_path / "net.pt2"
    torch.export.save(ep, str(path))
    p = Pipeline.from_file(path)
    assert p.graph.symbols, "the ExportedProgram's dynamic batch must stay symbolic"
    _check_batches(p.optimize(), net, (1, 5, 16))


@needs_torch
def test_torchscript_file_with_a_shape_profile(tmp_path):
    import torch
    net = _net()
    path = tmp_path / "net.pt"
    torch.jit.save(torch.jit.trace(net, torch.randn(2, 3, 16, 16)), str(path))
    p = Pipeline.from_file(path, input_shapes={"x": ((1, 3, 16, 16), (2, 3, 16, 16), (8, 3, 16, 16))})
    assert len(p.graph.symbols) == 1, p.graph.symbols        # the batch dim, named after input and axis
    _check_batches(p.optimize(), net, (1, 2, 8))


@needs_torch
def test_torchscript_file_needs_its_input_shapes(tmp_path):
    import torch
    path = tmp_path / "net.pt"
    torch.jit.save(torch.jit.trace(_net(), torch.randn(1, 3, 16, 16)), str(path))
    with pytest.raises(CuvilError, match=r"(?s)stores no input shapes; missing: x.*next: .*--input-shape"):
        Pipeline.from_file(path)


@needs_torch
def test_a_state_dict_is_not_a_model(tmp_path):
    import torch
    path = tmp_path / "weights.pt"
    torch.save(_net().state_dict(), str(path))
    with pytest.raises(ModelLoadError, match="(?s)not a TorchScript file.*torch.jit.save"):
        Pipeline.from_file(path, input_shapes={"x": (1, 3, 16, 16)})


@needs_torch
def test_exporter_failure_is_one_clear_error():
    import torch

    class DataDependent(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:                       # control flow on data: torch.export refuses it
                return x + 1
            return x - 1

    with pytest.raises(CuvilError, match=r"torch.onnx.export \(dynamo\) failed"):
        Pipeline.from_torch(DataDependent(), (torch.randn(3),))


@pytest.mark.skipif(HAVE_TORCH, reason="checks the error a user without torch gets; torch is installed here")
def test_without_torch_the_error_names_the_extra(tmp_path):
    path = tmp_path / "net.pt"
    path.write_bytes(b"\0")
    for call in (lambda: Pipeline.from_torch(object(), ()), lambda: Pipeline.from_file(path)):
        with pytest.raises(CuvilError, match=r"pip install 'cuvil\[torch\]'"):
            call()
    assert os.path.exists(path)


@needs_torch
def test_cli_compiles_a_torchscript_file_over_a_batch_profile(tmp_path):
    import torch
    from cuvil.cli import main as cli_main
    net = _net()
    path = tmp_path / "net.pt"
    torch.jit.save(torch.jit.trace(net, torch.randn(2, 3, 16, 16)), str(path))
    out = tmp_path / "libnet.so"
    assert cli_main(["compile", "--input", str(path), "--input-shape", "x=1x3x16x16:2x3x16x16:8x3x16x16",
                     "--output", str(out)]) == 0
    model = load(str(out))
    try:
        for b in (1, 8):
            x = np.random.default_rng(b).standard_normal((b, 3, 16, 16)).astype(np.float32)
            with torch.no_grad():
                want = net(torch.from_numpy(x)).numpy()
            np.testing.assert_allclose(model.run(x)[0], want, rtol=1e-4, atol=1e-5)
    finally:
        model.close()

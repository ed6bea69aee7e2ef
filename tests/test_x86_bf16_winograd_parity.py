"""The precision policy and the x86 algorithm choice agree on which convolutions run as bf16 Winograd F(2x2):
``X86Target.transformed_rounding`` (what the policy bounds with the Winograd form's rounding) names exactly the
convolutions ``choose_algorithms`` turns into bf16 WinogradConv, for CPUs with and without AMX, with the tuning's
overrides, and for thin, uneven-padded and ResNet-sized layers; at O1 (no algorithm choice) it names none.
Compile-free: runs on every host."""
import itertools
import pytest
from cuvil import Pipeline
from cuvil.targets import X86_TARGET, get_target, make_options
from cuvil.targets.base import transformed_rounding
from cuvil.targets.x86.target import choose_algorithms
from cuvil.targets.x86.tuning import X86Tuning
from cuvil.testing.conv_models import conv_epilogue_model

GEOMS = [((1, 64, 28, 28), (64, 64, 3, 3), [1, 1, 1, 1]), ((1, 512, 7, 7), (512, 512, 3, 3), [1, 1, 1, 1]),
         ((1, 3, 12, 12), (8, 3, 3, 3), [1, 1, 1, 1]), ((1, 16, 12, 12), (2, 16, 3, 3), [1, 1, 1, 1]),
         ((1, 6, 9, 9), (6, 6, 3, 3), [0, 1, 2, 0]), ((1, 32, 56, 56), (32, 32, 3, 3), [1, 1, 1, 1])]


@pytest.mark.parametrize("cpu,tuning", list(itertools.product(
    ["znver4", "sapphirerapids", "skylake-avx512"],
    [X86Tuning(), X86Tuning(amx=False), X86Tuning(amx=False, bf16_winograd=True), X86Tuning(bf16_winograd=False)])))
@pytest.mark.parametrize("xs,ws,pads", GEOMS)
def test_transformed_rounding_names_exactly_the_bf16_winograd_convolutions(cpu, tuning, xs, ws, pads):
    g = Pipeline.from_onnx(conv_epilogue_model(xs, ws, pads=pads, epilogue=None)).optimize().graph.clone()
    for n in g.nodes:
        if n.op == "Conv":
            n.precision = "bf16"
    said = set(transformed_rounding(get_target(X86_TARGET), make_options(X86_TARGET, cpu=cpu, tuning=tuning), g))
    out, _ = choose_algorithms(g, cpu, tuning)
    done = {x for n in out.nodes if n.op == "WinogradConv" and n.precision == "bf16" for x in n.fused_from}
    assert said == done, (said, done)


def test_no_algorithm_choice_below_o2():
    g = Pipeline.from_onnx(conv_epilogue_model(*GEOMS[0][:2], pads=GEOMS[0][2], epilogue=None)).optimize().graph
    for level, want in ((1, set()), (2, {"conv"})):
        options = make_options(X86_TARGET, cpu="znver4", opt_level=level, tuning=X86Tuning())
        assert set(transformed_rounding(get_target(X86_TARGET), options, g)) == want

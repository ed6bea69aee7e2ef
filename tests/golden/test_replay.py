"""Process replay: the schedule and the LLVM IR (x86 for a pinned CPU, and NVPTX; before LLVM optimisation)
of five CNNs and a transformer block equal their goldens in tests/golden/replay/
(:mod:`cuvil.testing.replay`). A refactor that changes no kernel passes; a deliberate change is accepted
with ``pytest tests/golden/test_replay.py --update-golden`` (review the diff first: docs/process-replay.md)."""
import pytest

from cuvil.testing import replay

HINT = "if the change is intended: pytest tests/golden/test_replay.py --update-golden (docs/process-replay.md)"
CASES = [(m, t) for m in replay.MODELS for t in replay.TARGETS]


@pytest.fixture(scope="module")
def snapshots(request):
    """The snapshots of every selected case, taken together (in parallel, model by model) on first use."""
    selected = [tuple(item.callspec.params[k] for k in ("model", "target")) for item in request.session.items
                if getattr(item, "originalname", None) == "test_replay" and item.module is request.module]
    return replay.take_snapshots(selected)


@pytest.mark.parametrize("model,target", CASES, ids=[f"{m}.{t}" for m, t in CASES])
def test_replay(model, target, snapshots, update_golden):
    path = replay.golden_path(model, target)
    actual = snapshots[model, target]
    if update_golden:
        replay.write_golden(path, actual)
        return
    expected = replay.read_golden(path)
    if expected is None:
        pytest.fail(f"no golden {path}: run pytest tests/golden/test_replay.py --update-golden, review, commit")
    if actual != expected:
        pytest.fail(f"kernels changed for {model} ({target}):\n{replay.diff(expected, actual, f'{model}.{target}')}"
                    f"\n{HINT}", pytrace=False)


def test_snapshot_does_not_depend_on_what_ran_before():
    """Index variables are named from a process-wide counter; the snapshot renames them, so a second
    snapshot of the same model in the same process is the same text."""
    first = replay.snapshot(replay.TRANSFORMER, "ptx")
    assert replay.snapshot(replay.TRANSFORMER, "ptx") == first


def test_diff_names_the_changed_stage_and_cuts_long_diffs():
    golden = "# schedule\nstage 0 a op=Relu\n    = x\nstage 1 b op=Add\n"
    golden += "".join(f"    %{k} = y\n" for k in range(200))
    now = golden.replace("stage 1 b op=Add\n", "stage 1 b op=Add\n    %new = z\n").replace("= y", "= w")
    text = replay.diff(golden, now, "m.x86")
    assert text.splitlines()[0] == "m.x86: first change in stage 1 b"
    assert "more diff lines: python -m cuvil.testing.replay --diff m.x86" in text
    assert len(text.splitlines()) == 1 + 80 + 1

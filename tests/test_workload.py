import textwrap

import pytest
import torch

from memfit import Workload
from memfit.errors import WorkloadError
from memfit.workload.loading import load_workload
from memfit.workload.protocol import DEFAULT_STEPS, build, run_steps
from memfit.workload.zoo import builtin_names, builtin_workload


def _w(**kw):  # noqa: ANN003, ANN202
    base = dict(
        model=lambda: torch.nn.Linear(4, 2),
        batch=lambda n: (torch.randn(n, 4), torch.randint(0, 2, (n,))),
        loss=lambda out, b: torch.nn.functional.cross_entropy(out, b[1]),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        batch_size=4,
    )
    base.update(kw)
    return Workload(**base)


def test_validation_says_what_is_wrong():
    with pytest.raises(WorkloadError, match="batch_size must be a positive integer, got 0"):
        _w(batch_size=0)
    with pytest.raises(WorkloadError, match="precision must be one of fp32, bf16, fp16, got 'fp8'"):
        _w(precision="fp8")
    with pytest.raises(WorkloadError, match="model must be a factory"):
        _w(model=torch.nn.Linear(4, 2))


def test_replace_validates_again():
    w = _w()
    assert w.replace(batch_size=8).batch_size == 8
    with pytest.raises(WorkloadError):
        w.replace(batch_size=-1)


def test_default_forward_uses_first_element():
    w = _w()
    model = w.model()
    out = w.run_forward(model, w.batch(3))
    assert out.shape == (3, 2)


def test_load_file_single_and_named(tmp_path):  # noqa: ANN001
    one = tmp_path / "one.py"
    one.write_text(textwrap.dedent("""
        import torch, memfit
        w = memfit.Workload(model=lambda: torch.nn.Linear(2, 2), batch=lambda n: (torch.randn(n, 2),),
                            loss=lambda o, b: o.sum(), optimizer=lambda p: torch.optim.SGD(p, lr=1), batch_size=2)
    """))
    assert load_workload(str(one)).batch_size == 2
    two = tmp_path / "two.py"
    two.write_text(one.read_text() + "\nv = w.replace(batch_size=5)\n")
    with pytest.raises(WorkloadError, match="several workloads"):
        load_workload(str(two))
    assert load_workload(f"{two}:v").batch_size == 5
    with pytest.raises(WorkloadError, match="no attribute 'nope'"):
        load_workload(f"{two}:nope")


def test_load_errors_are_one_line(tmp_path):  # noqa: ANN001
    with pytest.raises(WorkloadError, match="not found"):
        load_workload(str(tmp_path / "missing.py"))
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(WorkloadError, match="defines no memfit.Workload"):
        load_workload(str(empty))
    broken = tmp_path / "broken.py"
    broken.write_text("raise ValueError('boom')\n")
    with pytest.raises(WorkloadError, match="ValueError: boom"):
        load_workload(str(broken))
    with pytest.raises(WorkloadError, match="unknown built-in workload"):
        load_workload("resnet9000")


def test_every_builtin_builds_a_workload():
    for name in builtin_names():
        w = builtin_workload(name)
        assert w.batch_size >= 1 and w.name


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"accumulation_steps": 0}, "accumulation_steps must be a positive integer"),
        ({"checkpoint": "layers.0"}, "checkpoint must be a tuple of module names"),
        ({"optimizer_impl": "fast"}, "optimizer_impl must be one of"),
        ({"patch_size": (64, 0)}, "patch_size must be a tuple of positive integers"),
        ({"patch_size": (64, 64), "patch_multiple": (16,)}, "one entry per patch axis"),
    ],
)
def test_knob_fields_are_validated(changes, message):  # noqa: ANN001
    from memfit import WorkloadError
    from memfit.workload.zoo import builtin_workload

    with pytest.raises(WorkloadError, match=message):
        builtin_workload("mlp").replace(**changes)


def test_effective_batch_and_patch_batch():
    from memfit.workload.zoo import builtin_workload

    w = builtin_workload("unet3d").replace(batch_size=2, accumulation_steps=3, patch_size=(32, 64, 32))
    assert w.effective_batch_size == 6
    x, y = w.make_batch(2)
    assert tuple(x.shape) == (2, 4, 32, 64, 32) and tuple(y.shape) == (2, 32, 64, 32)


def test_settle_scaler_runs_until_the_optimizer_stepped():
    # the weight's gradient, 4 rows of ones x 1000 x the scale, overflows fp16 (65504) until the scale falls to
    # 2**4: twelve skipped steps
    w = _w(precision="fp16", optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
           batch=lambda n: (torch.ones(n, 4), torch.zeros(n, dtype=torch.long)),
           loss=lambda out, b: out.float().sum() * 1000)
    runs = {}
    for settle in (False, True):
        model, optimizer, batch = build(w, "cpu")
        scaler = torch.amp.GradScaler("cpu")
        steps = run_steps(w, model, optimizer, batch, autocast_device="cpu", scaler=scaler, settle_scaler=settle)
        runs[settle] = (steps, len(optimizer.state), scaler.get_scale())
    assert runs[False] == (DEFAULT_STEPS, 0, 2.0 ** 13)  # every protocol step skipped: no Adam state
    # the first real step is the 13th (scale 2**4); one whole step runs after it, with the state alive
    assert runs[True] == (14, 2, 2.0 ** 4)


class _LegacyParameter(torch.nn.Module):
    """A parameter made by the legacy constructor, which ignores ``torch.device(...)`` as a context (Deformable
    DETR's ``level_embed``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.level_embed = torch.nn.Parameter(torch.Tensor(3, 4))


def test_the_model_is_built_whole_on_the_device():
    w = Workload(model=_LegacyParameter, batch=lambda n: (torch.randn(n, 4),), loss=lambda out, b: out.sum(),
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=2)
    model, optimizer, batch = build(w, "meta")  # the same path as "cuda", on any machine
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert all(p.device.type == "meta" for group in optimizer.param_groups for p in group["params"])

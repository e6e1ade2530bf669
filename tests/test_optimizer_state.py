"""``Workload.optimizer_state``: torchao's 8-bit and CPU-offloaded Adam, swapped in for the user's Adam/AdamW, and the
trace's stand-ins (``memfit.estimate.optimizer_twins``) that predict their GPU memory and traffic.

The state bytes are worked by hand from torchao 0.18.0's layout (blocks of 256, a 4-byte scale per block, a
256-entry fp32 code book per state, plain states under 4096 elements); where torchao is installed, the stand-in's
buffers are also compared with torchao's own.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from memfit import Workload
from memfit.errors import WorkloadError
from memfit.estimate.gpus import gpu_spec
from memfit.estimate.op_costs import OpCost, PhaseCost, StepCost
from memfit.estimate.optimizer_twins import _new_moment
from memfit.estimate.trace import trace_workload
from memfit.speed.step_time import HOST_ADAM_BYTES_PER_S, predict_step_time
from memfit.workload.optimizer_state import adam_settings, set_optimizer_state

H100 = gpu_spec("h100")
HAVE_TORCHAO = importlib.util.find_spec("torchao") is not None


def _model() -> torch.nn.Module:
    # weights of 524288 (quantized), 4100 (not a multiple of 256: plain) and 4096 (quantized) elements; biases of
    # 512, 4100 and 1 (plain)
    return torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.Linear(512, 4100, bias=True),
                               torch.nn.Linear(4100, 1, bias=True), torch.nn.Flatten(0))


def _workload(**changes: object) -> Workload:
    w = Workload(
        model=_model, batch=lambda n: (torch.randn(n, 1024), torch.randn(n)),
        loss=lambda out, b: torch.nn.functional.mse_loss(out, b[1]),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), batch_size=2, name="three-linears",
    )
    return w.replace(**changes)


def _state_bytes(trace: object) -> int:
    return sum(a.nbytes for a in trace.allocs if a.category == "optimizer_state" and a.step == 0)  # type: ignore[attr-defined]


def test_eight_bit_states_are_torchaos_layout_worked_by_hand() -> None:
    trace = trace_workload(_workload(optimizer_state="8bit"), H100)
    # per moment: a quantized state is numel uint8 codes + numel/256 fp32 scales + a 256-entry fp32 code book:
    # weights 1024x512 (2048 blocks) and 512x4100 (8200 blocks); plain fp32 for the biases of 512, 4100 and 1
    # elements and the weight of 4100 (not a multiple of 256)
    per_moment = (524288 + 4 * 2048 + 1024) + (2099200 + 4 * 8200 + 1024) + 4 * (512 + 4100 + 4100 + 1)
    assert _state_bytes(trace) == 2 * per_moment
    assert "optimizer_state_rule" in trace.uncertain
    full = trace_workload(_workload(), H100)
    # AdamW's fp32 moments and its per-parameter step counts (4 bytes each, 6 parameters)
    n = 1024 * 512 + 512 + 512 * 4100 + 4100 + 4100 + 1
    assert _state_bytes(full) == 2 * 4 * n + 6 * 4


def test_eight_bit_update_scratch_is_the_rule_and_freed() -> None:
    trace = trace_workload(_workload(optimizer_state="8bit"), H100)
    scratch = [a for a in trace.allocs if a.phase == "optimizer" and a.category == "temporaries" and a.step == 1]
    # per quantized parameter (two): two fp32 copies of it and one fp32 block-scale buffer per moment
    sizes = sorted(a.nbytes for a in scratch)
    assert sizes == sorted([4 * 524288] * 2 + [4 * 2048] * 2 + [4 * 2099200] * 2 + [4 * 8200] * 2)


def test_offload_keeps_only_small_parameters_states_on_the_gpu() -> None:
    trace = trace_workload(_workload(optimizer_state="cpu_offload"), H100)
    # parameters under 4096 elements (the 512- and 1-element biases) stay with a fused AdamW on the GPU: two fp32
    # moments and a step count each (fused keeps it on the device)
    assert _state_bytes(trace) == 2 * 4 * (512 + 1) + 2 * 4
    offloaded = 4 * (1024 * 512 + 512 * 4100 + 4100 + 4100)
    assert trace.offload is not None
    assert trace.offload.d2h_bytes == offloaded == trace.offload.h2d_bytes
    assert trace.offload.host_update_bytes == 7 * offloaded
    # the gradients stay on the GPU until zero_grad (torchao's default offload_gradients=False)
    grads = sum(a.nbytes for a in trace.allocs if a.category == "grads" and a.step == 0)
    assert grads == 4 * (offloaded // 4 + 513)


def test_speed_model_charges_the_offload_copies_and_the_host_update() -> None:
    row = OpCost(0, None, 10**9, 1, 1)  # one kernel moving 1 GB in each phase
    phase = PhaseCost.of([row])
    plain = StepCost(micro_batch_size=1, forward=phase, backward=phase, optimizer=phase)
    link = H100.host_link_gbs * 1e9
    off = StepCost(micro_batch_size=1, forward=phase, backward=phase, optimizer=phase,
                   offload_d2h_bytes=int(20 * link), offload_h2d_bytes=int(link), host_update_bytes=7 * 10**9)
    a, b = predict_step_time(plain, H100, accumulation=2), predict_step_time(off, H100, accumulation=2)
    assert a.host_s == 0.0
    # copies back (1 s) and host update; the gradient copies (20 s) outlast backward by 20 s - backward, per micro-batch
    expected_step = 1.0 + 7e9 / HOST_ADAM_BYTES_PER_S
    expected_micro = 20.0 - a.backward_s
    assert b.optimizer_s == pytest.approx(a.optimizer_s + expected_step)
    assert b.step_time_s == pytest.approx(a.step_time_s + 2 * expected_micro + expected_step)


def test_only_adam_and_adamw_are_replaced() -> None:
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1)
    with pytest.raises(WorkloadError, match="replaces torch.optim.Adam or AdamW, got torch.optim.sgd.SGD"):
        set_optimizer_state(sgd, "8bit")
    maximize = torch.optim.Adam([torch.nn.Parameter(torch.zeros(4))], maximize=True)
    with pytest.raises(WorkloadError, match="maximize=True"):
        adam_settings(maximize)
    assert set_optimizer_state(sgd, "full") is sgd


def test_adam_settings_keep_groups_and_decoupling() -> None:
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.Adam([{"params": [a], "lr": 0.5}, {"params": [b], "weight_decay": 0.1}], lr=torch.tensor(0.25),
                           betas=(0.8, 0.9), eps=1e-6, amsgrad=True)
    s = adam_settings(opt)
    assert not s.decoupled and s.torch_class is torch.optim.Adam
    assert [g["lr"] for g in s.groups] == [0.5, 0.25]
    assert [g["weight_decay"] for g in s.groups] == [0.0, 0.1]
    assert all(g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6 and g["amsgrad"] for g in s.groups)
    assert adam_settings(torch.optim.AdamW([a])).decoupled


def test_workload_validates_optimizer_state() -> None:
    with pytest.raises(WorkloadError, match="optimizer_state must be one of full, 8bit, cpu_offload, got '4bit'"):
        _workload(optimizer_state="4bit")
    with pytest.raises(WorkloadError, match="leave optimizer_impl at 'default'"):
        _workload(optimizer_state="8bit", optimizer_impl="fused")


def test_estimating_a_non_adam_optimizer_with_8bit_says_so() -> None:
    w = _workload(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), optimizer_state="8bit")
    with pytest.raises(WorkloadError, match="use optimizer_state='full'"):
        trace_workload(w, H100)


@pytest.mark.skipif(not HAVE_TORCHAO, reason="torchao is not installed")
@pytest.mark.parametrize("shape", [(1024, 512), (512,), (4100,), (64, 64), (3, 4096)])
def test_stand_in_buffers_match_torchaos(shape: tuple[int, ...]) -> None:
    from torchao.optim import AdamW8bit

    p = torch.nn.Parameter(torch.zeros(shape))
    real = AdamW8bit([p])._new_buffer(p, True)
    parts = [real.codes, real.scale, real.qmap] if hasattr(real, "codes") else [real]
    mine = list(_new_moment("exp_avg", p).values())
    assert [(t.shape, t.dtype) for t in mine] == [(t.shape, t.dtype) for t in parts]


@pytest.mark.skipif(not HAVE_TORCHAO, reason="torchao is not installed")
def test_set_optimizer_state_builds_torchaos_optimizers() -> None:
    from torchao.optim import Adam8bit, AdamW8bit

    a = torch.nn.Parameter(torch.zeros(4))
    opt = set_optimizer_state(torch.optim.AdamW([a], lr=0.01, betas=(0.8, 0.95), weight_decay=0.2), "8bit")
    assert type(opt) is AdamW8bit
    group = opt.param_groups[0]
    assert float(group["lr"]) == pytest.approx(0.01) and group["betas"] == (0.8, 0.95) and group["weight_decay"] == 0.2
    assert type(set_optimizer_state(torch.optim.Adam([a]), "8bit")) is Adam8bit
    if not torch.cuda.is_available():
        with pytest.raises(WorkloadError, match="needs CUDA"):
            set_optimizer_state(torch.optim.Adam([a]), "cpu_offload")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memfit.cli", *args], capture_output=True, text=True, timeout=240)


def test_cli_estimate_optimizer_state() -> None:
    bad = _cli("estimate", "mlp", "--optimizer-state", "4bit")
    assert bad.returncode == 2 and "--optimizer-state must be one of full, 8bit, cpu_offload" in bad.stderr
    full = json.loads(_cli("estimate", "mlp", "--json").stdout)
    eight = _cli("estimate", "mlp", "--optimizer-state", "8bit", "--json")
    assert eight.returncode == 0, eight.stderr
    data = json.loads(eight.stdout)
    # fp32 Adam moments are 8 bytes per element; 8-bit ones a little over 2
    assert data["breakdown"]["optimizer_state"] < 0.3 * full["breakdown"]["optimizer_state"]
    assert [u["reason"] for u in data["uncertainty"]] == ["optimizer_state_rule"]

"""The planner's optimizer-state knob: torchao's 8-bit and CPU-offloaded Adam, tried only when allowed.

A stack of eight 2048-wide linear layers at an effective batch of 1 (one micro-batch, nothing to checkpoint): its
Adam states (256 MiB in fp32) decide what fits. Budgets are placed between the exact estimates of the three
states, so each test says which one the budget admits and what the plan must pick: 8-bit where it fits (faster
than offloading, whose host update and copies the speed model charges), the offload where only it fits, and
"nothing fits" when the knob is not allowed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from memfit import BudgetTooSmallError, Workload
from memfit.estimate.allocator import AllocatorConfig
from memfit.estimate.predict import estimate
from memfit.plan.records import Plan
from memfit.plan.search import DEFAULT_MARGIN, plan

ALLOCATOR = AllocatorConfig()


def _model() -> torch.nn.Module:
    layers = [m for _ in range(8) for m in (torch.nn.Linear(2048, 2048), torch.nn.ReLU())]
    return torch.nn.Sequential(*layers, torch.nn.Linear(2048, 10))


WIDE = Workload(
    model=_model, batch=lambda n: (torch.randn(n, 2048), torch.randint(0, 10, (n,))),
    loss=lambda out, b: torch.nn.functional.cross_entropy(out, b[1]),
    optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), batch_size=1, name="wide", keep_output=False,
)


@pytest.fixture(scope="module")
def needs() -> dict[str, int]:
    """Device memory each state needs (upper bound), estimated exactly: the plan's fused AdamW for ``full``."""
    out = {}
    for state, impl in (("full", "fused"), ("8bit", "default"), ("cpu_offload", "default")):
        e = estimate(WIDE.replace(optimizer_state=state, optimizer_impl=impl), gpu="h100", allocator=ALLOCATOR)
        out[state] = e.device_upper_bytes
    # the premise of the tests: each state needs clearly less than the one before
    assert needs_ordered(out)
    return out


def needs_ordered(n: dict[str, int]) -> bool:
    return n["full"] - n["8bit"] > 64 << 20 and n["8bit"] - n["cpu_offload"] > 32 << 20


def _budget_between(low: int, high: int) -> int:
    """A budget whose usable part (after the plan's margin) admits ``low`` and not ``high``."""
    return int((low + high) / 2 / (1 - DEFAULT_MARGIN))


def _plan(budget: int, allow: bool) -> Plan:
    return plan(WIDE, budget_bytes=budget, effective_batch=1, gpu="h100", allocator=ALLOCATOR,
                calibration="roofline", allow_optimizer_state_change=allow)


def test_eight_bit_chosen_where_only_it_and_the_offload_fit(needs: dict[str, int]) -> None:
    p = _plan(_budget_between(needs["8bit"], needs["full"]), allow=True)
    assert p.chosen.config.optimizer_state == "8bit"
    assert p.chosen.verified and p.chosen.device_bytes == needs["8bit"]
    assert "8-bit Adam states" in p.chosen.config.label()
    assert any("numerics change" in n for n in p.notes)


def test_offload_chosen_where_only_it_fits(needs: dict[str, int]) -> None:
    p = _plan(_budget_between(needs["cpu_offload"], needs["8bit"]), allow=True)
    assert p.chosen.config.optimizer_state == "cpu_offload"


def test_full_states_kept_when_they_fit(needs: dict[str, int]) -> None:
    # fused AdamW on full states is faster than the per-parameter 8-bit kernels and the host update
    p = _plan(int(needs["full"] / (1 - DEFAULT_MARGIN)) + (8 << 20), allow=True)
    assert p.chosen.config.optimizer_state == "full"


def test_not_allowed_nothing_fits_and_the_error_names_the_flag(needs: dict[str, int]) -> None:
    with pytest.raises(BudgetTooSmallError, match="--allow-optimizer-state-change"):
        _plan(_budget_between(needs["8bit"], needs["full"]), allow=False)


def test_plan_json_keeps_the_state(needs: dict[str, int]) -> None:
    p = _plan(_budget_between(needs["8bit"], needs["full"]), allow=True)
    again = Plan.from_dict(json.loads(p.to_json()))
    assert again.chosen.config.optimizer_state == "8bit"
    assert p.workload_for(WIDE).optimizer_state == "8bit"


def test_cli_plan_with_the_flag(needs: dict[str, int], tmp_path: object) -> None:
    from pathlib import Path

    step = Path(str(tmp_path)) / "wide_step.py"
    step.write_text(
        "import torch, memfit\n"
        "def _model():\n"
        "    layers = [m for _ in range(8) for m in (torch.nn.Linear(2048, 2048), torch.nn.ReLU())]\n"
        "    return torch.nn.Sequential(*layers, torch.nn.Linear(2048, 10))\n"
        "workload = memfit.Workload(model=_model, batch=lambda n: (torch.randn(n, 2048), torch.randint(0, 10, (n,))),\n"
        "    loss=lambda out, b: torch.nn.functional.cross_entropy(out, b[1]),\n"
        "    optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), batch_size=1, name='wide')\n"
    )
    budget = f"{_budget_between(needs['8bit'], needs['full'])}B"
    args = [sys.executable, "-m", "memfit.cli", "plan", str(step), "--budget", budget, "--effective-batch", "1",
            "--roofline", "--json"]
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": ""}
    refused = subprocess.run(args, capture_output=True, text=True, timeout=240, env=env)
    assert refused.returncode == 2 and "--allow-optimizer-state-change" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    ok = subprocess.run([*args, "--allow-optimizer-state-change"], capture_output=True, text=True, timeout=240, env=env)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["chosen"]["config"]["optimizer_state"] == "8bit"

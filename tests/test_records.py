"""Every result memfit writes as JSON goes through ``memfit.records.JsonRecord``, and its JSON reads back."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import pkgutil
from collections.abc import Callable

import pytest
import torch

import memfit
from conftest import small_plan
from memfit.data.balance import BalancedBatchSampler, SamplerSettings
from memfit.data.cache import CacheFill
from memfit.data.loader import LoaderSettings
from memfit.data.patches import PatchSampler
from memfit.data.storage import ContainerFinding
from memfit.distributed.ranks import Finding, GpuProcess, RankMemory, RankReport, diagnose
from memfit.distributed.shard import ModelStateMemory, Sharding, ShardingComparison, compare_sharding
from memfit.errors import MissingExtraError
from memfit.estimate.allocator import Replay, replay
from memfit.estimate.measure import Measurement, Trial
from memfit.estimate.op_costs import StepCost
from memfit.estimate.predict import Estimate
from memfit.explain.explanation import Explanation, explain
from memfit.explain.oom_diagnosis import OomDiagnosis, diagnose_oom
from memfit.explain.oom_message import OomMessage, parse_oom_message
from memfit.guard.step import StepMetrics
from memfit.integrations.nnunet.plan import NnunetPlan
from memfit.integrations.nnunet.planner import LadderStep, PatchChoice
from memfit.plan.records import Plan
from memfit.records import JsonRecord
from memfit.speed.step_time import Calibration, SpeedParams, SpeedPrediction, predict_step_time
from memfit.workload.zoo import builtin_workload

OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.00 GiB total capacity; 8.00 GiB already "
       "allocated; 1.00 GiB free; 13.00 GiB reserved in total by PyTorch)")


def _all_memfit_classes() -> list[type]:
    classes = []
    for info in pkgutil.walk_packages(memfit.__path__, "memfit."):
        try:
            module = importlib.import_module(info.name)
        except MissingExtraError:  # an integration whose framework is not installed here
            continue
        classes += [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == info.name]
    return classes


@pytest.fixture(scope="module")
def explained() -> Explanation:
    return explain(builtin_workload("mlp").replace(batch_size=8), fixes=False, oom_text=OOM)


def _examples(e: Explanation) -> dict[type, Callable[[], JsonRecord]]:
    ranks = (RankMemory(rank=0, device_index=0, peak_reserved_bytes=10, batch_cost=1.0,
                        gpu_processes=(GpuProcess(pid=1, used_bytes=5),)),
             RankMemory(rank=1, device_index=1, peak_reserved_bytes=30, batch_cost=3.0))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    cost = e.estimate.cost
    assert cost is not None
    trial = Trial(ok=True, cap_bytes=None, peak_allocated_bytes=1, peak_reserved_bytes=2, outside_allocator_bytes=3,
                  num_alloc_retries=0, elapsed_s=0.5)
    choice = PatchChoice(patch_size=(64, 64, 64), batch_size=2, device_bytes=5, peak_allocated_bytes=4,
                         fits_budget=True)
    return {
        Replay: lambda: replay([(1, 1, 100), (-1, 1, 0)]),
        Estimate: lambda: e.estimate,
        StepCost: lambda: cost,
        Trial: lambda: trial,
        Measurement: lambda: Measurement(
            workload="mlp", batch_size=8, precision="fp32", gpu="H100", total_bytes=80 << 30, torch_version="2.13",
            cuda_version="12.8", peak_allocated_bytes=1, peak_reserved_bytes=2, fits_in_bytes=None,
            device_bytes=None, outside_allocator_bytes=3, trials=[trial]),
        OomMessage: lambda: parse_oom_message(OOM),
        OomDiagnosis: lambda: diagnose_oom(parse_oom_message(OOM), e.estimate),
        Explanation: lambda: e,
        Plan: small_plan,
        PatchSampler: lambda: PatchSampler(patch_size=(4, 8, 8)),
        ContainerFinding: lambda: ContainerFinding(attribute="dataset.samples", type_name="list", items=3,
                                                   estimated_bytes=9),
        LoaderSettings: lambda: LoaderSettings(num_workers=2, prefetch_factor=2, pin_memory=True,
                                               persistent_workers=True, in_flight_bytes=5, reasons=("why",)),
        CacheFill: lambda: CacheFill(written=1, skipped=2, bytes_on_disk=3),
        SamplerSettings: lambda: BalancedBatchSampler([1.0] * 20, batch_size=2, num_replicas=2, rank=0).settings(),
        Sharding: lambda: Sharding(units=("layers.0", ""), reshard_after_forward=True),
        ModelStateMemory: lambda: compare_sharding(model, world_size=2).fsdp,
        ShardingComparison: lambda: compare_sharding(model, world_size=2),
        GpuProcess: lambda: GpuProcess(pid=1, used_bytes=5, parent_pid=None),
        RankMemory: lambda: ranks[0],
        Finding: lambda: diagnose(ranks)[0],
        RankReport: lambda: RankReport(ranks=ranks, findings=diagnose(ranks)),
        SpeedPrediction: lambda: predict_step_time(cost, "h100"),
        Calibration: lambda: Calibration(params=SpeedParams(), gpu="H100", workload="mlp", micro_batches=(1, 2),
                                         measured=((1.0, 2.0, 3.0), (2.0, 4.0, 3.0)), rms_log_error=0.1),
        NnunetPlan: lambda: NnunetPlan(
            dataset="Dataset004_Hippocampus", source_plans="nnUNetPlans", plans_identifier="nnUNetPlans_memfit_8GiB",
            plans_file="nnUNetPlans_memfit_8GiB.json", planner="ExperimentPlanner", gpu="H100", budget_bytes=8 << 30,
            margin=0.02, chosen=choice, max_batch_size=2, nnunet_default=choice, nnunet_target_gb=8.0,
            source=choice, ladder=[LadderStep(patch_size=(64, 64, 64), strides=((1, 1, 1),), device_bytes=5,
                                              fits=True)],
            train_command="nnUNetv2_train 4 3d_fullres 0 -p nnUNetPlans_memfit_8GiB", preprocess_command=None,
            estimates=1, elapsed_s=0.1),
        StepMetrics: lambda: StepMetrics(step=3, micro_batch_size=2, micro_batches=4, samples=8, ooms=1,
                                         skipped=False, skip_reason=None, loss_tensor=torch.tensor(1.5),
                                         grad_norm_tensor=torch.tensor(0.25)),
    }


def test_every_result_has_an_example_here(explained: Explanation) -> None:
    """A new result class must join the JSON checks below."""
    results = {c for c in _all_memfit_classes() if issubclass(c, JsonRecord) and c is not JsonRecord}
    assert results == set(_examples(explained))


def test_only_records_write_their_own_json() -> None:
    """No result writes ``{"schema": 1, **asdict(self)}`` by hand: a class defining ``to_dict`` is JsonRecord."""
    own = {c for c in _all_memfit_classes() if "to_dict" in vars(c) or "to_json" in vars(c)}
    # the sampler is not a result: its to_dict is its settings' (SamplerSettings)
    assert own == {JsonRecord, BalancedBatchSampler}


def _expected_keys(record: JsonRecord) -> set[str]:
    keys = {f.name for f in dataclasses.fields(record) if f.metadata.get("memfit.json", ...) is not None}
    keys |= set(record._json_properties)
    if record._schema is not None:
        keys.add("schema")
    return keys


def test_each_result_round_trips_through_json(explained: Explanation) -> None:
    for cls, make in _examples(explained).items():
        record = make()
        assert type(record) is cls
        d = record.to_dict()
        back = json.loads(record.to_json())
        assert back == json.loads(json.dumps(d)), cls  # to_json is to_dict, serialised
        assert set(back) == _expected_keys(record), cls
        assert back.get("schema") == cls._schema, cls  # versioned, or a part versioned by its holder
        for f in dataclasses.fields(record):
            value = getattr(record, f.name)
            if "memfit.json" in f.metadata:  # written through its own converter, or left out
                continue
            if isinstance(value, JsonRecord):  # a nested result keeps its own form and version
                assert back[f.name] == json.loads(value.to_json()), (cls, f.name)
            elif f.name in back and isinstance(value, int | str | bool | float) and f.name != "schema":
                assert back[f.name] == value, (cls, f.name)


def test_results_with_a_reader_read_their_json_back(explained: Explanation) -> None:
    examples = _examples(explained)
    for cls in (Plan, StepCost, Calibration):
        record = examples[cls]()
        assert cls.from_dict(json.loads(record.to_json())) == record  # type: ignore[attr-defined]
    trial = examples[Trial]()
    assert Trial(**json.loads(trial.to_json())) == trial  # what measure() reads from a trial process


def test_explanation_keeps_the_typed_oom_diagnosis(explained: Explanation) -> None:
    assert isinstance(explained.oom, OomDiagnosis) and explained.oom.message.tried_to_allocate_bytes == 2 << 30
    d = explained.to_dict()
    assert d["oom"]["schema"] == 1 and d["oom"]["message"]["free_bytes"] == 1 << 30
    assert d["oom"]["causes"] == list(explained.oom.causes) and d["oom"]["findings"] == explained.oom.findings
    # the nested estimate is the Estimate's own JSON: totals of the cost, not its thousands of per-op rows
    assert d["estimate"] == explained.estimate.to_dict() and "ops" not in d["estimate"]["cost"]["forward"]


def test_properties_and_left_out_fields(explained: Explanation) -> None:
    examples = _examples(explained)
    metrics = examples[StepMetrics]().to_dict()
    assert metrics["loss"] == 1.5 and metrics["grad_norm"] == 0.25 and "loss_tensor" not in metrics
    assert list(metrics)[0] == "schema"
    cmp = examples[ShardingComparison]()
    d = cmp.to_dict()
    assert d["fsdp_saves_bytes"] == cmp.fsdp_saves_bytes and d["ddp"]["total_bytes"] == cmp.ddp.total_bytes
    # a declared schema field keeps its place (last) and holds the class's version
    assert list(examples[Estimate]().to_dict())[-1] == "schema"

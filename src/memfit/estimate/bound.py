"""A safe upper bound on the memory cap a step needs: ``fits_in`` widened by what the trace could not be sure of.

``fits_in`` is memfit's best estimate: right on most steps, a few percent either way on some. A user deciding
"will it fit" needs a number that is rarely below the truth, so every estimate also carries an upper bound:

    upper = replayed cap × (1 + base margin + the widening of each reason the trace recorded) + base slack
            + the bytes of the reasons that widen in bytes

The base margin and slack cover what every estimate shares (segment placement, allocator rounding, library
versions); each reason covers one place where the trace relied on a rule rather than a measurement, or on values
it did not have. The reasons and their widths are named in the estimate's JSON (``uncertainty``), so a wide bound
says why.

Where the constants come from: the reasons' widths from the 14-workload suite and the issue-13 gap cases; the base
margin, the slack, and a check that no width needs to grow, from the steps measured outside the validation
corpus's validation half: its *fit* half, the zoo and the zoo's draws (``benchmarks/corpus/fit_bound.py`` ->
``benchmarks/results/estimate/bound_fit_h200_torch2.11_20261129_s30.json``). The corpus's *validation* half, which
tuned nothing, judges them (``corpus_accuracy_*``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

UncertaintyReason = Literal[
    "rnn_kernel",
    "conv_workspace_extrapolated",
    "value_read",
    "value_branch",
    "value_check",
    "layer_drop",
    "data_dependent_shape",
    "sparse_data",
    "compiled",
    "optimizer_state_rule",
    "reentrant_checkpoint",
    "conv_workspace_erratic",
    "step_kept",
    "workspace_fallback",
    "cudnn_benchmark",
    "deterministic_algorithms",
    "deterministic_roi_align",
]

# Widths, as fractions of the replayed cap. Each says what it covers and where it comes from.
BASE_MARGIN = 0.043
"""Every estimate: the largest need, beyond the bytes its reasons add, of the 275 steps measured outside the corpus's
validation half (its fit half, the zoo and its three draws) that no reason widens by a fraction, rounded up to 0.1 %:
the third draw's MViT-v1-B, 4.21 % (H200; then the zoo's half-precision ConvNeXt-T with its stem and first two stages
frozen, 3.91 %, H100). It was 5 % from the 14-workload suite (a 3.4 % worst miss and room for segment placement) until
session 30, whose first fit over these steps gave 5.2 %, set by the zoo's r3d-18 (5.10 % on an H100; on an H200 a cap
4 % above its replayed one ran out of memory three times of three:
benchmarks/results/estimate/bound_caps_h200_torch2.11_20261129_s30/); its video stem's cuDNN block, sized since from a
calibration grid (memfit.estimate.workspaces.VOLUME_INPUT_MAX_CHANNELS), had made its replay 4.8 % low.
benchmarks/corpus/fit_bound.py -> benchmarks/results/estimate/bound_fit_h200_torch2.11_20261129_s30.json (fit data)."""
BASE_SLACK_BYTES = 0
"""Every estimate, in bytes: the largest need left on the fit steps after the margin and the widths, rounded up to
32 MiB: none (benchmarks/results/estimate/bound_fit_h200_torch2.11_20261129_s30.json; fit data; the closest step in
bytes, the zoo's module_to_after_build, sits 4 MB inside). It was 64 MiB while the trace ran two
micro-batches of a 2-D U-Net with four (c032: the allocator's blocks keep moving over the later micro-batches,
memfit.estimate.trace.TRACED_MICRO_BATCHES)."""
WIDTHS: dict[UncertaintyReason, float] = {
    # cuDNN's fused RNN kernels: reserve and workspace from rules calibrated on a grid of shapes; the issue's
    # 1000-step bidirectional GRU was 10 % under before GRU had a rule of its own (fit data)
    "rnn_kernel": 0.10,
    # a convolution larger than any calibrated shape: cuDNN may pick an algorithm with a larger workspace
    "conv_workspace_extrapolated": 0.10,
    # a tensor value was read (.item(), bool()) that the trace did not have and took as 0
    "value_read": 0.10,
    # control flow depended on a value the trace did not have: the other branch may need more
    "value_branch": 0.25,
    # conditions on values that only check them (their other branch raises or only warns: a label or box check,
    # an assert, memfit.estimate.branch_checks): a step that goes the other way stops or prints. Named, not widened
    "value_check": 0.0,
    # a condition on a one-element random draw (LayerDrop, stochastic depth), taken as skipping nothing: the
    # largest step (a step that skips layers saves fewer activations). Named, not widened
    "layer_drop": 0.0,
    # an output's size depended on values; the trace took them from a real CPU run of the same shapes
    "data_dependent_shape": 0.10,
    # sparse tensors (sparse gradients): what coalescing keeps, and the optimizer's sparse updates, depend on the
    # indices' values, which the trace does not have; EmbeddingBag(sparse=True) with SparseAdam was 15-22 % under
    "sparse_data": 0.25,
    # torch.compile'd code, estimated as eager (compiled code usually needs less: the bound stays eager's)
    "compiled": 0.0,
    # torchao's 8-bit Adam, whose compiled update's scratch is a rule taken from the larger of two code
    # generators (memfit.estimate.optimizer_twins.EIGHT_BIT_SCRATCH_FP32): named, not widened
    "optimizer_state_rule": 0.0,
    # reentrant checkpointing (use_reentrant=True) of blocks with convolutions: the recompute runs in a nested
    # backward whose gradient buffers and cuDNN algorithms the trace does not reproduce. Peak allocated was within
    # 0.22 % for GPT-2, ViT-B/16 and ResNet-50 (benchmarks/results/plan/checkpoint_modes_h100_*; no capped run), but the
    # built-in 3-D U-Net at 1 x 2 with two blocks checkpointed needed a cap 19.4 % above the replayed one (its
    # allocator stream replays to 3.01 GB against 2.52; a 2.87 GB cap ran out of memory), where full
    # checkpointing of the same blocks was within 0.1 %: one more 128 MiB gradient buffer alive in the nested
    # backward, a 384 MiB workspace where the first forward's conv took 151 MiB
    # (benchmarks/results/plan/unet3d_checkpoint_traces_h100_torch2.11_20261126/; fit data). The width is that
    # need beyond the base margin and the slack, rounded up.
    "reentrant_checkpoint": 0.12,
    # half-precision 1x1 filter gradients with channel counts that are not multiples of 32, from 28 x 28 up, at
    # batch <= 16: cuDNN took per-image partial sums or a conversion block of about input + output, erratically
    # (cudnn_calibration_conv_odd_channels_half_h200_torch2.11_20261127.json). Widened in bytes, not by a fraction:
    # the largest such call's allowance (memfit.estimate.workspaces.pointwise_half_unsure_bytes), once, since a
    # workspace lives inside one call; likewise a channels-last convolution's, charged its grid's typical size
    # (none to 18 MiB measured: workspaces.channels_last_unsure_bytes)
    "conv_workspace_erratic": 0.0,
    # tensors the first step's forward or backward made and kept (a module's position embeddings or anchors),
    # taken as replaced by each later step's when the second step's forward and backward are copied from the first
    # (memfit.estimate.step_copies.kept_is_small). Widened in bytes, not by a fraction: another two of them, should
    # each step keep its own
    "step_kept": 0.0,
    # the replay let cuDNN run without a workspace that did not fit (PyTorch then tries an algorithm that needs
    # less): the bound replays the step with every workspace taken instead, and adds what that needs more, in bytes
    # (memfit.estimate.predict._with_workspaces_taken). smp's MAnet (ResNet-34, the zoo's first draw, H100): its
    # fits_in fell to 5.6 % under the measured cap once its upsampling charged no copy of a contiguous gradient; the
    # replay with every workspace taken, with fits_in's margin, is 1.1 % above it, and the bound 3.9 %
    # (benchmarks/results/estimate/upsample_rule_h200_torch2.11_20261130_s36.md; fit data)
    "workspace_fallback": 0.0,
    # torch.backends.cudnn.benchmark on: PyTorch times each new convolution's algorithms with as large a workspace
    # as the allocator grants, then runs the fastest whose workspace it can allocate (aten/src/ATen/native/cudnn/
    # Conv_v8.cpp: get_plans_from_find, try_plans), so the step takes what memory it is given, and the trace charges
    # the heuristics' choice. Fourteen convolutional steps measured with it on (the thirteenth draw, H200): uncapped
    # peaks up to 5.4 x their need (FCN-ResNet101 83.6 GB), smallest caps within -1.1 ... +3.3 % of those without it,
    # fits_in +0.5 ... +3.6 % above them, the bound above all 14
    # (benchmarks/results/estimate/cudnn_benchmark_draw_h200_torch2.11_20261130_s37.md; validation data, the width
    # is the status quo it judged). Named, not widened
    "cudnn_benchmark": 0.0,
    # deterministic algorithms on (torch.use_deterministic_algorithms, torch.backends.cudnn.deterministic: Lightning's
    # Trainer(deterministic=...), HF's enable_full_determinism) in a step with convolutions: cuDNN runs only its
    # deterministic algorithms. Four of calibrate_cudnn.py's grids run so on an H200 (1052 shapes, 2-D and 3-D, fp32
    # and half, channels-last) against the same grids without it (measured on earlier days): 76 shapes' workspaces
    # differed, by up to +172 MB (an fp32 3x3 384 -> 384 at 192², batch 24: 2.72 -> 2.90 GB), +21 MB (one input: half
    # 1x1 layers that took none) and -340 MB; the other grids' shapes within 5.5 MB. Four more grids (1766 shapes,
    # session 39), run with and without the setting in one call: 97 differed; fp32 2-D layers between 1-4 and 32
    # channels (or 8 and 1-5) took a backward workspace of about 1.13 x their larger side where they took none
    # without it (up to +128 MB: 6 x 32 x 384²), half-precision ones within 4.2 MB, a 3-D fp32 1 -> 32 at 96³ +20 MB
    # (benchmarks/results/estimate/cudnn_calibration_*_deterministic_h200_torch2.11_20261130.json). Against what the
    # trace charges (benchmarks/estimate/deterministic_grid_check.py): of the 50 shapes of the eight grids the setting
    # moved by over 1 MiB, it charges 18 more than 1 MiB below what they took under it, by at most 20.3 MiB but for an
    # fp32 3x3 384 -> 384 at 192², batch 24 (165 MiB on a 2.6 GB workspace) and a bf16 1x1 it charges 100 MiB below
    # the default run too (deterministic_grid_check_h200_torch2.11_20261130_s39.md); the narrow fp32 layers it already
    # charged. What had moved
    # the fourteenth draw's caps (-7.2 ... +21.2 %) and the fifteenth's (allocated up to +45 %, HF DPT) was
    # torch.nn.functional's bilinear upsampling, which takes a decomposition on CUDA under the setting; the trace takes
    # it too (memfit._torch_private.cuda_branches_under_deterministic_algorithms). With it the 32 steps of both
    # draws: allocated within 0.5 %, fits_in -1.8 ... +3.5 %, the bound above all 32 without this width
    # (benchmarks/results/estimate/deterministic_draws_h200_torch2.11_20261130_s38.md; fit data: the fix and this
    # width were chosen after those draws). The sixteenth draw's 14 steps without roi_align, predicted before
    # the GPU ran (validation): allocated within 0.5 %, fits_in -1.7 ... +2.8 %, the bound above all 14 (by 2.4 %
    # at least). Named, not widened
    "deterministic_algorithms": 0.0,
    # torchvision's roi_align under deterministic algorithms: for a CUDA tensor it runs its pure PyTorch
    # implementation through torch.compile (torchvision/ops/roi_align.py, _roi_align under lazy_compile). Session 38
    # doubled the bound for it, a width chosen on the sixteenth draw's Faster and Mask R-CNN v2 (1.87 x their
    # estimate without the setting); the seventeenth draw, measured before anything was changed for it, found that
    # too little (Faster R-CNN MobileNet needed 3.7 x: the compiled backward's blocks scale with the RoIs, not the
    # model). An H200 grid of single calls then sized those blocks, which the estimate now charges
    # (kernel_scratch.roi_align_compiled_backward_blocks), and the bound adds 3.2 x the largest feature map in fp32,
    # which maps large against their samples took beyond them (the reason's bytes, kernel_scratch
    # .ROI_ALIGN_INPUT_ALLOWANCE); both from the grid alone
    # (benchmarks/results/estimate/roi_align_deterministic_h200_torch2.11_20261130.json). No width
    "deterministic_roi_align": 0.0,
}

_SEGMENT = 2 << 20  # the caching allocator's large-segment granularity (CUDACachingAllocator.cpp kLargeBuffer)


@dataclass(frozen=True)
class Uncertainty:
    """One place the trace could not be sure of; all but the reasons of width 0 (``compiled``,
    ``optimizer_state_rule``, ``value_check``, ``layer_drop``, ``cudnn_benchmark``, ``deterministic_algorithms``,
    ``deterministic_roi_align``) widen the bound beyond the base margin (some add bytes)."""

    reason: UncertaintyReason
    widen: float
    """The fraction of the replayed cap this reason adds to the bound."""
    detail: str
    """Where in the step, in the user's words (the op, the module, the file and line when known)."""
    bytes: int = 0
    """Bytes this reason adds to the bound beyond ``widen`` (a transient block the trace may have sized wrong)."""


def upper_bound(replayed_bytes: int, reasons: dict[UncertaintyReason, str],
                extra_bytes: dict[UncertaintyReason, int] | None = None) -> tuple[int, list[Uncertainty]]:
    """The bound on the cap (the margin, the widths and the slack), rounded up to a whole 2 MiB segment, and every reason the trace recorded (a reason
    of width 0, ``compiled``, is named without widening it).

    Args:
        replayed_bytes: the smallest cap the allocator replay found (before ``fits_in``'s own margin).
        reasons: reason -> detail, as the trace recorded them (each counts once, however often it occurred).
        extra_bytes: reason -> bytes it adds on top (``Uncertainty.bytes``), where the trace recorded them.
    """
    extra = extra_bytes or {}
    found = [Uncertainty(reason, WIDTHS[reason], detail, extra.get(reason, 0))
             for reason, detail in sorted(reasons.items())]
    widen, added = widening(found)
    bound = -(-(int(replayed_bytes * (1 + widen)) + added) // _SEGMENT) * _SEGMENT
    return bound, found


STRUCTURAL: frozenset[UncertaintyReason] = frozenset(
    {"rnn_kernel", "reentrant_checkpoint", "sparse_data", "compiled", "optimizer_state_rule",
     "deterministic_algorithms", "deterministic_roi_align"})
"""The reasons a trace records from its ops and modules alone (an RNN module, a convolution recomputed by reentrant
checkpointing, a sparse tensor, a compiled module, torchao's 8-bit states, a convolution under deterministic
algorithms), never from sizes or values: every trace of the same op sequence records them, at any batch size. The
planner's floors widen by them (``memfit.plan.search_state.Search.need_floor``)."""


def structural_widening(reasons: Iterable[UncertaintyReason]) -> float:
    """The part of ``widening``'s fraction that every trace of the same op sequence shares, for the reasons a trace
    recorded: the base margin and the ``STRUCTURAL`` reasons' widths."""
    return BASE_MARGIN + sum(WIDTHS[r] for r in set(reasons) if r in STRUCTURAL)


def widening(found: list[Uncertainty]) -> tuple[float, int]:
    """What the bound adds to the replayed cap for ``found``: a fraction (the base margin and each reason's width)
    and bytes (the base slack and each reason's bytes)."""
    return BASE_MARGIN + sum(u.widen for u in found), BASE_SLACK_BYTES + sum(u.bytes for u in found)

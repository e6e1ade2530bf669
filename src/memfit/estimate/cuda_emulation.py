"""Make fake *CPU* tensors allocate what CUDA kernels would allocate.

A CPU-only machine cannot run a training step on fake CUDA tensors (the CUDA autograd engine needs a device), so
memfit traces on fake CPU tensors and switches, for the duration of a trace, the few places where CPU and CUDA
kernels keep different tensors alive:

* **Autocast policy.** CPU autocast casts a different list of ops than CUDA autocast (e.g. CUDA runs
  ``layer_norm``, ``softmax`` and upsampling in fp32; CPU runs ``max_pool3d`` and ``cross_entropy_loss`` in
  fp32). The ``AutocastCPU`` kernels are replaced by kernels that apply CUDA's policy, read from the installed
  torch's own ``ATen/autocast_mode.h``, including its cache of casted fp32 weights.
* **Dropout.** CUDA's fused ``native_dropout`` saves a 1-byte mask; CPU's composite saves a float noise tensor.
* **Attention.** CUDA's ``scaled_dot_product_attention`` runs a fused kernel (flash / memory-efficient) that
  saves the output and a log-sum-exp; CPU may pick the math path, which materialises B*H*L*L probabilities.
  Grouped keys (``enable_gqa``) go to the fused kernel unexpanded: forward keeps them as they are, backward
  expands their gradients (``_GroupedFlash``); keys whose heads only broadcast (multi-query without
  ``enable_gqa``) take the math path, as on CUDA.
* **Linear with a bias on a non-contiguous input.** CUDA adds the bias in place; a fake tensor, a tensor subclass,
  takes the composite's out-of-place add (one more output-sized block).
* **Deterministic algorithms.** Under ``torch.use_deterministic_algorithms(True)`` a CUDA tensor takes Python-level
  decompositions in ``torch.nn.functional`` (bilinear and trilinear ``interpolate``, replicate ``pad``,
  ``max_pool3d_with_indices``) that save and gather other tensors than the kernels a CPU tensor runs
  (``memfit._torch_private.cuda_branches_under_deterministic_algorithms``).
* **RNNs.** CUDA runs ``nn.LSTM``/``GRU``/``RNN`` as one fused cuDNN call (``memfit.estimate.cudnn_rnn``); CPU runs
  them cell by cell. Their ``flatten_parameters`` moves the weights into one buffer on CUDA and does nothing on the
  CPU. ``nn.LSTMCell``/``GRUCell`` run as two matmuls and CUDA's fused cell kernel (``_FusedLSTMCell``).

Everything is scoped by a ``with`` block and undone on exit. Checked against the real AutocastCUDA kernels on fake
CUDA tensors (research/feasibility.md section 4: forward peaks agree within 0.2 MiB on 6 workloads).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memfit import _torch_private as tp
from memfit.estimate.cudnn_rnn import RNNEmulation, flatten_weights
from memfit.estimate.gpus import GpuSpec

log = logging.getLogger(__name__)

LOWER, FP32, SET_OPT_DTYPE, PROMOTE = "lower_precision_fp", "fp32", "fp32_set_opt_dtype", "promote"

_MACROS = {
    "AT_FORALL_LOWER_PRECISION_FP": LOWER,
    "AT_FORALL_FP32": FP32,
    "AT_FORALL_FP32_SET_OPT_DTYPE": SET_OPT_DTYPE,
    "AT_FORALL_PROMOTE": PROMOTE,
}

# Used only where the installed torch ships no headers. Source: aten/src/ATen/autocast_mode.h (torch 2.13).
_FALLBACK_POLICY: dict[str, str] = {
    **{n: LOWER for n in (
        "_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d.input "
        "conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm "
        "baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell "
        "rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention").split()},
    **{n: FP32 for n in (
        "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar "
        "pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm.dim "
        "nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d "
        "hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss "
        "multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss "
        "binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d "
        "_upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d "
        "_upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa "
        "upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa").split()},
    **{n: SET_OPT_DTYPE for n in (
        "prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm linalg_matrix_norm "
        "linalg_matrix_norm.str_ord sum sum.dim_IntList").split()},
    **{n: PROMOTE for n in "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add".split()},
}


@functools.lru_cache(maxsize=1)
def cuda_autocast_policy() -> dict[str, str]:
    """``{"aten op.overload": policy}`` for CUDA autocast, read from the installed torch's autocast_mode.h."""
    try:
        with open(tp.autocast_header_path()) as f:
            text = f.read()
    except OSError:
        log.info("torch ships no ATen headers; using memfit's copy of CUDA's autocast lists (torch 2.13)")
        return dict(_FALLBACK_POLICY)
    policy: dict[str, str] = {}
    for macro, kind in _MACROS.items():
        match = re.search(rf"#define {macro}\(_\)(.*?)(?:\n\s*\n|\n#)", text, re.S)
        if match is None:
            continue
        for entry in re.findall(r"_\(([^)]*)\)", match.group(1)):
            parts = [p.strip() for p in entry.split(",")]
            name = parts[0] if len(parts) == 1 else f"{parts[0]}.{parts[1]}"
            policy[name] = kind
    return policy or dict(_FALLBACK_POLICY)


def _overload(name: str) -> tp.OpOverload | None:
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


def _eligible(t: Any) -> bool:
    # CUDA autocast casts floating tensors on its device, never float64 (autocast_mode.h: is_eligible)
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class _CastCache:
    """Autocast's cache of lower-precision copies of fp32 leaf weights, cleared when autocast exits.

    It matters for memory: the bf16 copy of a weight lives until the outermost autocast region ends.
    """

    def __init__(self) -> None:
        self._casts: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def cast(self, t: torch.Tensor, dtype: torch.dtype, lower: torch.dtype) -> torch.Tensor:
        if t.dtype == dtype:
            return t
        cacheable = (
            dtype == lower and t.dtype == torch.float32 and t.requires_grad and t.is_leaf and not tp.is_view(t)
        )
        if not cacheable:
            return t.to(dtype)
        hit = self._casts.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        casted = t.to(dtype)
        self._casts[id(t)] = (weakref.ref(t), casted)
        return casted

    def clear(self) -> None:
        self._casts.clear()


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value) if _eligible(value) else value
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(fn, v) for v in value)
    return value


def _cast_arguments(cast: Callable[[torch.Tensor], torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any],
                    arg_names: list[str]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Cast every argument as CUDA autocast does, the last argument first.

    Autocast's wrapper casts with a pack expansion, ``(*F)(cached_cast(dtype, args)...)``, and GCC evaluates a
    call's arguments right to left: on an H200 (torch 2.11) a linear layer's weight copy is allocated before its
    input copy (benchmarks/results/estimate/entry_traces_h200_torch2.11_20261126.tar.gz, c077_hf_seq2seq). The
    order decides which copy gets which cached block. A list argument is cast front to back (a loop).
    """
    order = {name: i for i, name in enumerate(arg_names)}
    casted = {k: _map_tensors(cast, kwargs[k]) for k in sorted(kwargs, key=lambda k: -order.get(k, len(order)))}
    positional = [_map_tensors(cast, a) for a in reversed(args)][::-1]
    return tuple(positional), {k: casted[k] for k in kwargs}


def _half_in_fp32(op: tp.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], half: torch.dtype) -> Any:
    """``op`` on arguments of the half precision ``half`` (fp16 or bf16), computed in fp32 and rounded back: the same
    dtypes and shapes as CUDA's kernels (which accumulate in fp32 too), at CPU fp32 speed. torch 2.14's CPU fp16
    convolution ran 190x slower than fp32 on this project's 2-core AVX-512 machine (a 2 × 64 × 128² 3×3 conv: 2.9 s
    against 16 ms); on an AVX2 VM a 64 × 512 × 64 @ 64 × 64 × 512 bmm took 54 ms in fp32, 1.67 s in bf16 and 1.57 s
    in fp16 (session 29)."""
    def up(t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.dtype == half else t

    out = op(*_map_tensors(up, args), **{k: _map_tensors(up, v) for k, v in kwargs.items()})
    return _map_tensors(lambda t: t.to(half) if t.dtype == torch.float32 else t, out)


def _autocast_kernel(op: tp.OpOverload, policy: str, cache: _CastCache,
                     semantics: CudaSemantics | None = None) -> Callable[..., Any]:
    arg_names = tp.op_argument_names(op)
    dtype_pos = arg_names.index("dtype") if "dtype" in arg_names else None

    def kernel(*args: Any, **kwargs: Any) -> Any:
        lower = torch.get_autocast_dtype("cpu")
        with tp.exclude_dispatch_key("AutocastCPU"):
            if policy == LOWER:
                cast = functools.partial(cache.cast, dtype=lower, lower=lower)
                args, kwargs = _cast_arguments(cast, args, kwargs, arg_names)
                if semantics is not None and semantics.half_in_fp32:
                    return _half_in_fp32(op, args, kwargs, lower)
            elif policy == FP32:
                cast = functools.partial(cache.cast, dtype=torch.float32, lower=lower)
                args, kwargs = _cast_arguments(cast, args, kwargs, arg_names)
            elif policy == SET_OPT_DTYPE:
                if args and _eligible(args[0]) and dtype_pos is not None:
                    if dtype_pos < len(args):
                        if args[dtype_pos] is None:
                            args = (*args[:dtype_pos], torch.float32, *args[dtype_pos + 1 :])
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
            elif policy == PROMOTE:
                widest = lower
                for value in (*args, *kwargs.values()):
                    for t in value if isinstance(value, (list, tuple)) else (value,):
                        if _eligible(t):
                            widest = torch.promote_types(widest, t.dtype)
                cast = functools.partial(cache.cast, dtype=widest, lower=lower)
                args, kwargs = _cast_arguments(cast, args, kwargs, arg_names)
            return op(*args, **kwargs)

    return kernel


def _cuda_dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    # aten/src/ATen/native/Dropout.cpp: on CUDA, training dropout with 0 < p < 1 is the fused native_dropout,
    # which keeps a bool mask (1 B/element) for backward instead of a float noise tensor.
    if train and 0 < p < 1 and input.numel() > 0:
        return torch.ops.aten.native_dropout.default(input, p, train)[0]
    if train and p == 1:
        return input * 0
    return input


def _cuda_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # aten/src/ATen/native/Linear.cpp (linear): a bias fuses into addmm for 2-D input and for contiguous input of
    # any rank (viewed as 2-D); otherwise matmul and then the bias added *in place*. The composite adds it out of
    # place for a tensor subclass, which a fake tensor is: traced as the composite, a non-contiguous input (a
    # batch-first RNN's output into its head) costs a second output-sized block that CUDA never allocates.
    if bias is None:
        return torch.matmul(input, weight.t())
    if input.dim() == 2:
        return torch.addmm(bias, input, weight.t())
    if input.is_contiguous() and (input.dim() == 3 or bias.dim() == 1):
        out = torch.addmm(bias, input.reshape(-1, input.shape[-1]), weight.t())
        return out.view(*input.shape[:-1], out.shape[1])
    return torch.matmul(input, weight.t()).add_(bias)


def _cuda_batch_norm(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool,
                     momentum: float, eps: float, cudnn_enabled: bool) -> torch.Tensor:
    # aten/src/ATen/native/Normalization.cpp: where _select_batch_norm_backend picks cuDNN, _batch_norm_impl_index
    # runs it on input.contiguous(input.suggest_memory_format()), a copy that autograd saves for backward, and
    # cuDNN's output is laid out the same way. A batch norm over a transposed view, (N, L, C) viewed (N, C, L) as
    # Hugging Face's PatchTST does it, so gets a contiguous (N, C, L) output, which the transpose back makes a
    # non-contiguous input for every linear layer after it, each then copying it (an H200 stream of the fourth
    # draw's PatchTST: entry_traces_holdout4_h200_torch2.11_20261129_s31.tar.gz). The fake kernel keeps the
    # input's strides instead, and no copy is made. Not where cuDNN is not used: bf16, fp16 with fp16 weights,
    # no affine parameters, fewer than 3 dimensions, more than 880,801 samples in training (65,535 in eval). The
    # test of eps against cuDNN's CUDNN_BN_MIN_EPSILON (1e-5 in older headers) is left out: where it sends a call to
    # the native kernel, the copy charged here is more than the GPU takes, the safe side.
    cudnn = (cudnn_enabled and weight is not None and bias is not None
             and input.dtype != torch.bfloat16 and weight.dtype != torch.bfloat16
             and (input.dtype != torch.float16 or weight.dtype == torch.float32)
             and ((running_mean is not None and running_var is not None)
                  or (running_mean is None and running_var is None and training))
             and input.dim() >= 3 and input.shape[0] <= (880801 if training else 65535)
             and input.numel() < 2**31 - 1)
    if cudnn:
        fmt = tp.suggest_memory_format(input)
        if not input.is_contiguous(memory_format=fmt):
            input = input.contiguous(memory_format=fmt)
    return tp.batch_norm_impl(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)


def _cuda_softmax(input: torch.Tensor, dim: int, dtype: torch.dtype | None = None, *, log: bool = False) -> torch.Tensor:
    # aten/src/ATen/native/SoftMax.cpp, softmax(input, dim, dtype) and log_softmax alike: on CUDA an fp16 input asked
    # for fp32 output (what autocast's fp32_set_opt_dtype policy asks of every fp16 softmax) runs
    # _softmax(input, dim, half_to_float=True) on the fp16 data; anything else is converted to dtype first. The CPU
    # composite always converts: an fp32 copy of the scores per attention layer that CUDA never makes (HF CvT's eager
    # attention in fp16: 600 MB scores, copied in memfit's trace and not in the fifth draw's H200 stream,
    # entry_traces_holdout5_h200_torch2.11_20261129_s32.tar.gz). bf16 converts on CUDA too. Real CPU tensors (the
    # real forward) keep the composite: the CPU kernel has no half_to_float.
    if input.dtype == torch.float16 and dtype == torch.float32 and isinstance(input, tp.FakeTensor):
        return tp.softmax_kernel(input, dim, True, log=log)
    return tp.softmax_kernel(input.to(dtype) if dtype is not None else input, dim, False, log=log)


class _GroupedFlash(torch.autograd.Function):
    """CUDA's fused attention on grouped keys (``enable_gqa``, fp16/bf16, no mask; Llama-3, Mistral, Qwen2 through
    Hugging Face's SDPA attention when it passes no mask): cuDNN's on an H100 with torch 2.11, flash elsewhere
    (tests/test_trace.py checks on the GPU). It reads each key and value head for its group of query heads, so
    forward saves them as they are; its backward computes the key and value gradients for every query head (flash:
    flash_api.cpp mha_bwd's dk_expanded, dv_expanded; the zoo's Mixtral's H100 stream: one block of two fp32
    query-sized accumulators and the two expanded gradients) and sums each group into them. The CPU kernel that
    stands in for it needs as many key heads as query heads: they are expanded for its calls, unseen by the trace
    (``no_dispatch_modes``), instead of being saved expanded for backward, (groups - 1) x the keys and values of
    every layer more than CUDA keeps."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float,
                is_causal: bool, scale: float | None) -> torch.Tensor:
        key_x, value_x = _expanded_heads(query, key, value)
        out, lse = tp.flash_cpu_with_lse(query, key_x, value_x, dropout_p, is_causal, scale)
        del key_x, value_x
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.args = (dropout_p, is_causal, scale)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        key_x, value_x = _expanded_heads(query, key, value)
        dq, dk_x, dv_x = tp.flash_cpu_backward(grad, query, key_x, value_x, out, lse, *ctx.args)
        del key_x, value_x
        heads, groups = key.shape[-3], query.shape[-3] // key.shape[-3]
        dk = dk_x.unflatten(-3, (heads, groups)).sum(-3)
        dv = dv_x.unflatten(-3, (heads, groups)).sum(-3)
        return dq, dk, dv, None, None, None


def _expanded_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value repeated to the query's heads, as fake tensors the trace does not see (CUDA makes none)."""
    groups = query.shape[-3] // key.shape[-3]
    with tp.no_dispatch_modes():
        return key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)


def _cuda_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    # On sm80+ CUDA picks a fused kernel (flash for fp16/bf16 without a mask, else memory-efficient or cuDNN);
    # all of them save the output and a float32 log-sum-exp of B*H*L, never the B*H*L*L probabilities.
    # The CPU flash kernel keeps exactly those tensors, so it stands in for them. Where no fused kernel takes
    # the call (ATen/native/transformers/cuda/sdp_utils.cpp), CUDA runs the math path, and so does the trace.
    half = query.dtype in (torch.float16, torch.bfloat16)
    gqa = enable_gqa and key.shape[-3] != query.shape[-3]
    # the kernels the user left on (torch.nn.attention.sdpa_kernel, torch.backends.cuda.enable_flash_sdp(False) ...):
    # CUDA picks among those alone, and the math path, which saves the B*H*L*L probabilities, when none takes the call
    # (sdp_utils.cpp, select_sdp_backend)
    flash = torch.backends.cuda.flash_sdp_enabled()
    efficient = torch.backends.cuda.mem_efficient_sdp_enabled()
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    if not (flash or efficient or cudnn):
        if gqa:
            groups = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
        return tp.sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale)
    if (gqa and half and attn_mask is None and query.dim() == 4 and isinstance(query, tp.FakeTensor)
            and (flash or cudnn)
            and query.shape[-1] % 8 == 0 and query.shape[-1] == key.shape[-1] == value.shape[-1] <= 256
            and query.shape[-3] % key.shape[-3] == 0 and _fused_strides(query, key, value, None)):
        return _GroupedFlash.apply(query, key, value, dropout_p, is_causal, scale)
    if gqa:
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
    if query.dim() != 4 or not (query.dtype == key.dtype == value.dtype):
        return tp.sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale)
    if not query.shape[:2] == key.shape[:2] == value.shape[:2]:
        # keys with fewer heads that broadcast (Falcon's multi-query attention passes one key head for 16 query
        # heads, without enable_gqa): the fused kernels need equal batch and heads (sdp_utils.cpp,
        # check_batch_size_and_num_heads_dense), the math path broadcasts them into B*H*L*L scores. Taken for
        # flash, the zoo's fresh draw's Falcon was 26 % under its H100 peak
        # (benchmarks/results/estimate/holdout_accuracy_h100_torch2.11_20261127.md)
        return tp.sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale)
    if gqa and not (half and attn_mask is None):
        # grouped keys: only flash (fp16/bf16, no mask) takes them; the memory-efficient kernel does not
        # (Hugging Face passes enable_gqa only without a mask, for this reason: its use_gqa_in_sdpa)
        return tp.sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale)
    unaligned = query.shape[-1] % (8 if half else 4) or value.shape[-1] % (8 if half else 4)
    flash_pads = flash and half and attn_mask is None and query.shape[-1] == key.shape[-1] == value.shape[-1] <= 256
    if unaligned and not flash_pads:
        # head sizes the memory-efficient kernel's GEMMs cannot align: 8 elements for fp16/bf16, 4 for fp32 on
        # sm80+ (sdp_utils.cpp, minimum_gemm_alignment); flash does not take fp32 or a mask
        return tp.sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale)
    if not _fused_strides(query, key, value, attn_mask):
        # CUDA's fused kernels need a unit stride along the last dimension of q, k, v and the mask; the CPU's
        # do not (ATen/native/transformers/sdp_utils_cpp.h, check_last_dim_stride_equals_1_dense). T5's position
        # bias, a permuted view, sent Hugging Face T5 (transformers 5.17) to the math path on an H200:
        # benchmarks/results/estimate/sdpa_choices_h200_torch2.11_20261126.json
        return tp.sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale)
    if not efficient and (attn_mask is not None or not half):
        # a mask or fp32: only the memory-efficient kernel takes them (flash takes neither; cuDNN's is not counted
        # on for them), and the user turned it off
        return tp.sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale)
    if attn_mask is not None and attn_mask.requires_grad:
        # a learned bias (T5's relative positions): only the memory-efficient kernel returns its grad, so CUDA
        # runs that one (the CPU flash kernel refuses it). Its meta kernel gives CUDA's saved tensors: the
        # output and a log-sum-exp padded to a multiple of 32 queries; in backward, a grad of the expanded bias
        # with its keys padded to a multiple of 16 (tests/test_trace.py checks the kernel and the log-sum-exp on CUDA).
        if attn_mask.dtype != query.dtype:
            return tp.sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale)
        bias = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        return tp.sdpa_efficient(query, key, value, bias, dropout_p, is_causal, scale)
    if not half and attn_mask is None and isinstance(query, tp.FakeTensor):
        # fp32: the flash kernel takes only fp16/bf16, so CUDA runs the memory-efficient one, whose output is laid
        # out (B, L, H, D) whatever the query's layout; the CPU kernel's follows the query. nn.MultiheadAttention's
        # query is a view of (L, B*H, D): its permute(2, 0, 1, 3).contiguous() then copies CUDA's output, one more
        # output-sized block per layer kept for out_proj's backward (fit probe p_enc_fp32_prenorm's H200 stream:
        # benchmarks/results/estimate/gap_traces_probes_h200_torch2.11_20261126.tar.gz). Its meta kernel is
        # CUDA's; a real CPU step (data-dependent sizes) cannot run it and keeps the CPU kernel below.
        return tp.sdpa_efficient(query, key, value, None, dropout_p, is_causal, scale)
    if dropout_p > 0 and not isinstance(query, tp.FakeTensor):
        # a real step (sizes that depend on data): the CPU kernel has no dropout, and CUDA's flash kernel keeps
        # no mask either (it regenerates it from the RNG state), so the saved tensors are the same without it
        dropout_p = 0.0
    if unaligned:
        # flash takes any head size up to 256 (sdp_utils.cpp, check_head_dim_size_flash): CUDA pads q, k and v to
        # a multiple of 8 and slices the output back (attention.cpp, pad_last_dim<8> and
        # post_process_flash_output), so the kernel saves the padded copies. MobileViT's heads of 36 and 60
        # went to the math path before, with fp32 B×H×L×L probabilities: 9.8 % over the H100's peak
        # (benchmarks/results/estimate/zoo_accuracy_h100_torch2.11_20261127.md, timm_mobilevit_s)
        size = query.shape[-1]
        scale = size**-0.5 if scale is None else scale
        query, key, value = (torch.nn.functional.pad(t, (0, -size % 8)) for t in (query, key, value))
        return tp.sdpa_flash_cpu(query, key, value, None, dropout_p, is_causal, scale)[..., :size]
    return tp.sdpa_flash_cpu(query, key, value, attn_mask, dropout_p, is_causal, scale)


class _FusedLSTMCell(torch.autograd.Function):
    """CUDA's ``_thnn_fused_lstm_cell`` (aten/src/ATen/native/cuda/RNN.cu) on the two gate products: it adds the
    biases and applies the gates in one kernel, whose workspace (the activated gates, N x 4H) it returns for
    backward, beside hy and cy. Autograd keeps what its formula names (tools/autograd/derivatives.yaml): both gate
    products, cx, cy and the workspace. Shapes only: the trace's fake tensors carry no values."""

    @staticmethod
    def forward(ctx: Any, igates: torch.Tensor, hgates: torch.Tensor, cx: torch.Tensor, b_ih: torch.Tensor | None,
                b_hh: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        workspace = torch.empty_like(igates, memory_format=torch.contiguous_format)
        hy = torch.empty_like(cx, memory_format=torch.contiguous_format)
        cy = torch.empty_like(cx, memory_format=torch.contiguous_format)
        ctx.save_for_backward(igates, hgates, cx, cy, workspace)
        ctx.has_bias = b_ih is not None
        return hy, cy

    @staticmethod
    def backward(ctx: Any, grad_hy: torch.Tensor | None, grad_cy: torch.Tensor | None) -> tuple[Any, ...]:
        _, _, cx, _, workspace = ctx.saved_tensors
        # _thnn_fused_lstm_cell_backward_impl: one gate gradient, the same tensor for both products
        grad_gates = torch.empty_like(workspace, memory_format=torch.contiguous_format)
        grad_cx = torch.empty_like(cx, memory_format=torch.contiguous_format)
        grad_bias = grad_gates.sum(0) if ctx.has_bias else None
        return grad_gates, grad_gates, grad_cx, grad_bias, grad_bias


class _FusedGRUCell(torch.autograd.Function):
    """CUDA's ``_thnn_fused_gru_cell``: hy and a workspace of N x 5H (``GRU_WORKSPACE_MULTIPLIER``); autograd keeps
    both gate products, hx and the workspace; its backward makes the two gate gradients (N x 3H) and hx's."""

    @staticmethod
    def forward(ctx: Any, igates: torch.Tensor, hgates: torch.Tensor, hx: torch.Tensor, b_ih: torch.Tensor | None,
                b_hh: torch.Tensor | None) -> torch.Tensor:
        hy = torch.empty_like(hx, memory_format=torch.contiguous_format)
        workspace = hx.new_empty((hx.shape[0], hx.shape[1] * 5))
        ctx.save_for_backward(igates, hgates, hx, workspace)
        ctx.has_bias = b_ih is not None
        return hy

    @staticmethod
    def backward(ctx: Any, grad_hy: torch.Tensor | None) -> tuple[Any, ...]:
        igates, hgates, hx, _ = ctx.saved_tensors
        grad_igates = igates.new_empty(igates.shape)
        grad_hgates = hgates.new_empty(hgates.shape)
        grad_hx = torch.empty_like(hx, memory_format=torch.contiguous_format)
        return (grad_igates, grad_hgates, grad_hx, grad_igates.sum(0) if ctx.has_bias else None,
                grad_hgates.sum(0) if ctx.has_bias else None)


def _cuda_lstm_cell(input: torch.Tensor, hx: Any, w_ih: torch.Tensor, w_hh: torch.Tensor,
                    b_ih: torch.Tensor | None = None, b_hh: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    # nn.LSTMCell on CUDA (aten/src/ATen/native/RNN.cpp, LSTMCell): two matmuls without the biases, then the fused
    # kernel. The CPU composite saves other tensors: 1.75 of the 3.5 MiB a step that an H100 kept for a
    # 128 x 512 cell (the fresh draw's seq2seq loop: benchmarks/results/estimate/holdout_accuracy_*_timm1029.md)
    if isinstance(input, tp.FakeTensor) and input.dim() == 2:
        igates, hgates = torch.matmul(input, w_ih.t()), torch.matmul(hx[0], w_hh.t())
        return _FusedLSTMCell.apply(igates, hgates, hx[1], b_ih, b_hh)
    gates = torch.nn.functional.linear(input, w_ih, b_ih) + torch.nn.functional.linear(hx[0], w_hh, b_hh)
    i, f, g, o = gates.chunk(4, -1)
    cy = f.sigmoid() * hx[1] + i.sigmoid() * g.tanh()
    return o.sigmoid() * cy.tanh(), cy


def _cuda_gru_cell(input: torch.Tensor, hx: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor,
                   b_ih: torch.Tensor | None = None, b_hh: torch.Tensor | None = None) -> torch.Tensor:
    # nn.GRUCell on CUDA (RNN.cpp, GRUCell): two matmuls, then the fused kernel
    if isinstance(input, tp.FakeTensor) and input.dim() == 2:
        return _FusedGRUCell.apply(torch.matmul(input, w_ih.t()), torch.matmul(hx, w_hh.t()), hx, b_ih, b_hh)
    ri, zi, ni = torch.nn.functional.linear(input, w_ih, b_ih).chunk(3, -1)
    rh, zh, nh = torch.nn.functional.linear(hx, w_hh, b_hh).chunk(3, -1)
    r, z = (ri + rh).sigmoid(), (zi + zh).sigmoid()
    n = (ni + r * nh).tanh()
    return (hx - n) * z + n


def _fused_strides(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """The last-dimension strides CUDA's fused attention kernels accept (a head size of 1 may have any)."""
    qkv = all(t.stride(-1) == 1 for t in (query, key, value)) or query.shape[-1] == 1
    return qkv and (mask is None or mask.stride(-1) == 1)


def _pad_packed_sequence(data: torch.Tensor, batch_sizes: torch.Tensor, batch_first: bool, padding_value: float,
                         total_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ATen's composite (aten/src/ATen/native/PackedSequence.cpp), the same ops: it writes the lengths through a data
    pointer of a tensor it makes, which a fake tensor does not have. One copy per run of time steps with the same
    batch size, into an output filled with ``padding_value``; the lengths are a CPU tensor."""
    sizes = batch_sizes.tolist()
    steps, batch = len(sizes), (sizes[0] if sizes else 0)
    if total_length > 0 and total_length < steps:
        raise RuntimeError(f"Expected total_length to be at least the length of the longest sequence ({steps}), "
                           f"but got total_length={total_length}")
    output = data.new_full((max(total_length, steps), batch, *data.shape[1:]), padding_value)
    offset = start = 0
    for t in range(1, steps + 1):
        if t == steps or sizes[t] != sizes[start]:
            rows = (t - start) * sizes[start]
            output[start:t, : sizes[start]] = data[offset:offset + rows].view(t - start, sizes[start], *data.shape[1:])
            offset, start = offset + rows, t
    lengths = torch.tensor([sum(1 for s in sizes if s > b) for b in range(batch)], dtype=torch.int64, device="cpu")
    return (output.transpose(0, 1) if batch_first else output), lengths


class CudaSemantics:
    """Context manager: while inside, CPU (fake) tensors allocate as CUDA kernels would on ``gpu`` (default H100).

    Example:
        >>> with CudaSemantics():
        ...     y = torch.nn.functional.dropout(torch.ones(4), 0.5)
    """

    def __init__(self, gpu: GpuSpec | None = None, *, half_in_fp32: bool = False) -> None:
        self.half_in_fp32 = half_in_fp32
        """Autocast's fp16 and bf16 ops compute in fp32 and round back: for real CPU tensors whose values alone matter
        (a real forward that sizes data-dependent outputs), never for a traced step (the casts would allocate)."""
        self.cache = _CastCache()
        self.rnn = RNNEmulation(gpu)
        self._override = tp.override_library("aten")
        self._saved_clear: Callable[[], None] | None = None
        self._saved_flatten: Callable[[torch.nn.RNNBase], None] | None = None
        self._saved_swap: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        self._branches: contextlib.AbstractContextManager[None] | None = None

    def __enter__(self) -> CudaSemantics:
        lib = self._override.__enter__()
        policy = cuda_autocast_policy()
        for name, kind in policy.items():
            op = _overload(name)
            if op is not None:
                lib.impl(name, _autocast_kernel(op, kind, self.cache, self), "AutocastCPU")
        lib.impl("binary_cross_entropy", _banned_bce, "AutocastCPU")
        # CPU-only autocast kernels (max_pool3d, cross_entropy_loss in fp32, ...) must not fire: fall through,
        # so composites decompose and their parts get CUDA's policy.
        for name in cpu_only_autocast_ops(tuple(policy)):
            lib.impl(name, tp.fallthrough_kernel, "AutocastCPU")
        lib.impl("dropout", _cuda_dropout, "CompositeImplicitAutograd")
        lib.impl("scaled_dot_product_attention", _cuda_sdpa, "CompositeImplicitAutograd")
        lib.impl("linear", _cuda_linear, "CompositeImplicitAutograd")
        lib.impl("batch_norm", _cuda_batch_norm, "CompositeImplicitAutograd")
        lib.impl("softmax.int", _cuda_softmax, "CompositeImplicitAutograd")
        lib.impl("log_softmax.int", functools.partial(_cuda_softmax, log=True), "CompositeImplicitAutograd")
        # on CUDA, nn.LSTM/GRU/RNN run cuDNN's fused RNN whenever cuDNN takes the input (aten/src/ATen/native/RNN.cpp)
        for rnn_op, mode in (("lstm", "LSTM"), ("gru", "GRU"), ("rnn_tanh", "RNN_TANH"), ("rnn_relu", "RNN_RELU")):
            lib.impl(f"{rnn_op}.input", self.rnn.kernel(mode), "CompositeImplicitAutograd")
            lib.impl(f"{rnn_op}.data", self.rnn.packed_kernel(mode), "CompositeImplicitAutograd")
        lib.impl("_pad_packed_sequence", _pad_packed_sequence, "CompositeImplicitAutograd")
        lib.impl("lstm_cell", _cuda_lstm_cell, "CompositeImplicitAutograd")
        lib.impl("gru_cell", _cuda_gru_cell, "CompositeImplicitAutograd")
        # called by the constructor, .to()/.cuda() and the user: where it runs matters to the allocator's layout
        self._saved_flatten = torch.nn.RNNBase.flatten_parameters
        torch.nn.RNNBase.flatten_parameters = _flatten_parameters  # type: ignore[method-assign,assignment]
        # torch.autocast.__exit__ calls torch.clear_autocast_cache() at nesting 0: clear our cast cache with it
        self._saved_clear = torch.clear_autocast_cache
        saved, cache = self._saved_clear, self.cache

        def clear_autocast_cache() -> None:
            cache.clear()
            saved()

        torch.clear_autocast_cache = clear_autocast_cache
        # Module.to() / .float() in the step (Switch Transformers' router casts its classifier in forward)
        self._saved_swap = torch.utils.swap_tensors
        torch.utils.swap_tensors = _swap_as_on_cuda(self._saved_swap)
        self._branches = tp.cuda_branches_under_deterministic_algorithms()
        self._branches.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._branches is not None:
            self._branches.__exit__(None, None, None)  # restores the functions whatever happened
            self._branches = None
        if self._saved_flatten is not None:
            torch.nn.RNNBase.flatten_parameters = self._saved_flatten  # type: ignore[method-assign,assignment]
            self._saved_flatten = None
        if self._saved_clear is not None:
            torch.clear_autocast_cache = self._saved_clear
            self._saved_clear = None
        if self._saved_swap is not None:
            torch.utils.swap_tensors = self._saved_swap
            self._saved_swap = None
        self.cache.clear()
        self._override.__exit__(*exc)


def _flatten_parameters(module: torch.nn.RNNBase) -> None:
    flatten_weights(module)


def _swap_as_on_cuda(swap: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``torch.utils.swap_tensors`` as ``Module._apply`` (``.to()``, ``.float()``, ``.half()``) needs it for fake
    parameters: torch swaps a fake parameter with its converted copy, which fails once anything holds a weak
    reference to it (the fake mode does) and would leave the hooks memfit put on it behind. On CUDA tensors
    ``_apply`` keeps the parameter and gives it the converted data (``param.data = converted``): the same here, and
    a conversion that changed nothing (a copy of the same storage, dtype and layout) changes nothing."""

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if not (isinstance(t1, tp.FakeTensor) and isinstance(t2, tp.FakeTensor)):
            return swap(t1, t2)
        if (t1.untyped_storage() is t2.untyped_storage() and t1.dtype == t2.dtype and t1.shape == t2.shape
                and t1.stride() == t2.stride() and t1.storage_offset() == t2.storage_offset()):
            return None
        t1.data = t2.detach()
        return None

    return swap_tensors


def _banned_bce(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast on CUDA. "
        "Use binary_cross_entropy_with_logits / BCEWithLogitsLoss (CUDA autocast refuses it too)."
    )


@functools.lru_cache(maxsize=4)
def cpu_only_autocast_ops(cuda_ops: tuple[str, ...]) -> tuple[str, ...]:
    """Ops with an AutocastCPU kernel that CUDA autocast leaves alone (``aten::`` prefix stripped)."""
    cuda = set(cuda_ops)
    names = []
    for full in tp.all_op_names():
        if not full.startswith("aten::"):
            continue
        name = full[len("aten::") :]
        if name in cuda or name == "binary_cross_entropy":
            continue
        if tp.has_kernel(full, "AutocastCPU"):
            names.append(name)
    return tuple(names)


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool, *, cudnn_benchmark: bool | None = None) -> Iterator[None]:
    """PyTorch's deterministic algorithms (warn only) and cuDNN's deterministic mode on or off inside, and cuDNN's
    benchmark mode set where ``cudnn_benchmark`` is given; the process's settings given back after. The trace reads
    them at each op (the paths CUDA takes under them: ``CudaSemantics``' decompositions, ``kernel_scratch``'s index
    sorts and compiled ``roi_align``), so an estimate made inside is the one a process with these settings gets."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(enabled, warn_only=True)
    torch.backends.cudnn.deterministic = enabled
    if cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = cudnn_benchmark
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]

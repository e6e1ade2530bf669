"""The tracer on models whose memory can be worked out by hand."""

import functools
import gc
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_flatten

from memfit import Workload
from memfit.estimate.gpus import gpu_spec
from memfit.estimate.trace import trace_workload
from memfit.estimate.trace_record import output_tensors

MiB = 1 << 20
GPU = gpu_spec("h100")


def _linear_workload(precision: str = "fp32", **kw) -> Workload:  # noqa: ANN003
    # 1024x1024 weight (4 MiB fp32), batch 256x1024 (1 MiB fp32)
    base = dict(
        name="linear",
        model=lambda: torch.nn.Linear(1024, 1024, bias=False),
        batch=lambda n: (torch.randn(n, 1024),),
        loss=lambda out, b: out.float().pow(2).mean(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        batch_size=256,
        precision=precision,
    )
    base.update(kw)
    return Workload(**base)


def _live(trace, upto: int) -> dict[int, int]:  # noqa: ANN001
    live = {}
    for op, key in zip(trace.ops[:upto], trace.keys[:upto]):
        if op > 0:
            live[key] = trace.allocs[key].nbytes
        else:
            live.pop(key, None)
    return live


def test_linear_fp32_categories_are_exact():
    trace = trace_workload(_linear_workload(), GPU, steps=2)
    live = _live(trace, len(trace.ops))
    by_cat: dict[str, int] = {}
    for key, size in live.items():
        by_cat[trace.allocs[key].category] = by_cat.get(trace.allocs[key].category, 0) + size
    # after the last step: the weight, its gradient and the batch stay; cuBLAS keeps two workspaces
    assert by_cat["params"] == 4 * MiB
    assert by_cat["grads"] == 4 * MiB
    assert by_cat["data"] == 1 * MiB
    assert by_cat["workspaces"] == 2 * GPU.cublas_workspace_bytes
    assert trace.param_count == 1024 * 1024


def test_bf16_autocast_caches_one_weight_copy_and_saves_bf16_activations():
    trace = trace_workload(_linear_workload("bf16"), GPU, steps=1)
    casts = [a for a in trace.allocs if a.op == "_to_copy" and a.phase == "forward"]
    # the fp32 weight is cast once (2 MiB bf16) and the fp32 input once (0.5 MiB bf16)
    assert sorted(a.nbytes for a in casts) == [MiB // 2, 2 * MiB]
    mm = [a for a in trace.allocs if a.op == "mm" and a.phase == "forward"]
    assert mm and all(a.dtype == "bfloat16" for a in mm)


def test_fp16_autocast_traces_fp16_kernels_without_fp32_copies():
    # a traced step allocates what CUDA's fp16 kernels do; only the real CPU forward that sizes a detector's
    # outputs computes them in fp32 (CudaSemantics.half_in_fp32), whose copies must never reach a trace
    trace = trace_workload(_linear_workload("fp16"), GPU, steps=1)
    forward = [a for a in trace.allocs if a.phase == "forward"]
    casts = sorted(a.nbytes for a in forward if a.op == "_to_copy")
    assert casts == [MiB // 2, 2 * MiB]  # the weight and the input, each once, in fp16
    assert all(a.dtype == "float16" for a in forward if a.op in ("mm", "_to_copy"))


def test_dropout_keeps_a_one_byte_mask_like_cuda():
    w = _linear_workload(model=lambda: torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Dropout(0.5)))
    trace = trace_workload(w, GPU, steps=1)
    masks = [a for a in trace.allocs if a.op == "native_dropout" and a.dtype == "bool"]
    assert masks and masks[0].nbytes == 256 * 1024  # 1 byte per element, not a float noise tensor


def _forward_allocs(trace, phase: str = "forward", step: int = 0) -> list:  # noqa: ANN001
    """The allocations of one phase of one step, in the order the trace made them."""
    return [trace.allocs[k] for o, k in zip(trace.ops, trace.keys)
            if o > 0 and trace.allocs[k].phase == phase and trace.allocs[k].step == step]


def test_a_bf16_projection_allocates_in_the_order_an_h200_recorded():
    """HF T5's first query projection on an H200 (torch 2.11; entry trace c077_hf_seq2seq in
    benchmarks/results/estimate/entry_traces_h200_torch2.11_20261126.tar.gz): weight copy 294912 B, input copy
    12582912 B, output 12582912 B, then cuBLAS's 32 MiB workspace. With the workspace before the output the replay
    of that T5 step reserved 7.10 GB where the GPU reserved 8.15 GB."""
    w = _linear_workload("bf16", model=lambda: torch.nn.Linear(384, 384, bias=False),
                         batch=lambda n: (torch.randn(n, 512, 384),), batch_size=32)
    trace = trace_workload(w, gpu_spec("h200"), steps=1)
    first = [(a.op, a.nbytes) for a in _forward_allocs(trace)][:4]
    assert first == [("_to_copy", 294912), ("_to_copy", 12582912), ("mm", 12582912), ("cublas_workspace", 32 * MiB)]
    backward = [a.op for a in _forward_allocs(trace, "backward")]
    # backward's first matmul makes its output before the backward thread's workspace, as the H200 recorded
    assert backward.index("cublas_workspace") == 1 + next(i for i, op in enumerate(backward) if op == "mm")


def test_autocast_casts_the_last_argument_first():
    # linear(input, weight, bias): the bias copy, then the weight's, then the input's (GCC evaluates autocast's
    # cached_cast(...)... pack right to left)
    w = _linear_workload("bf16", model=lambda: torch.nn.Linear(1024, 512))
    trace = trace_workload(w, GPU, steps=1)
    casts = [a.shape for a in _forward_allocs(trace) if a.op == "_to_copy"]
    assert casts[:3] == [(512,), (512, 1024), (256, 1024)]


def test_dropout_allocates_its_mask_before_its_output_like_cuda():
    w = _linear_workload(model=lambda: torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Dropout(0.5)))
    trace = trace_workload(w, GPU, steps=1)
    dropout = [a.dtype for a in _forward_allocs(trace) if a.op == "native_dropout"]
    assert dropout == ["bool", "float32"]


@pytest.mark.parametrize("permuted, blocks", [(False, 1), (True, 2)])
def test_softmax_backward_takes_a_product_and_its_contiguous_copy(permuted, blocks):  # noqa: ANN001
    """SoftMax.cu: tmp = grad * output, then tmp.contiguous(). A grad laid out channels-last (a Dice loss against a
    one-hot target moved to dim 1) makes tmp channels-last too, so the kernel copies it: two blocks of the input's
    size, one after the other. The H200 ran out of memory on the second one (corpus c032_unet: 28 MiB asked with
    508.49 MiB allocated, in benchmarks/results/estimate/corpus_measurements_h200_torch2.11_20261126/)."""
    classes, size = 6, 32

    def loss(out, batch):  # noqa: ANN001, ANN202
        probs = out.float().softmax(1)
        weight = torch.ones(2, size, size, classes)
        weight = weight.movedim(-1, 1) if permuted else weight.permute(0, 3, 1, 2).contiguous()
        return (probs * weight).sum()

    w = Workload(name="softmax", model=lambda: torch.nn.Conv2d(3, classes, 1),
                 batch=lambda n: (torch.randn(n, 3, size, size),), loss=loss,
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=2)
    trace = trace_workload(w, GPU, steps=1)
    scratch = [a.nbytes for a in _forward_allocs(trace, "backward") if a.op == "_softmax_backward_data_scratch"]
    assert scratch == [2 * classes * size * size * 4] * blocks


def _attention_workload(b: int, h: int, seq: int, d: int, precision: str, key_heads: int | None = None,
                        **sdpa: Any) -> Workload:
    """One self-attention layer (a qkv projection, then scaled_dot_product_attention with ``sdpa``'s arguments);
    ``key_heads``: only the first heads of the keys and values, which then broadcast over the query's."""

    class Attn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(d * h, 3 * d * h)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(b, seq, 3, h, d).permute(2, 0, 3, 1, 4)
            if key_heads is not None:
                k, v = k[:, :key_heads], v[:, :key_heads]
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, **sdpa)

    return Workload(model=Attn, batch=lambda n: (torch.randn(n, seq, d * h),),
                    loss=lambda out, bt: out.float().mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                    batch_size=b, precision=precision)


def test_attention_never_materialises_the_score_matrix():
    b, h, seq, d = 2, 4, 512, 32
    w = _attention_workload(b, h, seq, d, "bf16", is_causal=True, dropout_p=0.1).replace(
        optimizer=lambda p: torch.optim.AdamW(p))
    trace = trace_workload(w, GPU, steps=1)
    scores_bytes = b * h * seq * seq * 2
    assert all(a.nbytes < scores_bytes for a in trace.allocs if a.category != "workspaces")



@pytest.mark.parametrize("d, precision, kernel", [
    (36, "bf16", "flash, padded"),   # MobileViT's head size: CUDA's flash pads q, k, v to 40
    (36, "fp32", "efficient"),       # fp32: no flash; the memory-efficient kernel needs 4-aligned heads, as 36 is
    (30, "fp32", "math"),            # and 30 is not: math, with the score matrix
])
def test_a_head_size_that_is_not_a_multiple_of_8_goes_where_cuda_sends_it(d, precision, kernel):  # noqa: ANN001
    b, h, seq = 2, 4, 256
    allocs = trace_workload(_attention_workload(b, h, seq, d, precision), GPU, steps=1).allocs
    scores = [a for a in allocs if a.shape[-2:] == (seq, seq)]
    padded = [a for a in allocs if a.shape == (b, h, seq, 40) and a.phase == "forward"]
    if kernel == "math":
        assert scores and not padded
    elif kernel == "flash, padded":
        assert not scores and len(padded) >= 3  # q, k and v padded to 40, kept for backward
    else:
        assert not scores and not padded


def test_a_boolean_index_backward_writes_into_its_zeros_as_cuda_does():
    # index_backward: _index_put_impl_ in place on plain tensors, index_put out of place on fake ones. One
    # buffer of the indexed logits' size in backward, not two
    def loss(out: torch.Tensor, b: Any) -> torch.Tensor:
        keep = b[1] != -100
        return torch.nn.functional.cross_entropy(out[keep], b[1][keep])

    w = Workload(model=lambda: torch.nn.Linear(64, 4096), loss=loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                 batch=lambda n: (torch.randn(n, 64), torch.where(torch.rand(n) < 0.5, torch.randint(0, 4096, (n,)),
                                                                   torch.full((n,), -100))), batch_size=512)
    trace = trace_workload(w, GPU, steps=1)
    logits_sized = [a.op for a in trace.allocs if a.phase == "backward" and a.shape == (512, 4096)]
    assert logits_sized.count("new_zeros") == 1 and "index_put" not in logits_sized


@pytest.mark.parametrize("key_heads", [4, 1])
def test_keys_whose_heads_broadcast_take_the_math_path(key_heads: int) -> None:
    # Falcon's multi-query attention hands SDPA one key head for all query heads, without enable_gqa: CUDA's fused
    # kernels need equal heads, so the math path runs and keeps the B*H*L*L scores
    b, h, seq, d = 2, 4, 512, 32
    w = _attention_workload(b, h, seq, d, "bf16", key_heads=key_heads, is_causal=True)
    trace = trace_workload(w, GPU, steps=1)
    scores_bytes = b * h * seq * seq * 2
    materialised = any(a.nbytes >= scores_bytes for a in trace.allocs if a.category != "workspaces")
    assert materialised == (key_heads != h)


def test_attention_with_a_learned_bias_takes_the_memory_efficient_kernel():
    # T5's relative-position bias is a parameter passed as attn_mask: CUDA's memory-efficient kernel returns its
    # grad (the CPU flash kernel refuses to), saving the output and a log-sum-exp padded to 32 queries
    b, h, seq, d = 2, 4, 100, 32

    class BiasedAttn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(d * h, 3 * d * h)
            self.bias = torch.nn.Parameter(torch.zeros(1, h, seq, seq))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(b, seq, 3, h, d).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)

    w = Workload(
        model=BiasedAttn, batch=lambda n: (torch.randn(n, seq, d * h),), loss=lambda out, bt: out.float().mean(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=b, precision="fp32",
    )
    trace = trace_workload(w, GPU, steps=1)
    lse = [a for a in trace.allocs if a.op == "_scaled_dot_product_efficient_attention" and len(a.shape) == 3]
    assert [a.shape for a in lse] == [(b, h, 128)]  # 100 queries padded to 128
    assert any(a.category == "grads" and a.shape == (1, h, seq, seq) for a in trace.allocs)
    # no score matrix; the one block of that size is the bias's grad at its expanded shape, keys padded to 16,
    # which the backward kernel writes before autograd sums it over the batch
    scores_bytes = b * h * seq * seq * 4
    big = [(a.op, a.shape, a.nbytes) for a in trace.allocs if a.nbytes >= scores_bytes and a.category != "workspaces"]
    assert big == [("_scaled_dot_product_efficient_attention_backward", (b, h, seq, seq), b * h * seq * 112 * 4)]


def test_a_deep_copied_module_allocates_no_view_of_its_parameters():
    # copy.deepcopy of a fake parameter copied its fake mode too (nn.TransformerEncoder clones its layer): the copy
    # was converted again on every op, and each `weight.t()` counted a weight-sized block
    import copy

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = torch.nn.Linear(64, 64)
            self.layers = torch.nn.ModuleList(copy.deepcopy(layer) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    w = Workload(model=Stack, batch=lambda n: (torch.randn(n, 64),), loss=lambda out, bt: out.sum(),
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=4)
    trace = trace_workload(w, GPU, steps=1)
    forward = [(a.op, a.nbytes) for a in trace.allocs if a.phase == "forward" and a.category != "workspaces"]
    assert forward == [("addmm", 4 * 64 * 4)] * 3  # the three outputs, no weight-sized view


@pytest.mark.parametrize(("precision", "kernel", "copies"), [
    ("fp32", "_scaled_dot_product_efficient_attention", 1),
    ("bf16", "_scaled_dot_product_flash_attention_for_cpu", 0),
])
def test_multihead_attention_lays_out_the_output_as_cuda_does(precision, kernel, copies):  # noqa: ANN001
    # fp32: CUDA runs the memory-efficient kernel, whose output is (B, L, H, D) in memory whatever the query's
    # layout, so nn.MultiheadAttention's permute(2, 0, 1, 3).contiguous() copies it (the copy is kept for
    # out_proj's backward); in half precision the flash kernel's output follows the query, and no copy is made
    b, seq, dim, heads = 2, 16, 64, 4
    w = Workload(
        model=lambda: torch.nn.TransformerEncoderLayer(dim, heads, 128, dropout=0.0, batch_first=True),
        batch=lambda n: (torch.randn(n, seq, dim),), loss=lambda out, bt: out.float().sum(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=b, precision=precision,
    )
    trace = trace_workload(w, GPU, steps=1)
    forward = [a for a in trace.allocs if a.phase == "forward"]
    assert any(a.op == kernel for a in forward)
    itemsize = 4 if precision == "fp32" else 2
    output_copies = [a for a in forward if a.op == "clone" and a.shape == (seq, b, heads, dim // heads)]
    assert len(output_copies) == copies and all(a.nbytes == b * seq * dim * itemsize for a in output_copies)


def test_flash_attention_gradients_keep_their_inputs_layout_so_no_copy_follows():
    # CUDA's flash backward allocates each gradient like its input (empty_like): nn.MultiheadAttention's q, k, v are
    # views of (L, B*H, D), and their gradients go back through those views without a copy. The CPU kernel's
    # gradients are (B, L, H, D)-contiguous, which had the views' backward copy each of them twice (8 MiB blocks an
    # H100's stream of the zoo's nn.Transformer lacks: zoo_traces_h100_torch2.11_20261127.tar.gz)
    b, seq, dim, heads = 2, 16, 64, 4
    w = Workload(
        model=lambda: torch.nn.TransformerEncoderLayer(dim, heads, 128, dropout=0.0, batch_first=True),
        batch=lambda n: (torch.randn(n, seq, dim),), loss=lambda out, bt: out.float().sum(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=b, precision="bf16",
    )
    trace = trace_workload(w, GPU, steps=1)
    backward = [a for a in trace.allocs if a.phase == "backward"]
    assert sum(a.op == "_scaled_dot_product_flash_attention_for_cpu_backward" for a in backward) == 3
    d = dim // heads
    assert not [a for a in backward if a.op == "clone" and a.shape in ((b, heads, seq, d), (seq, b * heads, d))]


def test_grouped_query_attention_saves_the_keys_unexpanded_and_expands_their_gradients():
    # CUDA's flash kernel takes grouped keys (enable_gqa) as they are: forward keeps k and v of 2 heads, not 8; its
    # backward computes the key and value gradients for all 8 query heads and sums each group (flash_api.cpp
    # mha_bwd). Expanding k and v in forward kept (groups - 1) x them per layer more than CUDA: the zoo's Mixtral
    # 0.3 % over in peak allocated against its H100 stream, exact with this
    b, hq, hk, seq, d = 2, 8, 2, 64, 32

    class Grouped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = torch.nn.Linear(128, hq * d)
            self.kv = torch.nn.Linear(128, 2 * hk * d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.q(x).view(b, seq, hq, d).transpose(1, 2)
            k, v = self.kv(x).view(b, seq, 2, hk, d).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    w = Workload(model=Grouped, batch=lambda n: (torch.randn(n, seq, 128),), loss=lambda out, bt: out.float().sum(),
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=b, precision="bf16")
    trace = trace_workload(w, GPU, steps=1)
    expanded, grouped = (b, hq, seq, d), (b, hk, seq, d)
    forward = [a for a in trace.allocs if a.phase == "forward"]
    assert not [a for a in forward if a.shape == expanded and a.op != "_scaled_dot_product_flash_attention_for_cpu"]
    backward = [(a.op, a.shape) for a in trace.allocs if a.phase == "backward"]
    kernel = "_scaled_dot_product_flash_attention_for_cpu_backward"
    assert backward.count((kernel, expanded)) == 3  # dq and the expanded key and value gradients
    assert backward.count(("sum", grouped)) == 2


_FUSED_KERNELS = ("ScaledDotProductFlashAttention", "ScaledDotProductCudnnAttention")
"""Half-precision attention without a mask: flash, or cuDNN's (chosen first on an H100 with torch 2.11)."""


@pytest.mark.gpu
def test_cuda_runs_the_math_path_on_keys_whose_heads_broadcast():
    # what the trace assumes for Falcon's multi-query attention (cuda_emulation._cuda_sdpa): one key head for four
    # query heads, without enable_gqa, is no fused kernel's input
    q = torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 1, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not out.grad_fn.name().startswith((*_FUSED_KERNELS, "ScaledDotProductEfficientAttention")), \
        out.grad_fn.name()


@pytest.mark.gpu
def test_cuda_runs_a_fused_kernel_on_grouped_keys_without_expanding_them():
    # what the trace's grouped-query attention assumes (cuda_emulation._GroupedFlash): a fused kernel (cuDNN's on an
    # H100 with torch 2.11, flash elsewhere), fed the key and value heads as they are
    q = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.grad_fn.name().startswith(_FUSED_KERNELS), out.grad_fn.name()
    assert [fn.variable.shape if fn is not None and hasattr(fn, "variable") else None
            for fn, _ in out.grad_fn.next_functions][:3] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("permuted", [False, True])
def test_a_softmax_over_a_permuted_input_copies_it_after_its_output(permuted):  # noqa: ANN001
    # SoftMax.cu's host_softmax makes input.contiguous() after the structured kernel allocated the output: cross-
    # entropy over (B, V, L) logits, laid out (B, L, V), takes a logits-sized block per step (606 MB in the zoo's
    # nn.Transformer on an H100, whose peak reserved memfit then matched to the byte)
    vocab, seq = 96, 40

    def forward(m, bt):  # noqa: ANN001, ANN202
        out = m(bt[0])  # (B, L, V)
        return out.transpose(1, 2) if permuted else out.transpose(1, 2).contiguous()

    w = Workload(model=lambda: torch.nn.Linear(32, vocab), batch=lambda n: (torch.randn(n, seq, 32),
                 torch.randint(0, vocab, (n, seq))), forward=forward,
                 loss=lambda out, bt: torch.nn.functional.cross_entropy(out, bt[1]),
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=4)
    trace = trace_workload(w, GPU, steps=1)
    loss = [(a.op, a.nbytes) for a in trace.allocs if a.phase == "loss"]
    logits = 4 * seq * vocab * 4
    assert loss[0] == ("_log_softmax", logits)
    assert (("_log_softmax_scratch", logits) in loss) == permuted


def test_a_bias_with_a_strided_last_dimension_takes_the_math_path():
    # CUDA's fused kernels refuse a mask whose last dimension is not contiguous (the CPU's accept it): Hugging Face
    # T5 5.17 passes its position bias as a permuted view, and the H200 ran the math path, probabilities and all
    b, h, seq, d = 2, 4, 96, 32

    class PermutedBias(torch.nn.Module):
        def __init__(self, permuted: bool) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(d * h, 3 * d * h)
            self.permuted = permuted
            self.table = torch.nn.Parameter(torch.zeros(seq, seq, h))  # (query, key, head), as T5 computes it

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(b, seq, 3, h, d).permute(2, 0, 3, 1, 4)
            bias = self.table.permute(2, 0, 1).unsqueeze(0)  # (1, h, q, k) with stride h along the keys
            bias = bias if self.permuted else bias.contiguous()
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    def scores(permuted: bool) -> list[str]:
        w = Workload(
            model=lambda: PermutedBias(permuted), batch=lambda n: (torch.randn(n, seq, d * h),),
            loss=lambda out, bt: out.float().mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            batch_size=b, precision="fp32",
        )
        trace = trace_workload(w, GPU, steps=1)
        return [a.op for a in trace.allocs if a.shape == (b, h, seq, seq) and a.phase == "forward"]

    assert scores(permuted=False) == []  # the memory-efficient kernel: no B*H*L*L tensor in forward
    assert len(scores(permuted=True)) >= 2  # the math path: the scores and their softmax


@pytest.mark.parametrize("precision, masked, math", [("fp32", False, True), ("bf16", True, True), ("bf16", False, False)])
def test_grouped_keys_take_the_math_path_unless_flash_can(precision, masked, math):  # noqa: ANN001
    # the memory-efficient kernel takes no grouped keys (enable_gqa): fp32 or a mask sends CUDA to the math path,
    # as it did Qwen2-MoE in fp32 on the H200 (corpus c057, c058); flash takes fp16/bf16 without a mask
    b, h, kv, seq, d = 2, 8, 2, 64, 32

    class Gqa(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = torch.nn.Linear(h * d, h * d)
            self.kv = torch.nn.Linear(h * d, 2 * kv * d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.q(x).view(b, seq, h, d).transpose(1, 2)
            k, v = self.kv(x).view(b, seq, 2, kv, d).permute(2, 0, 3, 1, 4)
            mask = torch.ones(seq, seq, dtype=torch.bool).tril() if masked else None
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    w = Workload(model=Gqa, batch=lambda n: (torch.randn(n, seq, h * d),), loss=lambda out, bt: out.float().mean(),
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=b, precision=precision)
    trace = trace_workload(w, GPU, steps=1)
    scores = [a for a in trace.allocs if a.shape == (b, h, seq, seq) and a.phase == "forward"]
    assert bool(scores) is math


def test_libraries_see_no_tracer_inside_and_the_same_function_after(monkeypatch):  # noqa: ANN001
    import sys
    import types

    from memfit.estimate.library_paths import RealRunPaths

    def original(x: object) -> bool:
        return True

    hf = types.ModuleType("transformers.utils.import_utils")
    hf.is_fake_tensor = original  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers.utils.import_utils", hf)
    with RealRunPaths():
        assert hf.is_fake_tensor(torch.zeros(1)) is False  # type: ignore[attr-defined]
    assert hf.is_fake_tensor is original  # type: ignore[attr-defined]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_runs_the_memory_efficient_kernel_for_a_learned_bias(dtype):  # noqa: ANN001
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, list]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
            out = func(*args, **(kwargs or {}))
            flat = out if isinstance(out, (tuple, list)) else (out,)
            self.seen.append((func.__name__, [tuple(t.shape) for t in flat if isinstance(t, torch.Tensor)]))
            return out

    q, k, v = (torch.randn(2, 4, 100, 32, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    bias = torch.zeros(1, 4, 100, 100, device="cuda", dtype=dtype, requires_grad=True)
    with Ops() as ops:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias).float().sum().backward()
    names = [name for name, _ in ops.seen]
    assert "_scaled_dot_product_efficient_attention.default" in names
    assert "_scaled_dot_product_efficient_attention_backward.default" in names
    shapes = dict(ops.seen)["_scaled_dot_product_efficient_attention.default"]
    assert shapes[:2] == [(2, 4, 100, 32), (2, 4, 128)]  # the output and the padded log-sum-exp memfit predicts


@pytest.mark.gpu
def test_cuda_lays_out_fp32_attention_output_by_batch_then_sequence():
    # what the trace's fp32 attention assumes: the memory-efficient kernel, an output (B, L, H, D) in memory even
    # for nn.MultiheadAttention's (L, B*H, D)-shaped query
    seq, b, h, d = 64, 2, 4, 32
    q, k, v = (torch.randn(seq, b * h, d, device="cuda", requires_grad=True).view(seq, b, h, d).permute(1, 2, 0, 3)
               for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert out.grad_fn.name().startswith("ScaledDotProductEfficientAttention")
    assert out.transpose(1, 2).is_contiguous() and not out.permute(2, 0, 1, 3).is_contiguous()

@pytest.mark.gpu
def test_cuda_runs_flash_on_padded_heads_that_are_not_a_multiple_of_8():
    # what the trace's half-precision attention with heads of 36 assumes (cuda_emulation._cuda_sdpa): CUDA's flash
    # kernel on q, k, v padded to 40, the output sliced back; not the math path
    q, k, v = (torch.randn(2, 4, 256, 36, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert out.shape == (2, 4, 256, 36)
    names = []
    node = out.grad_fn
    while node is not None and len(names) < 4:  # the slice's backward, then the flash kernel's
        names.append(node.name())
        node = node.next_functions[0][0] if node.next_functions else None
    assert any(n.startswith("ScaledDotProductFlashAttention") for n in names), names


@pytest.mark.gpu
def test_cuda_fused_attention_gradients_have_their_inputs_strides():
    # what the trace's half-precision attention assumes (kernel_scratch.cuda_attention_grads): CUDA's fused backward (flash,
    # or cuDNN's) returns each gradient with its input's strides, here nn.MultiheadAttention's (L, B*H, D) views
    seq, b, h, d = 64, 2, 4, 32
    base = [torch.randn(seq, b * h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    q, k, v = (t.view(seq, b, h, d).permute(1, 2, 0, 3) for t in base)
    grads: dict[str, torch.Tensor] = {}
    for name, t in zip("qkv", (q, k, v)):
        t.register_hook(lambda g, name=name: grads.__setitem__(name, g))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert out.grad_fn.name().startswith(_FUSED_KERNELS), out.grad_fn.name()
    out.float().sum().backward()
    assert {name: g.stride() for name, g in grads.items()} == {name: t.stride() for name, t in zip("qkv", (q, k, v))}


@pytest.mark.gpu
@pytest.mark.parametrize(("head", "queries"), [(8, 63), (64, 192), (72, 100)])
def test_cuda_fp32_efficient_attention_backward_takes_what_the_trace_charges(head: int, queries: int):
    # what the trace's fp32 attention backward assumes (workspaces.efficient_attention_backward_fp32_bytes): beyond
    # the three gradients, the larger of the query-sized product with two deltas and a delta with the grad-query tiles
    from memfit.estimate.workspaces import efficient_attention_backward_fp32_bytes

    b, h = 64, 16
    q, k, v = (torch.randn(b, h, queries, head, device="cuda") for _ in range(3))
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)
    grad = torch.randn(b, queries, h, head, device="cuda").transpose(1, 2)  # dense as (B, L, H, D): no copy
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False])
    torch.cuda.synchronize()
    q_bytes = q.numel() * 4
    assert sum(g.numel() * 4 for g in grads[:3]) == 3 * q_bytes
    rounded = -(-efficient_attention_backward_fp32_bytes(b, h, queries, head) // 512) * 512
    assert torch.cuda.max_memory_allocated() - before == 3 * q_bytes + rounded


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "weights", "cudnn"), [(torch.float32, torch.float32, True),
                                                         (torch.float16, torch.float32, True),
                                                         (torch.bfloat16, torch.bfloat16, False)])
def test_cuda_batch_norm_of_a_transposed_view_copies_it_where_cudnn_runs(dtype, weights, cudnn):  # noqa: ANN001
    # what the trace's batch norm assumes (cuda_emulation._cuda_batch_norm): cuDNN's runs on a contiguous copy of
    # the input, which autograd keeps, and gives a contiguous output; the native kernel (bf16) keeps the strides
    bn = torch.nn.BatchNorm1d(128).to("cuda", weights)
    x = torch.randn(512, 63, 128, device="cuda", dtype=dtype, requires_grad=True).transpose(1, 2)
    nbytes = x.numel() * x.element_size()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = bn(x)
    torch.cuda.synchronize()
    assert y.is_contiguous() == cudnn
    assert torch.cuda.memory_allocated() - before >= (2 if cudnn else 1) * nbytes
    assert torch.cuda.memory_allocated() - before < (2 if cudnn else 1) * nbytes + (1 << 20)


@pytest.mark.gpu
def test_cuda_log_sigmoid_keeps_an_empty_buffer():
    # what the trace's log_sigmoid assumes (kernel_scratch.cuda_log_sigmoid_outputs): the result alone
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out, buffer = torch.ops.aten.log_sigmoid_forward(x)
    torch.cuda.synchronize()
    assert buffer.numel() == 0 and torch.cuda.memory_allocated() - before == out.numel() * out.element_size()


@pytest.mark.gpu
def test_cuda_log_softmax_of_a_permuted_input_takes_a_copy_after_its_output():
    # what the trace's softmax assumes (kernel_scratch.kernel_transients): host_softmax's input.contiguous() after the output
    x = torch.randn(8, 512, 1000, device="cuda", dtype=torch.float16).transpose(1, 2)  # (B, V, L) laid out (B, L, V)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = torch.log_softmax(x, dim=1)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before == out.numel() * out.element_size()
    assert torch.cuda.max_memory_allocated() - before == 2 * out.numel() * out.element_size()


def test_checkpointing_recomputes_in_backward():
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):
        def __init__(self, ckpt: bool) -> None:
            super().__init__()
            self.ckpt = ckpt
            self.block = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.block, x, use_reentrant=False) if self.ckpt else self.block(x)

    def forward_bytes(ckpt: bool) -> int:
        """Activation bytes still alive when backward starts: what forward saved."""
        trace = trace_workload(_linear_workload(model=lambda: Net(ckpt)), GPU, steps=1)
        start = next(at for at, name, _ in trace.phase_marks if name == "backward")
        live = _live(trace, start)
        return sum(size for key, size in live.items() if trace.allocs[key].category == "activations")

    def recomputed(ckpt: bool) -> int:
        trace = trace_workload(_linear_workload(model=lambda: Net(ckpt)), GPU, steps=1)
        return sum(1 for a in trace.allocs if a.phase == "backward" and a.category == "activations")

    assert forward_bytes(True) < forward_bytes(False)
    assert recomputed(True) > 0 and recomputed(False) == 0


def test_item_in_forward_is_survived_with_a_warning():
    class Weird(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scale = x.abs().max().item()  # data-dependent
            return super().forward(x) * (1.0 + 0 * scale)

    trace = trace_workload(_linear_workload(model=lambda: Weird(1024, 1024)), GPU, steps=1)
    assert any(".item()" in w for w in trace.warnings)


class _Branching(torch.nn.Module):
    """A forward that runs a 16 MiB-wide branch or a 1 MiB one, as ``decide(x, h)`` says (x the input, h the first
    layer's output: the model's values)."""

    def __init__(self, decide) -> None:  # noqa: ANN001
        super().__init__()
        self.first = torch.nn.Linear(1024, 1024, bias=False)
        self.wide = torch.nn.Linear(1024, 16 * 1024, bias=False)
        self.narrow = torch.nn.Linear(1024, 1024, bias=False)
        self.decide = decide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        return self.wide(h)[:, :1024] if self.decide(x, h) else self.narrow(h)


def _branch_taken(decide) -> tuple[str, dict[str, str]]:  # noqa: ANN001
    trace = trace_workload(_linear_workload(model=lambda: _Branching(decide)), GPU, steps=2)
    wide = 256 * 16 * 1024 * 4  # the wide layer's output, fp32
    taken = {a.nbytes for a in trace.allocs if a.phase == "forward" and a.op == "mm"}
    assert wide in taken or 256 * 1024 * 4 in taken
    return ("wide" if wide in taken else "narrow"), dict(trace.uncertain)


def test_a_condition_on_the_batch_takes_the_branch_its_values_take():
    # `if x.abs().sum() > 0:` is true for real data; zeros (what a fake tensor would read) take the other branch
    taken, uncertain = _branch_taken(lambda x, h: x.abs().sum() > 0)
    assert taken == "wide"
    assert "value_branch" in uncertain  # named, and the bound stays wider: other data may branch otherwise
    taken, _ = _branch_taken(lambda x, h: x.abs().sum() < 0)  # never true: the same values take the narrow one
    assert taken == "narrow"


def test_a_condition_on_the_models_values_takes_the_branch_a_real_forward_takes():
    # the first layer's output: its values come from the weights, so one real CPU forward decides, in every step
    taken, uncertain = _branch_taken(lambda x, h: h.abs().mean() > 0)
    assert taken == "wide" and "value_branch" in uncertain
    assert _branch_taken(lambda x, h: h.abs().mean() > 1e9)[0] == "narrow"


def test_a_value_read_once_and_cached_does_not_misalign_the_real_forward_in_later_steps():
    # torchvision's MultiScaleRoIAlign reads its scales (floats) in the first forward only: the real forward
    # (step 1) has those reads, step 2 of the trace does not. Sizes and conditions must still line up there
    class Cached(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.Linear(1024, 1024, bias=False)
            self.scale: float | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.first(x)
            if self.scale is None:
                self.scale = float(torch.tensor(0.3).log2().round())  # a read, in the first forward only
            picked = h[(h[:, 0] > 0).nonzero().squeeze(1)]  # rows picked by the model's values
            return picked.sum() if bool(h.abs().mean() > 0) else h.sum()

    trace = trace_workload(_linear_workload(model=Cached), GPU, steps=3)
    assert "one real CPU forward" in trace.uncertain["data_dependent_shape"]  # not every step run for real


def test_a_condition_on_a_large_models_values_is_taken_as_false_without_building_it(monkeypatch):
    # the real forward builds the model in host memory: beyond the limit a condition alone is not worth it
    import importlib

    trace_module = importlib.import_module("memfit.estimate.trace")  # memfit.estimate is also a function's name
    monkeypatch.setattr(trace_module, "CONDITION_REAL_FORWARD_MAX_PARAM_BYTES", 4 * 1024 * 1024)  # under 4 MiB
    taken, uncertain = _branch_taken(lambda x, h: h.abs().mean() > 0)  # 4 + 64 + 4 MiB of weights
    assert taken == "narrow" and "taken as False" in uncertain["value_branch"]
    taken, _ = _branch_taken(lambda x, h: x.abs().sum() > 0)  # the batch's values still decide their conditions
    assert taken == "wide"


def test_a_condition_on_a_random_draw_is_taken_as_skipping_nothing():
    # LayerDrop (wav2vec2's encoder): `if torch.rand([]) < p: skip`. Each step draws again, so no one run decides;
    # False runs the wide branch, the largest step. A real forward's draw would skip it a tenth of the time
    taken, uncertain = _branch_taken(lambda x, h: not bool(torch.rand([]) < 0.9))
    assert taken == "wide"
    assert "random draw" in uncertain["layer_drop"] and "value_branch" not in uncertain  # named, not widened
    from memfit.estimate.bound import upper_bound

    assert upper_bound(10 << 30, uncertain)[0] == upper_bound(10 << 30, {})[0]
    # said in a warning too, once, even where another condition named the bound's reason first (HuBERT's label check)
    first_named = _linear_workload(model=lambda: _Branching(
        lambda x, h: bool(x.abs().sum() > 0) and not bool(torch.rand([]) < 0.9)))
    trace = trace_workload(first_named, GPU, steps=2)
    assert "random draw" not in trace.uncertain["value_branch"] and "layer_drop" in trace.uncertain
    assert [w for w in trace.warnings if "LayerDrop" in w and "skipping nothing" in w] != []
    assert len([w for w in trace.warnings if "random draw" in w]) == 1
    taken, _ = _branch_taken(lambda x, h: not bool(torch.rand([], device=x.device) * 0 + h.abs().mean() < 1e9))
    assert taken == "wide"  # a draw mixed with the model's values is still a draw


class _Checking(torch.nn.Module):
    """Checks its input's values the way Hugging Face's CTC heads check labels, then maybe branches for real."""

    def __init__(self, branch: bool) -> None:
        super().__init__()
        self.first = torch.nn.Linear(1024, 1024, bias=False)
        self.wide = torch.nn.Linear(1024, 16 * 1024, bias=False)
        self.branch = branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.abs() > 1e6).any():
            raise ValueError("inputs out of range")
        h = self.first(x)
        if self.branch:
            if h.abs().mean() > 0:
                h = self.wide(h)[:, :1024]
        return h


def test_a_condition_that_only_checks_the_values_is_named_without_widening_the_bound():
    from memfit.estimate.bound import upper_bound

    trace = trace_workload(_linear_workload(model=lambda: _Checking(branch=False)), GPU, steps=2)
    assert "value_check" in trace.uncertain and "value_branch" not in trace.uncertain
    check_line = _Checking.forward.__code__.co_firstlineno + 1
    assert list(trace.condition_sites) == [f"test_trace.py:{check_line} in forward"]
    assert upper_bound(10 << 30, trace.uncertain)[0] == upper_bound(10 << 30, {})[0]
    # a real branch beside the check: the bound widens, and names the branch, not the check
    trace = trace_workload(_linear_workload(model=lambda: _Checking(branch=True)), GPU, steps=2)
    line = _Checking.forward.__code__.co_firstlineno + 5
    assert f"test_trace.py:{line} in forward" in trace.uncertain["value_branch"]
    assert upper_bound(10 << 30, trace.uncertain)[0] > upper_bound(10 << 30, {})[0]


class _Guarded(torch.nn.Module):
    """Clamps overflowed activations the way DETR's encoder layers do, with a layer instead of a clamp."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(1024, 1024, bias=False)
        self.wide = torch.nn.Linear(1024, 16 * 1024, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if not torch.isfinite(h).all():
            h = self.wide(h)[:, :1024]
        return h


def test_a_finiteness_guard_is_a_check_only_where_real_values_answered_it(monkeypatch):
    import importlib

    trace = trace_workload(_linear_workload(model=_Guarded), GPU, steps=2)  # one real forward: finite values
    assert "value_check" in trace.uncertain and "value_branch" not in trace.uncertain
    assert not any(a.nbytes == 256 * 16 * 1024 * 4 for a in trace.allocs)  # the healthy branch: no wide layer
    # a large model's conditions are taken as False without values: here that is the overflowed branch
    trace_module = importlib.import_module("memfit.estimate.trace")
    monkeypatch.setattr(trace_module, "CONDITION_REAL_FORWARD_MAX_PARAM_BYTES", 4 * 1024 * 1024)
    trace = trace_workload(_linear_workload(model=_Guarded), GPU, steps=2)
    assert "value_branch" in trace.uncertain and "value_check" not in trace.uncertain


def test_a_condition_on_dropped_out_activations_is_on_the_models_values():
    # dropout scales its input: DETR's matcher checks `(boxes[:, 2:] >= boxes[:, :2]).all()` of predictions that
    # went through dropout. The real forward decides it, not the rule for draws (False would raise there)
    taken, uncertain = _branch_taken(lambda x, h: torch.nn.functional.dropout(h, 0.1).abs().mean() > 0)
    assert taken == "wide" and "random draw" not in uncertain["value_branch"]


def test_a_condition_on_noise_over_the_models_values_is_on_the_models_values():
    # RT-DETR jitters its denoising queries' boxes with noise of their size and checks every predicted box with
    # `.all()`: many elements drawn, not LayerDrop's one. The real forward decides it (False raised there)
    taken, uncertain = _branch_taken(lambda x, h: bool((h.sigmoid() + 0.01 * torch.rand_like(h) >= 0).all()))
    assert taken == "wide" and "random draw" not in uncertain["value_branch"]


class _ConvertsInForward(torch.nn.Module):
    """Casts a layer to its own dtype in forward, as Switch Transformers' router does (``self.classifier.to(...)``)."""

    def __init__(self, convert: bool) -> None:
        super().__init__()
        self.first, self.last = torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)
        self.convert = convert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.convert:
            self.last = self.last.to(torch.float32)
        return self.last(self.first(x))


def test_a_module_converted_in_forward_traces_as_on_cuda():
    # torch swaps a fake parameter for its converted copy, which fails once the fake mode holds a weak reference
    # to it; on CUDA the parameter keeps its identity (and memfit's hooks on it)
    plain, converting = (trace_workload(_linear_workload(model=lambda c=c: _ConvertsInForward(c)), GPU, steps=2)
                         for c in (False, True))
    def allocations(trace):  # noqa: ANN001, ANN202
        return sorted((a.phase, a.category, a.nbytes) for a in trace.allocs)

    assert allocations(converting) == allocations(plain)
    assert sum(a.nbytes for a in converting.allocs if a.category == "grads") == 2 * 2 * (1024 * 1024 + 1024) * 4


class _CachesByShape(torch.nn.Module):
    """Caches a tensor per shape in a method cache shared by every instance, as Hugging Face's RT-DETR caches its
    position embeddings (``compile_compatible_method_lru_cache``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(1024, 1024)

    @staticmethod
    @functools.lru_cache(maxsize=4)
    def table(rows: int, cols: int) -> torch.Tensor:
        return torch.ones(rows, cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.table(*x.shape)


def test_a_method_cache_does_not_keep_what_a_trace_computed():
    # a fake tensor the trace cached would come back to the next trace (the real forward) and to the caller's run
    trace_workload(_linear_workload(model=_CachesByShape), GPU, steps=2)
    assert _CachesByShape.table.cache_info().currsize == 0
    assert type(_CachesByShape.table(256, 1024)) is torch.Tensor


class _Routed(torch.nn.Module):
    """Picks an expert by a number its router computes and names it in an f-string, as Switch Transformers does
    (``self[f"expert_{index}"]``); the router always picks expert 2 (its bias). A
    mask of the model's values (``nonzero``) sends the step to a real forward."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(1024, 4)
        self.experts = torch.nn.ModuleDict({f"expert_{i}": torch.nn.Linear(1024, 256 * (i + 1)) for i in range(4)})
        with torch.no_grad():  # its weights random (no value known to the trace), its bias far larger
            self.router.bias.copy_(torch.tensor([0.0, 0.0, 100.0, 0.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = x[(self.router(x)[:, 2] > 0).nonzero().squeeze(1)]
        index = self.router(kept).mean(0).argmax()
        return self.experts[f"expert_{index}"](kept)


def test_a_number_read_from_the_models_values_is_what_the_real_forward_read_there():
    trace = trace_workload(_linear_workload(model=_Routed), GPU, steps=2)
    grads = [a.nbytes for a in trace.allocs if a.category == "grads" and a.step == 0]
    assert 1024 * 768 * 4 in grads and 1024 * 256 * 4 not in grads  # expert 2's weight's, not expert 0's
    assert "one real CPU forward" in trace.uncertain["data_dependent_shape"]


class _MultiScale(torch.nn.Module):
    """Resizes each batch to a scale drawn in forward, as torchvision's detection transform does in training, then
    keeps the pixels its own values pick (a size only a real forward knows)."""

    SCALES = (32, 64, 128)

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = self.SCALES[int(torch.empty(1).uniform_(0.0, float(len(self.SCALES))).item())]
        h = self.conv(torch.nn.functional.interpolate(x, size=(side, side)))
        return h.flatten(1)[h.flatten(1)[:, :1].squeeze(1) > 0]


def test_a_number_drawn_in_forward_is_taken_at_its_largest_by_the_real_forward_and_the_trace():
    w = Workload(model=_MultiScale, batch=lambda n: (torch.randn(n, 3, 32, 32),), batch_size=16,
                 loss=lambda out, b: out.square().mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    trace = trace_workload(w, GPU)
    sides = {a.shape[-1] for a in trace.allocs if a.op == "convolution" and a.phase == "forward"}
    assert sides == {128}
    assert "largest" in trace.uncertain["value_read"]
    # the real forward read the same scale: its sizes lined up, so not every step ran for real
    assert "one real CPU forward" in trace.uncertain["data_dependent_shape"]


def test_a_draw_over_one_choice_is_exact():
    # torchvision's default detectors have one min_size: int() of a draw in [0, 1) is 0 whatever is drawn
    class OneScale(_MultiScale):
        SCALES = (64,)

    w = Workload(model=OneScale, batch=lambda n: (torch.randn(n, 3, 32, 32),), batch_size=16,
                 loss=lambda out, b: out.square().mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    trace = trace_workload(w, GPU)
    assert {a.shape[-1] for a in trace.allocs if a.op == "convolution" and a.phase == "forward"} == {64}
    assert "value_read" not in trace.uncertain


def test_a_constructor_that_sizes_layers_by_tensor_values_is_built_for_real():
    # timm's RegNet computes its stage widths with torch.unique in __init__: fake tensors have no values, so the
    # model is built for real and traced with fake copies of its parameters
    class Sized(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # 256, 512, 768, from a tensor whose values the trace does not follow (random numbers times 0)
            widths = torch.rand(8) * 0 + torch.arange(8) // 3 * 256 + 256
            width = int(torch.unique(widths).numel()) * 256
            self.a = torch.nn.Linear(1024, width)
            self.norm = torch.nn.BatchNorm1d(width)
            self.b = torch.nn.Linear(width, 1024)
            self.b.weight = torch.nn.Parameter(self.a.weight.t().contiguous().clone())  # sized by values too

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.norm(self.a(x)))

    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.norm, self.b = torch.nn.Linear(1024, 768), torch.nn.BatchNorm1d(768), torch.nn.Linear(768, 1024)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.norm(self.a(x)))

    built = trace_workload(_linear_workload(model=Sized), GPU, steps=2)
    plain = trace_workload(_linear_workload(model=Plain), GPU, steps=2)
    assert any("built it for real" in w for w in built.warnings)
    assert built.param_count == plain.param_count
    after_init = [(a.nbytes, a.op, a.category) for a in built.allocs if a.phase != "init"]
    assert after_init == [(a.nbytes, a.op, a.category) for a in plain.allocs if a.phase != "init"]
    params = sorted(a.nbytes for a in built.allocs if a.category in ("params", "buffers"))
    assert params == sorted(a.nbytes for a in plain.allocs if a.category in ("params", "buffers"))


def test_a_constructor_that_sizes_layers_by_values_made_from_constants_is_traced_with_them():
    # torchvision's RegNet and timm's drop-path rates: arange/linspace arithmetic, read back with .tolist()
    class Widths(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            widths = (torch.arange(3) * 256 + 256).tolist()  # [256, 512, 768]
            width = int(torch.unique(torch.tensor(widths)).numel()) * widths[0]
            self.a, self.b = torch.nn.Linear(1024, width), torch.nn.Linear(width, 1024)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            dims = torch.arange(1, x.dim()).tolist()  # MonAI's Dice reduction axes: [1]
            return self.b(self.a(x)) * x.mean(dims, keepdim=True)

    traced = trace_workload(_linear_workload(model=Widths), GPU, steps=2)
    assert traced.param_count == (1024 * 768 + 768) + (768 * 1024 + 1024)
    assert not traced.warnings and "value_read" not in traced.uncertain


def _width_table(write: Callable[[torch.Tensor], None]) -> type[torch.nn.Module]:
    """A model whose hidden width is read from a table the constructor fills by indexing (``table[1] = 300``)."""

    class Table(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            table = torch.zeros(4, dtype=torch.long)
            write(table)
            width = int(table[1].item()) + int(table[2])
            self.a, self.b = torch.nn.Linear(1024, width), torch.nn.Linear(width, 1024)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    return Table


def _write_known(table: torch.Tensor) -> None:
    table[1] = 300  # a select and a copy_ into it: the write must reach the table
    table[torch.tensor(2)] = 12  # an index_put_


def test_values_written_into_a_known_tensor_through_indexing_are_read_back():
    traced = trace_workload(_linear_workload(model=_width_table(_write_known)), GPU, steps=2)
    assert traced.param_count == (1024 * 312 + 312) + (312 * 1024 + 1024)
    assert not traced.warnings and "value_read" not in traced.uncertain


def test_a_whole_overwrite_of_an_unknown_tensor_forgets_the_views_known_before_it():
    # table[1]'s view is known (300) while table is not; table.fill_(7) then writes all of table into fresh memory,
    # so the view's 300 is stale: reading it must be said, never read back silently as 300
    class Stale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            table = torch.empty(4, dtype=torch.long)
            second = table[1]
            second.fill_(300)
            table.fill_(7)
            self.a = torch.nn.Linear(1024, 8 + int(second))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x)

    traced = trace_workload(_linear_workload(model=Stale), GPU, steps=2)
    assert traced.param_count != 1024 * 308 + 308
    assert "value_read" in traced.uncertain


def _write_unknown(table: torch.Tensor) -> None:
    table[1] = 300
    table[0] = torch.randint(1, 9, ())  # a value the trace does not follow, written beside the known ones


def test_a_write_of_an_unknown_value_makes_the_views_beside_it_unknown_and_says_so():
    # the views of the written storage must not keep their old values: reading table[1] after table[0] was written
    # with a random draw is a read of a value the trace does not have, said as such, not a silent stale 300
    traced = trace_workload(_linear_workload(model=_width_table(_write_unknown)), GPU, steps=2)
    assert "value_read" in traced.uncertain and traced.warnings


def test_copied_steps_equal_traced_steps():
    from memfit.estimate.allocator import replay, smallest_fitting_capacity
    from memfit.estimate.trace import _trace
    from memfit.workload.zoo import builtin_workload

    w = builtin_workload("mlp").replace(batch_size=64)
    full, fast = _trace(w, GPU, steps=3), trace_workload(w, GPU, steps=3)
    assert len(full.ops) == len(fast.ops)
    a, b = replay(full.events()), replay(fast.events())
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes) == (b.peak_allocated_bytes, b.peak_reserved_bytes)
    assert smallest_fitting_capacity(full.events()) == smallest_fitting_capacity(fast.events())


def _traced_without_replay(w: Workload, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN202
    from memfit.estimate import step_copies

    with monkeypatch.context() as m:
        m.setattr(step_copies, "replay_forward_backward", lambda *a: False)
        return trace_workload(w, GPU, steps=3)


def _traced_with_replay(w: Workload, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN202
    """The trace, and what each step's call to ``replay_forward_backward`` answered."""
    from memfit.estimate import step_copies

    calls: list[bool] = []
    original = step_copies.replay_forward_backward
    with monkeypatch.context() as m:
        m.setattr(step_copies, "replay_forward_backward", lambda *a: calls.append(original(*a)) or calls[-1])
        return trace_workload(w, GPU, steps=3), calls


def _frees_in_any_order(events: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``events`` with each run of back-to-back frees sorted: the caching allocator ends in the same state
    whatever order blocks are freed in, and the order Python frees the tensors of a dropped container in is
    CPython's (lists and tuples last item first, dicts first item first), not the model's."""
    out: list[tuple[int, int, int]] = []
    run: list[tuple[int, int, int]] = []
    for e in events:
        if e[0] < 0:
            run.append(e)
            continue
        out += sorted(run) + [e]
        run = []
    return out + sorted(run)


def _same_trace(a, b, *, free_order: bool = True) -> None:  # noqa: ANN001
    if free_order:
        assert a.events() == b.events()
    else:
        assert _frees_in_any_order(a.events()) == _frees_in_any_order(b.events())
    assert a.phase_marks == b.phase_marks
    assert a.op_costs == b.op_costs and a.cost_marks == b.cost_marks
    assert [(x.op, x.module, x.phase, x.step, x.category) for x in a.allocs] == [
        (x.op, x.module, x.phase, x.step, x.category) for x in b.allocs
    ]


class _DictOut(torch.nn.Module):
    """Returns a dict with the logits and a second tensor, as Hugging Face models return a ModelOutput."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(1024, 1024)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.lin(x)
        return {"logits": y, "hidden": y.relu()}


@pytest.mark.parametrize("changes", [
    {},  # cuBLAS: its workspaces are made in the first step only
    {"keep_output": False},
    {"accumulation_steps": 2, "optimizer": lambda p: torch.optim.AdamW(p, lr=1e-3)},
    {"accumulation_steps": 2, "keep_output": False},
    {"precision": "bf16", "model": lambda: torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Dropout(0.1))},
    {"model": _DictOut, "forward": lambda m, b: m(b[0]), "loss": lambda out, b: out["logits"].square().mean()},
])
def test_second_step_copied_from_the_first_equals_it_traced(monkeypatch, changes):  # noqa: ANN001
    w = _linear_workload(**changes)
    copied, calls = _traced_with_replay(w, monkeypatch)
    assert calls == [False, True]  # step 1 traced, step 2's forward and backward copied
    # a held dict output is freed in CPython's order, which the copy cannot know; the allocator's state is the same
    _same_trace(copied, _traced_without_replay(w, monkeypatch), free_order="forward" not in changes)


class _Remembers(torch.nn.Module):
    """Keeps a tensor of ``numel`` elements made in its first forward: the second step does not make it again."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(1024, 1024)
        self.numel = numel
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            self.cache = torch.ones(self.numel)
        return self.lin(x) + self.cache[:1024].sum()


class _Hoards(torch.nn.Module):
    """Keeps a small tensor of every forward: each step leaves one more alive (a leak); with ``replace``, only the
    newest (each step hands it over to the next)."""

    def __init__(self, replace: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(1024, 1024)
        self.replace = replace
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.replace:
            self.kept.clear()
        self.kept.append(y[:4].detach().clone())
        return y


def _remembers(numel: int) -> Workload:
    return _linear_workload(model=functools.partial(_Remembers, numel))


def _peak_allocated(trace) -> int:  # noqa: ANN001
    from memfit.estimate.allocator import replay

    return replay(trace.events()).peak_allocated_bytes


@pytest.mark.parametrize("w", [_remembers(4096), _linear_workload(precision="fp16"),
                               _linear_workload(model=functools.partial(_Hoards, replace=True))],
                         ids=["cache", "grad_scaler", "handed_over"])
def test_a_small_tensor_the_first_step_keeps_is_made_again_and_the_copy_errs_high(monkeypatch, w):  # noqa: ANN001
    copied, calls = _traced_with_replay(w, monkeypatch)
    assert calls == [False, True]  # a module's cache or last tensor, GradScaler's scale: the second step copied
    traced = _traced_without_replay(w, monkeypatch)
    assert [m[1:] for m in copied.phase_marks] == [m[1:] for m in traced.phase_marks]
    kept = copied.uncertain_bytes["step_kept"] // 2
    assert 0 < kept <= 4096 * 4 and "replaced by each later step's" in copied.uncertain["step_kept"]
    assert "step_kept" not in traced.uncertain
    # made again and the earlier one freed at the copy's end: never below the traced step, at most its bytes above
    assert _peak_allocated(traced) <= _peak_allocated(copied) <= _peak_allocated(traced) + kept
    # each allocation freed at most once: what the copy freed is no longer tracked (the model still holds it)
    frees = [k for o, k in zip(copied.ops, copied.keys) if o < 0]
    assert len(frees) == len(set(frees))


class _Cache:
    """Holds tensors where ``output_tensors`` does not look (a Hugging Face ``DynamicCache`` of keys and values)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _ReturnsACache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(1024, 1024)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        y = self.lin(x)
        return {"logits": y, "cache": _Cache(y[:4].detach().clone())}


def test_what_the_held_output_keeps_unseen_stays_alive_as_the_next_step_would_keep_its_own(monkeypatch):  # noqa: ANN001
    w = _linear_workload(model=_ReturnsACache, forward=lambda m, b: m(b[0]),
                         loss=lambda out, b: out["logits"].square().mean())
    copied, calls = _traced_with_replay(w, monkeypatch)
    # the copy's stand-in for the cache is alive until the next step's: the steady state holds and step 3 is a
    # copy of step 2 (a cache freed with the first step's output would leave step 2 handing over less than it took)
    assert calls == [False, True]
    traced = _traced_without_replay(w, monkeypatch)
    assert _peak_allocated(traced) <= _peak_allocated(copied) <= _peak_allocated(traced) + 4 * 1024 * 4


def test_a_large_tensor_the_first_step_keeps_makes_the_second_step_traced(monkeypatch):  # noqa: ANN001
    w = _remembers(1024 * 1024)  # 4 MiB: more than KEPT_MAX_SHARE of the step's live bytes
    traced, calls = _traced_with_replay(w, monkeypatch)
    assert calls == [False, False]
    _same_trace(traced, _traced_without_replay(w, monkeypatch))
    assert "step_kept" not in traced.uncertain


def test_a_leak_taken_for_a_handover_stays_under_the_bound(monkeypatch):  # noqa: ANN001
    w = _linear_workload(model=_Hoards)
    copied, calls = _traced_with_replay(w, monkeypatch)
    assert calls == [False, True]
    traced = _traced_without_replay(w, monkeypatch)  # each step's kept tensor traced: one more alive per step
    made = [a for a in traced.allocs if a.op == "clone" and a.nbytes == 4 * 1024 * 4]
    assert len(made) == 3 == len([a for a in copied.allocs if a.op == "clone" and a.nbytes == 4 * 1024 * 4])
    # the copy frees each step's before the next; tracing keeps all three. The bound adds what that misses
    more = _peak_allocated(traced) - _peak_allocated(copied)
    assert 0 < more <= copied.uncertain_bytes["step_kept"] == 2 * 4 * 1024 * 4


class _Tied(torch.nn.Module):
    """A tied embedding and output layer with a residual block between: the weight's two grads meet in
    backward, and so do the two grads of the block's input."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(4096, 256)
        self.block = torch.nn.Linear(256, 256)
        self.head = torch.nn.Linear(256, 4096, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        return self.head(h + self.block(h))


def test_tied_weight_grads_are_summed_in_place_as_on_cuda(monkeypatch):  # noqa: ANN001
    w = Workload(
        name="tied", model=_Tied, batch=lambda n: (torch.randint(0, 4096, (n, 64)),),
        loss=lambda out, b: out.float().pow(2).mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=8,
        precision="bf16",
    )
    trace = trace_workload(w, GPU, steps=2)
    # under autocast the head's weight grad comes out of the bf16 copy's backward as a new fp32 tensor, and CUDA's
    # engine adds the embedding's grad into it in place (input_buffer.cpp): no new weight-sized buffer (the
    # 190 MiB of GPT-2's tied embedding, benchmarks/results/explain/explain_cases_h200_torch2.11_20261126.md)
    assert not [a for a in trace.allocs if a.op == "add" and a.phase == "backward" and a.shape == (4096, 256)]
    # the weight's grad is one buffer of its size, alive from its first contribution to the next zero_grad
    assert sorted(a.nbytes for a in trace.allocs if a.category == "grads" and a.step == 0)[-1] == 4096 * 256 * 4
    # and the second step, copied from the first, is what tracing it gives
    _same_trace(trace_workload(w, GPU, steps=3), _traced_without_replay(w, monkeypatch))


class _Junctions(torch.nn.Module):
    """Gradients that meet in backward: residual blocks (the engine sums in place), a branch through a permute
    whose gradient is a view of another (its base holds the storage: summed out of place), and a tied weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(512, 64)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(64, 512, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)  # (B, 16, 64)
        for block in self.blocks:
            h = h + torch.relu(block(h))
        side = self.norm(h.transpose(1, 2)).transpose(1, 2)  # a Swin stage's output projection, channels last
        return self.head(h + side)


def _junction_workload(precision: str) -> Workload:
    return Workload(
        name="junctions", model=_Junctions, batch=lambda n: (torch.randint(0, 512, (n, 16)),),
        loss=lambda out, b: out.float().pow(2).mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=4,
        precision=precision,
    )


def _sums_by_node(rows: dict[str, list[int]]) -> dict[str, tuple[int, int]]:
    """(in place, out of place) per autograd node, from ``sum_in_place``'s rows ("NODE [shape]" -> counts)."""
    found: dict[str, list[int]] = {}
    for key, (in_place, out_of_place) in rows.items():
        counts = found.setdefault(key.split(" ")[0], [0, 0])
        counts[0] += in_place
        counts[1] += out_of_place
    return {node: (a, b) for node, (a, b) in found.items() if a or b}


def _sum_in_place():  # noqa: ANN202
    """benchmarks/estimate/sum_in_place.py: a real step's profiled sums, and the trace's, in the same rows."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "estimate"))
    import sum_in_place

    return sum_in_place


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gradient_sums_are_folded_where_the_engine_sums_in_place(precision):  # noqa: ANN001
    # the reference: a real CPU backward's profile (InputBuffer::accumulate is the same code on every device)
    sums = _sum_in_place()
    real = sums.real_sums(_junction_workload(precision), "cpu")
    if precision == "fp32":  # the residual sums in place, the permuted branch's and the tied weight's not: views
        assert _sums_by_node(real) == {"EmbeddingBackward0": (0, 1), "TransposeBackward0": (0, 1),
                                       "ViewBackward0": (3, 0)}
    else:  # under autocast every gradient comes out of a cast's backward as a new tensor: all in place
        assert sum(a for a, _ in _sums_by_node(real).values()) == 5
        assert sum(b for _, b in _sums_by_node(real).values()) == 0
    assert sums.traced_sums(_junction_workload(precision), "h100") == real


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_sums_gradients_where_the_trace_folds_them(precision):  # noqa: ANN001
    sums = _sum_in_place()
    assert sums.traced_sums(_junction_workload(precision), "h100") == \
        sums.real_sums(_junction_workload(precision), "cuda")


class _Stack(torch.nn.Module):
    """Three residual MLP blocks, each under reentrant ``torch.utils.checkpoint`` or not."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 1024))
            for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = x.requires_grad_() if self.reentrant else x  # reentrant needs an input that requires grad
        for block in self.blocks:
            x = x + (block(x) if self.reentrant is None else checkpoint(block, x, use_reentrant=self.reentrant))
        return x


def test_reentrant_checkpointing_frees_each_block_input_in_backward():
    """The tracer names autograd nodes without holding them: a held node kept each reentrant block's detached
    input alive through its AccumulateGrad node until the backward ended (issue 13: +25 % against a GPU)."""
    reentrant = trace_workload(_linear_workload(model=lambda: _Stack(True)), GPU, steps=2)
    end = next(at for at, name, s in reentrant.phase_marks if name == "optimizer" and s == 1)
    freed = {k for o, k in zip(reentrant.ops[:end], reentrant.keys[:end], strict=True) if o < 0}
    block_outputs = [k for k, a in enumerate(reentrant.allocs)
                     if a.step == 1 and a.phase == "forward" and a.op == "add" and a.shape == (256, 1024)]
    assert len(block_outputs) == 3 and set(block_outputs[:-1]) <= freed  # the last is the output, kept to the end


def test_never_allocates_real_memory_for_a_big_3d_unet():
    import resource

    from memfit.workload.zoo import builtin_workload

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trace = trace_workload(builtin_workload("unet3d"), GPU, steps=2)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    simulated = max(a.nbytes for a in trace.allocs)
    assert simulated > 200 * MiB  # single activations of hundreds of MiB were simulated
    assert grown_kib * 1024 < 400 * MiB  # while the process grew far less than the ~5 GiB they add up to


def test_frees_after_the_trace_ended_are_not_recorded():
    """A fake storage reaped by a later garbage collection must not add a free to a finished trace."""
    import gc

    from memfit.estimate.gpus import gpu_spec
    from memfit.estimate.trace import trace_workload
    from memfit.workload.zoo import builtin_workload

    trace = trace_workload(builtin_workload("mlp").replace(batch_size=4), gpu_spec(None))
    n = len(trace.ops)
    gc.collect()
    assert len(trace.ops) == n


def test_cuda_context_counts_cublas_only_when_the_step_calls_it():
    """Measured on an H200: 639-641 MiB outside the allocator for conv-only nets, 767-771 MiB with cuBLAS."""
    import torch

    from memfit.estimate.gpus import gpu_spec
    from memfit.estimate.predict import estimate
    from memfit.workload.spec import Workload

    def step(model):  # noqa: ANN001, ANN202
        return Workload(model=model, batch=lambda n: (torch.randn(n, 3, 16, 16),),
                        loss=lambda out, batch: out.float().mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        batch_size=2)

    spec = gpu_spec("h200")
    conv = estimate(step(lambda: torch.nn.Conv2d(3, 8, 3)), gpu=spec)
    linear = estimate(step(lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(768, 8))), gpu=spec)
    assert conv.device_bytes - conv.fits_in_bytes == spec.cuda_context_bytes - spec.cublas_context_bytes
    assert linear.device_bytes - linear.fits_in_bytes == spec.cuda_context_bytes
@pytest.mark.parametrize(
    "out", [None, 3, torch.ones(1), ([torch.ones(1), None], (torch.ones(2), 4.0, [torch.ones(3)])),
            {"b": torch.ones(1), "a": [torch.ones(2), torch.ones(3)]}],
)
def test_output_tensors_come_in_tree_flatten_order(out):  # noqa: ANN001
    # the order decides which allocation event comes first, so it must be tree_flatten's
    expected = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    assert [id(t) for t in output_tensors(out)] == [id(t) for t in expected]


def test_trace_leaves_the_collector_as_it_found_it():
    before = gc.get_freeze_count()
    trace_workload(_linear_workload(batch_size=8), GPU, steps=2)
    assert gc.get_freeze_count() == before  # what the trace froze is unfrozen
    gc.freeze()  # a caller that freezes objects itself (a pre-fork server) keeps them frozen
    try:
        frozen = gc.get_freeze_count()
        trace_workload(_linear_workload(batch_size=8), GPU, steps=2)
        assert gc.get_freeze_count() > frozen // 2  # still frozen (frozen objects may die by reference count)
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("keep_output", [True, False])
def test_micro_batches_copied_from_the_second_are_the_stream_tracing_gives(monkeypatch, keep_output):  # noqa: ANN001
    # from the third micro-batch on the tracer copies the second's events: the stream must be the one tracing
    # every micro-batch gives, the plain loop's held output and loss freed where the next forward frees them
    from memfit.estimate import step_copies

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    w = Workload(model=Net, batch=lambda n: (torch.randn(n, 64), torch.randint(0, 10, (n,))),
                 loss=lambda out, b: torch.nn.functional.cross_entropy(out, b[1]),
                 optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), batch_size=8, accumulation_steps=4,
                 precision="bf16", keep_output=keep_output)
    copies: list[bool] = []
    copy = step_copies.copy_micro_batch
    monkeypatch.setattr(step_copies, "copy_micro_batch", lambda *a: copies.append(copy(*a)) or copies[-1])
    copied = trace_workload(w, GPU)
    assert copies and all(copies)
    monkeypatch.setattr(step_copies, "copy_micro_batch", lambda *a: False)
    traced = trace_workload(w, GPU)
    assert copied.events() == traced.events()
    assert [(name, s) for _, name, s in copied.phase_marks] == [(name, s) for _, name, s in traced.phase_marks]


def test_layer_norm_copies_a_permuted_input_before_its_outputs():
    """layer_norm_cuda makes X = input.expect_contiguous() first, then Y, mean and rstd, and frees X on return: the
    order an H200 recorded for a ViT-B/16's residual stream (fit probe s1327_tv_cls_03: copy, output, mean, rstd,
    free, 69 of 75 layer norms). Taken after the outputs, a frozen ViT-B/16's replayed cap came out 4 % low."""
    class PermutedNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(x.transpose(0, 1))  # (L, N, C) -> (N, L, C), not contiguous

    w = _linear_workload(model=PermutedNorm, batch=lambda n: (torch.randn(32, n, 64),), batch_size=8)
    trace = trace_workload(w, GPU, steps=1)
    ops = [a.op for a in _forward_allocs(trace)]
    first = ops.index("native_layer_norm_scratch")
    assert ops[first + 1:first + 4] == ["native_layer_norm"] * 3


def test_scalars_written_by_indexing_are_lifted_without_converting_them(monkeypatch):
    # `ret[i, j, k] = 1` lifts a real scalar (lift_fresh) for each write where the table's values are not known
    # (a known table is written without dispatching: the next test). The recorder makes each a plain fake
    # (Recorder._lifted_scalar); the stream must be the one FakeTensorMode's own conversion gives
    import importlib

    recorder = importlib.import_module("memfit.estimate.recorder")

    class Lookup(torch.nn.Module):
        def __init__(self, n: int = 5) -> None:
            super().__init__()
            ret = torch.rand(n, n, 2 * n - 1)  # a random draw: no known value
            for i in range(n):
                for j in range(n):
                    ret[i, j, j - i + n - 1] = 1
            self.register_buffer("lookup", ret)
            self.lin = torch.nn.Linear(25, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + self.lookup.sum()

    w = Workload(model=Lookup, batch=lambda n: (torch.randn(n, 25),), loss=lambda out, b: out.sum(),
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=2)
    lifted: list[bool] = []
    real = recorder.Recorder._lifted_scalar

    def spy(self, a):  # noqa: ANN001, ANN202
        out = real(self, a)
        lifted.append(out is not None)
        return out

    monkeypatch.setattr(recorder.Recorder, "_lifted_scalar", spy)
    fast = trace_workload(w, GPU)
    assert sum(lifted) >= 25 and fast.param_count == 25 * 3 + 3 and not fast.warnings
    monkeypatch.setattr(recorder.Recorder, "_lifted_scalar", lambda self, a: None)
    assert trace_workload(w, GPU).events() == fast.events()


class _KnownLookup(torch.nn.Module):
    """timm MaxViT's relative-position lookup in small: a table of zeros filled with ones element by element in the
    constructor, and a width read back from it."""

    def __init__(self, n: int = 5) -> None:
        super().__init__()
        ret = torch.zeros(n, n, 2 * n - 1, dtype=torch.long)
        for i in range(n):
            for j in range(n):
                ret[i, j, j - i + n - 1] = 1
        ret[-1, 0, 1] = 7  # a negative index, as Python's
        row = ret[1]  # a view known before the write below: it must see it
        ret[1, 2, 3] += 2  # a read, an add and a write of a tensor (the usual path), beside the fast ones
        self.width = int(ret.sum()) + int(row[2, 3])  # 25 ones + 7 + 2, then the view's 2
        self.register_buffer("lookup", ret.float())
        self.lin = torch.nn.Linear(25, self.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.lookup.sum()


def test_element_writes_into_a_known_table_in_the_constructor_write_its_known_value_without_dispatching(monkeypatch):
    import importlib

    recorder = importlib.import_module("memfit.estimate.recorder")
    values = importlib.import_module("memfit.estimate.values")
    w = Workload(model=_KnownLookup, batch=lambda n: (torch.randn(n, 25),), loss=lambda out, b: out.sum(),
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=2)
    lifted: list[bool] = []
    real = recorder.Recorder._lifted_scalar

    def spy(self, a):  # noqa: ANN001, ANN202
        lifted.append(True)
        return real(self, a)

    monkeypatch.setattr(recorder.Recorder, "_lifted_scalar", spy)
    fast = trace_workload(w, GPU)
    width = 25 + 7 + 2 + 2
    assert fast.param_count == 25 * width + width and not fast.warnings and "value_read" not in fast.uncertain
    constructor = len(lifted)
    assert constructor <= 1  # only `+= 2`'s write of a tensor dispatches

    # the same trace with every write dispatched: the same model and stream, less the 0-dim scalars each write
    # lifted (a CPU tensor on a GPU, where memfit's fake CPU stands for the GPU)
    monkeypatch.setattr(values.KnownValues, "write_element", lambda self, t, index, value: False)
    slow = trace_workload(w, GPU)
    assert len(lifted) - constructor >= 26 and slow.param_count == fast.param_count

    def stream(trace):  # noqa: ANN001, ANN202
        return [(op, trace.allocs[key].op, nbytes) for op, key, nbytes in trace.events()
                if trace.allocs[key].op != "lift_fresh"]

    assert stream(fast) == stream(slow)


@pytest.mark.parametrize("index, value", [((1, 2, 3), 5), (1, 5), ((-1, 0), 2.5), ((5, 0, 0), 1), ((0, 0, -10), 1),
                                          ((True, 0, 0), 1), ((slice(0, 2), 0, 0), 1), ((0, 0, 0), torch.tensor(1)),
                                          ((0, 0, 0, 0), 1), ((0, 0, 0), 2**70)])
def test_an_element_write_skips_dispatch_only_for_python_numbers_at_int_indices_in_range(index, value) -> None:
    from memfit._torch_private import StaticShapeFakeTensorMode
    from memfit.estimate.values import KnownValues

    known = KnownValues()
    expected = torch.zeros(5, 4, 9, dtype=torch.long)
    with StaticShapeFakeTensorMode():
        t = torch.zeros(5, 4, 9, dtype=torch.long)
        known.keep(t, known.run(torch.ops.aten.zeros.default, "zeros", ((5, 4, 9),), {"dtype": torch.long}))
        taken = known.write_element(t, index, value)
    simple = (type(value) in (int, float) and abs(value) < 2**63
              and all(type(i) is int for i in (index if isinstance(index, tuple) else (index,))))
    in_range = simple and len(index if isinstance(index, tuple) else (index,)) <= 3 and all(
        -s <= i < s for i, s in zip(index if isinstance(index, tuple) else (index,), (5, 4, 9)))
    assert taken == in_range
    if taken:
        expected[index] = value
    assert torch.equal(known.value(t), expected)


class _FeatureEncoder(torch.nn.Module):
    """Data2Vec-Audio's feature encoder in small: 1-D convolutions, each normed over its channels through a
    transpose, so every convolution after the first reads a permuted input and gets a permuted gradient."""

    channels, samples = 96, 5010

    def __init__(self) -> None:
        super().__init__()
        c = self.channels
        self.convs = torch.nn.ModuleList([torch.nn.Conv1d(1, c, 10, 5), torch.nn.Conv1d(c, c, 3, 2)])
        self.norms = torch.nn.ModuleList([torch.nn.LayerNorm(c), torch.nn.LayerNorm(c)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, norm in zip(self.convs, self.norms, strict=True):
            x = torch.nn.functional.gelu(norm(conv(x).transpose(1, 2)).transpose(1, 2))
        return x


def _feature_encoder_workload() -> Workload:
    return Workload(model=_FeatureEncoder, batch=lambda n: (torch.randn(n, 1, _FeatureEncoder.samples),),
                    loss=lambda out, b: out.float().square().mean(), batch_size=4, precision="fp16",
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def _first_layer_sizes() -> tuple[int, int]:
    """Bytes of the first layer's (B, C, T) output in fp16 and in fp32: the second convolution's input and the
    norm's, and their gradients and copies."""
    n, c = 4, _FeatureEncoder.channels
    t = (_FeatureEncoder.samples - 10) // 5 + 1
    return n * c * t * 2, n * c * t * 4


def test_a_convolution_and_a_layer_norm_copy_permuted_inputs_and_gradients_as_cuda_does():
    """The H200 stream of Data2Vec-Audio's CTC step (entry_traces_h200_torch2.11_20261128_s26.tar.gz): a 1-D
    convolution copies a permuted input before its output; its backward copies the input, then the output's
    gradient, before the input's gradient; the layer norm's backward copies its permuted input before dX and the
    permuted dY after it, and gives a contiguous dX. Without the copies its fits_in came out 5.6 % under the GPU's."""
    trace = trace_workload(_feature_encoder_workload(), GPU, steps=1)
    half, _ = _first_layer_sizes()
    second = 4 * _FeatureEncoder.channels * 500 * 2  # the second output: (1001 - 3) // 2 + 1 = 500 steps
    forward = [(a.op, a.nbytes) for a in _forward_allocs(trace) if a.module == "convs.1"]
    assert ("convolution_scratch", half) in forward
    assert forward.index(("convolution_scratch", half)) < [op for op, _ in forward].index("convolution")
    backward = [(a.op, a.nbytes) for a in _forward_allocs(trace, "backward")]
    conv = [i for i, (op, _) in enumerate(backward) if op == "convolution_backward"]
    # the second convolution's backward (the first's input is contiguous and wants no gradient)
    assert backward[conv[0] - 2:conv[0] + 1] == [
        ("convolution_backward_scratch", half), ("convolution_backward_scratch", second),
        ("convolution_backward", half)]
    norm = [i for i, (op, _) in enumerate(backward) if op == "native_layer_norm_backward"]
    assert backward[norm[0] - 1][0] == backward[norm[0] + 3][0] == "native_layer_norm_backward_scratch"


@pytest.mark.gpu
def test_cuda_copies_permuted_convolution_inputs_and_gradients_where_the_trace_does():
    # the blocks of the first layer's (B, C, T) size, fp16 and fp32, that one step takes on CUDA: the trace must
    # take as many of each (the copies above are most of them)
    from memfit import _torch_private as tp

    half, single = _first_layer_sizes()
    trace = trace_workload(_feature_encoder_workload(), GPU, steps=1)
    traced = [trace.allocs[k].nbytes for o, k in zip(trace.ops, trace.keys, strict=True)
              if o > 0 and trace.allocs[k].phase in ("forward", "loss", "backward")]
    torch.manual_seed(0)
    model = _FeatureEncoder().cuda()
    x = torch.randn(4, 1, _FeatureEncoder.samples, device="cuda")
    torch.cuda.synchronize()
    tp.record_memory_history(True)
    try:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().square().mean()
        loss.backward()
        torch.cuda.synchronize()
        snap = tp.memory_snapshot()
    finally:
        tp.record_memory_history(False)
    real = [e["size"] for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert (real.count(half), real.count(single)) == (traced.count(half), traced.count(single))


class _ShiftedWindows(torch.nn.Module):
    """A video Swin's cyclic shift: a roll over three dimensions of a (B, T, H, W, C) tensor, both ways."""

    shape = (4, 6, 8, 16)

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shifted = torch.roll(self.proj(x), shifts=(-2, -3, -3), dims=(1, 2, 3))
        return torch.roll(shifted.relu(), shifts=(2, 3, 3), dims=(1, 2, 3))


def test_a_roll_over_three_dimensions_takes_two_intermediates_before_its_output():
    # roll_common rolls one dimension at a time into a new tensor: two input-sized blocks before the output, freed
    # as the recursion returns (Swin3D-T's H200 stream); one block of twice the size packed its segments otherwise
    w = Workload(model=_ShiftedWindows, batch=lambda n: (torch.randn(n, *_ShiftedWindows.shape),),
                 loss=lambda out, b: out.square().mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                 batch_size=2)
    trace = trace_workload(w, GPU, steps=1)
    size = 2 * math.prod(_ShiftedWindows.shape) * 4
    for phase in ("forward", "backward"):
        stream = [(o, trace.allocs[k].op, trace.allocs[k].nbytes, k) for o, k in zip(trace.ops, trace.keys, strict=True)
                  if trace.allocs[k].phase == phase]
        rolls = [i for i, (o, op, _, _) in enumerate(stream) if o > 0 and op == "roll"]
        assert len(rolls) == 2, phase
        for at in rolls:
            (_, a, na, ka), (_, b, nb, kb) = stream[at - 2], stream[at - 1]
            assert (a, na, b, nb) == ("roll_scratch", size, "roll_scratch", size)
            assert [(o, k) for o, _, _, k in stream[at + 1:at + 3]] == [(-1, kb), (-1, ka)]


@pytest.mark.gpu
def test_cuda_rolls_three_dimensions_through_two_intermediates():
    from memfit import _torch_private as tp

    x = torch.randn(2, *_ShiftedWindows.shape, device="cuda")
    size = x.numel() * x.element_size()
    torch.cuda.synchronize()
    tp.record_memory_history(True)
    try:
        out = torch.roll(x, shifts=(-2, -3, -3), dims=(1, 2, 3))
        torch.cuda.synchronize()
        snap = tp.memory_snapshot()
    finally:
        tp.record_memory_history(False)
    events = [(e["action"], e["size"]) for e in snap["device_traces"][0]
              if e["action"] in ("alloc", "free_completed")]
    assert events[-5:] == [("alloc", size)] * 3 + [("free_completed", size)] * 2
    assert out.shape == x.shape


@pytest.mark.parametrize(("heads", "copy"), [(16, False), (2, True)])
def test_an_fp32_attention_backward_takes_the_kernels_workspace_and_the_gradients_copy(heads: int, copy: bool):
    # fp32 runs the memory-efficient kernel: its backward takes delta and 64 x 64-float grad-query tiles per head
    # (a head of 8 takes 8 times its query) after a contiguous copy of a gradient whose (B, L, H, D) view is not
    # dense (heads=2: the output permuted before its projection, as nn.MultiheadAttention does)
    from memfit.estimate.workspaces import efficient_attention_backward_fp32_bytes

    b, seq, dim = 4, 63, 128

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(b, seq, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v)  # (B, H, L, D)
            o = o.permute(2, 0, 1, 3) if copy else o.transpose(1, 2)  # (L, B, H, D) or (B, L, H, D)
            return self.out(o.reshape(*o.shape[:2], dim))

    w = Workload(model=Attention, batch=lambda n: (torch.randn(n, seq, dim),), loss=lambda out, bt: out.sum(),
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=b, precision="fp32")
    trace = trace_workload(w, GPU, steps=1)
    scratch = [a.nbytes for a in trace.allocs if a.op == "_scaled_dot_product_efficient_attention_backward_scratch"]
    expected = [efficient_attention_backward_fp32_bytes(b, heads, seq, dim // heads)]
    assert scratch == ([b * seq * dim * 4] if copy else []) + expected


def test_log_sigmoid_keeps_no_buffer_as_on_cuda():
    # CUDA's log_sigmoid_forward returns an empty buffer (its backward recomputes); the CPU and fake kernels one the
    # input's size, which a focal loss kept alive until its backward
    n = 1 << 16

    class Focal(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(n, n, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.logsigmoid(x * self.lin.weight[0])

    w = Workload(model=Focal, batch=lambda b: (torch.randn(b, n),), loss=lambda out, bt: -out.sum(),
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=8)
    trace = trace_workload(w, GPU, steps=1)
    assert [a.nbytes for a in trace.allocs if a.op == "log_sigmoid_forward"] == [8 * n * 4]  # the result alone


@pytest.mark.parametrize(("config", "gpu", "workspace"), [
    (None, "h100", 32 * MiB),  # the default on compute capability 9.x
    (":4096:8", "h100", 32 * MiB),
    (":16:8", "h100", 128 * 1024),
    (":4096:8", "a100", 32 * MiB),  # MONAI's import and deterministic training set it: 4 x the A100's default
    (":4096:2:16:8", "a100", 8 * MiB + 128 * 1024),
    ("unparsed", "a100", 8 * MiB + 128 * 1024),  # PyTorch warns and keeps the default
])
def test_the_cublas_workspace_follows_cublas_workspace_config(monkeypatch: pytest.MonkeyPatch, config: str | None,
                                                              gpu: str, workspace: int):
    # CublasHandlePool.cpp, parseChosenWorkspaceSize: SIZE KiB x COUNT summed over the :SIZE:COUNT pairs
    if config is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
    trace = trace_workload(_linear_workload(), gpu_spec(gpu), steps=1)
    workspaces = [a.nbytes for a in trace.allocs if a.op == "cublas_workspace"]
    assert workspaces and set(workspaces) == {workspace}

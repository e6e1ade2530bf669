"""cuDNN's fused RNN (``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` on CUDA), allocation by allocation.

On CUDA these modules run one cuDNN call per direction of the whole sequence (``_cudnn_rnn``); on CPU they run cell
by cell, with other saved tensors and one dispatch per time step. During a trace the module's op (``aten::lstm``
and friends) is replaced by :class:`CudnnRNN`, which allocates what PyTorch's CUDA code allocates, in the same order
and with the same lifetimes, read from ``aten/src/ATen/native/cudnn/RNN.cpp`` and ``aten/src/ATen/cudnn/AutocastRNN.cpp``:

* **Autocast casts to fp16, under bf16 autocast too**: ``_cudnn_rnn``'s autocast kernel casts to ``at::kHalf``
  whatever the autocast dtype. It copies the weights into a new fp16 flat buffer (through autograd, so their
  gradients flow back to the fp32 weights) and casts input, ``hx`` and ``cx`` to fp16; the call saves all of them.
* **The weights live in one flat buffer** once the module is on CUDA in fp16, fp32 or fp64: ``RNNBase``'s
  ``flatten_parameters`` (run by ``.cuda()``, ``.to()`` and a constructor given a CUDA device) allocates it after
  the weights' own blocks and frees those (:func:`flatten_weights`). One large block instead of many small ones
  changes which cached blocks later allocations reuse: on an H200 trace of corpus entry c093 (a 2-layer LSTM, 16
  weights) the capped run needed 314.6 MB with it and 264.2 MB without (``entry_traces_rnn_h200_*``).
* **Weights not in one flat buffer** (a bf16 module: ``torch.backends.cudnn`` never flattens bf16) are copied into
  one for every call, and that copy is saved for backward.
* **batch_first**: the call copies the input to (T, N, I) and frees the copy when it returns; its output is
  allocated (T, N, D*H) and returned transposed, so it is not contiguous (a later ``reshape`` copies it).
* **Forward** keeps the output, ``hy``, ``cy`` and a reserve buffer for backward; a workspace lives only inside the
  call. **Backward** makes two calls (data, then weights), each with its own workspace and input copy; the data call
  also copies the output's gradient to (T, N, D*H), the weight call returns views of one flat gradient buffer.
* **Dropout** takes a dropout state, allocated on the first training call with dropout > 0 and kept by PyTorch for
  the process; between layers its masks add to the reserve.
* **The algorithm** PyTorch asks cuDNN for (``get_algo``: the small-hidden persistent kernel, the fp16 persistent
  kernel, else the standard one) depends on the sizes, the dtype, the GPU and the direction (forward or backward).

The sizes cuDNN computes itself (``cudnnGetRNNTempSpaceSizes``: reserve and workspace) come from rules measured
allocation by allocation: ``rnn_reserve_bytes`` and ``rnn_workspace_bytes``. The emulation reproduces the order and
sizes of every allocation of 966 measured calls (workspaces within 1.1 %, the rest exact; see tests/test_cudnn_rnn.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from memfit.estimate.gpus import GpuSpec, gpu_spec

MiB = 1 << 20

GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}

Algorithm = Literal["standard", "persist_static", "persist_static_small_h"]

# All sizes below: H200 (132 SMs), torch 2.11, cuDNN 9.19, read allocation by allocation from
# benchmarks/results/estimate/rnn_allocations_h200_torch2.11_20261126.json (966 forward/backward calls; H 128-1024,
# input sizes 80 and H, 1-3 layers, 1-2 directions, fp32, fp16 and autocast, dropout) and the peaks of
# benchmarks/results/estimate/cudnn_calibration_rnn_h200_torch2.11_20261126.json (H 96 and 384, T up to 500, bf16).

# Reserve space in T*N*H*D elements: per layer the gates' activations plus the layer's output, less the last layer's
# output (that is ``output`` itself): k*L - 1 with k = 6 for an LSTM, 7 for a GRU, 2 for a tanh/ReLU RNN, plus 256
# bytes. Exact to the byte on all 1270 calls of the two files below, every algorithm and dtype. The 256 bytes matter
# where the rest is a multiple of 2 MiB: the segment then takes one 2 MiB page more (a bf16 GRU's 100,663,296-byte
# reserve asked for 100,663,552, and the replay of the fit-side probe p5_gru_v11000 packed its blocks otherwise).
RESERVE_PER_LAYER = {"LSTM": 6, "GRU": 7, "RNN_TANH": 2, "RNN_RELU": 2}
RESERVE_PAD_BYTES = 256
# Dropout between layers adds its masks to the reserve: D bits per element of each layer's output but the last's
# (T*N*D*H*(L-1)*D/8 bytes: each direction keeps its own mask of the layer's D*H features), exact on 192 dropout
# calls of one and two directions (benchmarks/results/estimate/rnn_allocations_dropout_h200_torch2.11_20261127.json;
# fit data: the main file's 8 two-direction calls had left D=1 unmeasured, read as 2 bits too).
DROPOUT_MASK_BITS_PER_DIRECTION = 1

# Workspace (cudnnGetRNNTempSpaceSizes), the same for forward, backward data and backward weights when they run the
# same algorithm: 8 MiB per layer and direction, plus the weights' bytes, plus, in elements of the call's dtype,
# a*T*N*H + b*T*N*I + c*L*N*H. (a, b, c) by algorithm, mode, directions and one layer or more:
_WORKSPACE_PER_LAYER_BYTES = 8 * MiB
_WorkspaceKey = tuple[str, str, int, bool]  # (algorithm, mode, directions, more than one layer)
_WORKSPACE: dict[_WorkspaceKey, tuple[float, float, float]] = {
    # integer fits, within 0.1 % of every call (input sizes 80 and H; 2 layers with I = H only, which the 1- and
    # 3-layer coefficients reproduce)
    ("standard", "LSTM", 1, False): (5, 1, 10), ("standard", "LSTM", 1, True): (5, 1, 10),
    ("standard", "LSTM", 2, False): (14, 1, 24), ("standard", "LSTM", 2, True): (14, 1, 24),
    ("standard", "GRU", 1, False): (4, 2, 5),
    ("standard", "GRU", 2, False): (12, 1, 14), ("standard", "GRU", 2, True): (12, 2, 14),
    ("persist_static_small_h", "LSTM", 1, False): (21, 1, 8), ("persist_static_small_h", "LSTM", 1, True): (21, 1, 8),
    ("persist_static_small_h", "LSTM", 2, False): (30, 1, 18), ("persist_static_small_h", "LSTM", 2, True): (30, 1, 18),
    ("persist_static_small_h", "GRU", 1, False): (18, 2, 6), ("persist_static_small_h", "GRU", 1, True): (19, 2, 6),
    ("persist_static_small_h", "GRU", 2, False): (24, 2, 14), ("persist_static_small_h", "GRU", 2, True): (26, 2, 14),
    # least squares on the 106 deep one-direction GRU calls: within 1.1 % of each (and of the grid's T=500 rows)
    ("standard", "GRU", 1, True): (3.845, 1.26, 10.5),
    # the persistent fp16 LSTM (one layer, I % 128 == 0): measured with I = H only, 22*T*N*H + 8*N*H; the split
    # between H and I is assumed to be the small-H persistent kernel's
    ("persist_static", "LSTM", 1, False): (21, 1, 8),
    # tanh/ReLU RNNs: the calibration grid (I = H) and the file's 2-layer calls give a + b; b = 1 is assumed
    ("standard", "RNN_TANH", 1, False): (5, 1, 4), ("standard", "RNN_TANH", 1, True): (4, 1, 12),
    ("standard", "RNN_TANH", 2, False): (11, 1, 11.5), ("standard", "RNN_TANH", 2, True): (13, 1, 11.5),
    ("persist_static_small_h", "RNN_TANH", 1, False): (14, 1, 5),
    ("persist_static_small_h", "RNN_TANH", 1, True): (15, 1, 5),
    ("persist_static_small_h", "RNN_TANH", 2, False): (20, 1, 18),
    ("persist_static_small_h", "RNN_TANH", 2, True): (22, 1, 12),
    ("persist_static", "RNN_TANH", 1, False): (14, 1, 5),  # not measured: the small-H kernel's
}
# Dropout between the layers of a one-direction RNN adds T*N*H elements to the workspace of forward and backward
# alike: a deep LSTM takes (6, 1, 10) (its (5, 1, 10) plus one), a deep GRU (5, 1, 5), each within 0.06 % of 96 calls
# (fp32 and fp16, H 256 and 1024, I 40 and H, 2-3 layers, T*N 2048-16384; rnn_allocations_dropout_h200_torch2.11_
# 20261127.json). Without it the deep GRU rule was 3-18 % under on those calls, and the fit-side supplement's GRU
# taggers 10-17 % (benchmarks/estimate/probe_cases.py, s1327_rnn_*). Two directions: no change (exact, 96 calls).
_WORKSPACE_DROPOUT: dict[str, tuple[float, float, float]] = {"LSTM": (6, 1, 10), "GRU": (5, 1, 5)}
DROPOUT_WORKSPACE_ELEMENTS = 1
"""T*N*H elements dropout adds where it was not measured (tanh/ReLU RNNs, the persistent small-H algorithm): the
LSTM's measured extra, assumed."""
# An input wider than the hidden state (an embedding of 384-512 into a 256-320 GRU) was measured only for the
# one-layer, one-direction standard GRU: one of its four T*N*H terms takes max(H, I) instead, i.e. 3*T*N*H + 3*T*N*I
# when I > H (and the (4, 2, 5) above when I <= H). Exact to 0.002 % on five bf16 calls, H 256 and 320, I 384 and
# 512, N 112-144, T 256 (benchmarks/results/estimate/gap_traces_probes_r5_h200_torch2.11_20261127.tar.gz, fit-side
# probes p5_*); (4, 2, 5) was 10 % under on them. The other keys keep their I <= H fits where I > H (not measured).
_WORKSPACE_WIDER_INPUT: dict[_WorkspaceKey, int] = {("standard", "GRU", 1, False): 1}
# Known misses, both over: one-direction LSTMs of 2+ layers over 500 steps take 3-13 % less (calibration grid);
# nothing was measured beyond 3 layers (the 3-layer coefficients are used) or 1024 hidden units.

# PyTorch keeps one cuDNN dropout state per GPU for the whole process (RNN.cpp, get_dropout_state), made on the first
# training call with dropout > 0: 6,488,064 B on the H200's 132 SMs, i.e. 48 KiB per SM (scaling by the SM count is
# assumed: cudnnDropoutGetStatesSize depends on the GPU).
DROPOUT_STATE_BYTES_PER_SM = 48 * 1024


@dataclass(frozen=True)
class RNNShape:
    """What sizes a cuDNN RNN call: ``mode`` (LSTM, GRU, RNN_TANH, RNN_RELU), sequence length, batch, input and
    hidden sizes, layers, directions and the call's dtype."""

    mode: str
    seq: int
    batch: int
    input_size: int
    hidden: int
    layers: int
    directions: int
    dtype: torch.dtype
    rows: int | None = None
    """Rows of a packed sequence's data (``lstm.data``: no padding); None for a padded batch."""

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def steps_times_batch(self) -> int:
        """What cuDNN's reserve and workspace scale with: time steps × batch, or for a packed sequence its rows
        (the sum of the lengths). A packed call's descriptors give each time step its own batch size
        (aten/src/ATen/native/cudnn/RNN.cpp, the batch sizes of the packed input), and cuDNN sizes the buffers
        by them: on the zoo's packed biLSTM (64 sequences of 100-400 steps, 16,108 rows of 25,600 padded) the
        padded sizes put the peak 48 % over the H100's measurement, the rows 5.2 % over
        (benchmarks/results/estimate/zoo_accuracy_h100_torch2.11_20261127*.md; zoo data, no constant fitted)."""
        return self.rows if self.rows is not None else self.seq * self.batch


def rnn_algorithm(s: RNNShape, gpu: GpuSpec, *, forward: bool) -> Algorithm:
    """The algorithm PyTorch asks cuDNN for (aten/src/ATen/native/cudnn/RNN.cpp, get_algo; unpacked input) and, for
    bf16, the one cuDNN's workspace sizes show it runs: the standard one (calibration grid, H=96)."""
    major, minor = gpu.compute_capability
    tanh = s.mode in ("RNN_TANH", "RNN_RELU")
    if s.dtype == torch.bfloat16 or s.rows is not None:
        return "standard"  # bf16: measured; packed input: not followed in get_algo nor measured, taken as standard
    # use_rnn_persist_small_h: backward keeps it for smaller hidden sizes than forward
    if major >= 6 and s.hidden <= ((384 if forward else 256) if tanh else (192 if forward else 128)):
        return "persist_static_small_h"
    if s.dtype != torch.float16 or not (s.layers == 1 and s.directions == 1 and s.hidden <= 1024
                                        and s.hidden % 128 == 0 and s.input_size % 128 == 0):
        return "standard"  # use_persist_common_heuristics
    n, t = s.batch, s.seq
    if major == 7 and minor != 5:  # use_persist_device_heuristics, Volta
        persist = (((n % 16 == 0 and n not in (80, 112)) or n == 8)
                   and ((t >= 40 and n <= 128) or (t >= 20 and n <= 96) or (t >= 10 and n <= 32)))
    elif major >= 8 and gpu.sm_count >= 98 and minor != 6:
        persist = (s.mode == "LSTM" and n % 8 == 0 and n <= 128) or (
            tanh and n % 8 == 0 and n <= 128 and (n < 96 or s.hidden < 896))
    else:
        persist = False
    return "persist_static" if persist else "standard"


def rnn_reserve_bytes(s: RNNShape, *, dropout: bool = False) -> int:
    """The reserve space one training call keeps from forward to backward (with dropout: its masks too)."""
    per_step = s.steps_times_batch * s.hidden * s.directions
    bits = DROPOUT_MASK_BITS_PER_DIRECTION * s.directions
    masks = per_step * (s.layers - 1) * bits // 8 if dropout and s.layers > 1 else 0
    return per_step * (RESERVE_PER_LAYER[s.mode] * s.layers - 1) * s.itemsize + masks + RESERVE_PAD_BYTES


def rnn_weight_numel(s: RNNShape, bias: bool = True) -> int:
    """Elements of the flat weight buffer: per layer and direction, the input and hidden matrices (and biases)."""
    g = GATES[s.mode] * s.hidden
    per_bias = 2 * g if bias else 0
    first = g * (s.input_size + s.hidden) + per_bias
    deeper = g * (s.directions * s.hidden + s.hidden) + per_bias
    return s.directions * (first + (s.layers - 1) * deeper)


def rnn_workspace_bytes(s: RNNShape, weight_bytes: int, algorithm: Algorithm, *, dropout: bool = False) -> int:
    """The workspace of one cuDNN RNN call (forward, backward data or backward weights) running ``algorithm``
    (``dropout``: between the layers, in training)."""
    mode = "RNN_TANH" if s.mode == "RNN_RELU" else s.mode
    a, b, c = _WORKSPACE[(algorithm, mode, s.directions, s.layers > 1)]
    if dropout and s.directions == 1 and s.layers > 1:
        if algorithm == "standard" and mode in _WORKSPACE_DROPOUT:
            a, b, c = _WORKSPACE_DROPOUT[mode]
        else:
            a += DROPOUT_WORKSPACE_ELEMENTS
    tn = s.steps_times_batch
    wider = _WORKSPACE_WIDER_INPUT.get((algorithm, mode, s.directions, s.layers > 1), 0)
    elements = ((a - wider) * tn * s.hidden + wider * tn * max(s.hidden, s.input_size) + b * tn * s.input_size
                + c * s.layers * s.batch * s.hidden)
    return _WORKSPACE_PER_LAYER_BYTES * s.layers * s.directions + weight_bytes + int(elements) * s.itemsize


def dropout_state_bytes(gpu: GpuSpec) -> int:
    """The cuDNN dropout state PyTorch keeps for the process once a call uses dropout."""
    return DROPOUT_STATE_BYTES_PER_SM * gpu.sm_count


@dataclass(frozen=True)
class _Call:
    """How cuDNN runs one call: the forward and backward algorithms, and whether the reserve keeps dropout masks."""

    forward: Algorithm
    backward: Algorithm
    dropout: bool


def _slices(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors shaped like ``like`` on consecutive pieces of ``flat``'s memory, with no autograd link to it (RNN.cpp
    builds them with ``set_`` on the buffer's storage)."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view(t.shape).detach())
        offset += t.numel()
    return out


class CudnnRNN(torch.autograd.Function):
    """``_cudnn_rnn`` and its backward on fake tensors: shapes and lifetimes, no arithmetic.

    ``weight_buf`` is the flat weight buffer when the weights are views into one made for this call (autocast),
    else None; ``copy_weights`` says the weights are not flat, so the call copies them into one (bf16 modules).
    ``call`` says how cuDNN runs it: the forward and backward algorithms and whether dropout masks are kept.
    """

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor | None,
                weight_buf: torch.Tensor | None, shape: RNNShape, batch_first: bool, copy_weights: bool,
                call: _Call, *weights: torch.Tensor) -> Any:
        ctx.set_materialize_grads(False)
        s = shape
        if weight_buf is None and copy_weights:
            weight_buf = input.new_empty(sum(w.numel() for w in weights))  # kept for backward (result4)
        weight_bytes = sum(w.numel() for w in weights) * s.itemsize
        x = input.transpose(0, 1).contiguous() if batch_first else input.contiguous()  # freed at return
        rows = (s.seq, s.batch) if s.rows is None else (s.rows,)
        output = input.new_empty((*rows, s.directions * s.hidden))
        hy = hx.new_empty(hx.shape)
        cy = cx.new_empty(cx.shape) if cx is not None else None
        workspace = input.new_empty(rnn_workspace_bytes(s, weight_bytes, call.forward, dropout=call.dropout),
                                    dtype=torch.uint8)
        reserve = input.new_empty(rnn_reserve_bytes(s, dropout=call.dropout), dtype=torch.uint8)
        del workspace, x  # taken and given back inside the call
        out = output.transpose(0, 1) if batch_first else output
        ctx.save_for_backward(input, hx, cx, out, reserve, weight_buf, *weights)
        ctx.shape, ctx.batch_first, ctx.weight_bytes, ctx.algorithm = s, batch_first, weight_bytes, call.backward
        ctx.dropout = call.dropout
        return (out, hy) if cy is None else (out, hy, cy)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor | None, grad_hy: torch.Tensor | None,
                 *grad_cy: torch.Tensor | None) -> Any:
        input, hx, cx, out, reserve, weight_buf, *weights = ctx.saved_tensors
        s, batch_first = ctx.shape, ctx.batch_first
        # _cudnn_rnn_backward: zeros for the gradients nobody passed (an unused output, h_n, c_n)
        if grad_out is None:
            grad_out = torch.zeros_like(out, memory_format=torch.contiguous_format)
        if grad_hy is None:
            grad_hy = torch.zeros_like(hx)
        if cx is not None and (not grad_cy or grad_cy[0] is None):
            grad_cy = (torch.zeros_like(cx),)
        # backward data: input and output gradient copied to (T, N, .), dx, dhx, dcx, a workspace
        x = input.transpose(0, 1).contiguous() if batch_first else input.contiguous()
        dy = grad_out.transpose(0, 1).contiguous() if batch_first else grad_out.contiguous()
        dx = input.new_empty((*((s.seq, s.batch) if s.rows is None else (s.rows,)), s.input_size))
        dhx = hx.new_empty(hx.shape)
        dcx = cx.new_empty(cx.shape) if cx is not None else None
        nbytes = rnn_workspace_bytes(s, ctx.weight_bytes, ctx.algorithm, dropout=ctx.dropout)
        workspace = input.new_empty(nbytes, dtype=torch.uint8)
        del workspace, dy, x  # the measured calls free the gradient copy first
        grad_input = dx.transpose(0, 1) if batch_first else dx
        grads: list[torch.Tensor | None] = [None] * len(weights)
        if any(ctx.needs_input_grad[8:]):
            # backward weights: the input copied again, one zeroed flat gradient buffer, a workspace
            x = input.transpose(0, 1).contiguous() if batch_first else input.contiguous()
            dw = (weight_buf if weight_buf is not None else weights[0]).new_zeros(sum(w.numel() for w in weights))
            workspace = input.new_empty(nbytes, dtype=torch.uint8)
            del workspace, x
            grads = list(_slices(dw, weights))
            del dw
        del grad_hy, grad_cy
        return (grad_input, dhx, dcx, None, None, None, None, None, *grads)


# torch.backends.cudnn.is_acceptable: the dtypes cuDNN takes (CUDNN_TENSOR_DTYPES in torch/backends/cudnn)
_FLATTENED_DTYPES = (torch.float16, torch.float32, torch.float64)


def flatten_weights(module: torch.nn.RNNBase, *, again: bool = True) -> bool:
    """Do to ``module`` on the traced GPU what ``RNNBase.flatten_parameters`` does on CUDA: allocate one buffer for
    all weights, copy them in, make each weight a view of its piece (its own block is freed with its last
    reference). Skipped, as there, for a bf16 module, mixed dtypes or weights that alias. Like CUDA's, a second
    call moves weights that are already flat into a new buffer, unless ``again`` is False.
    Returns whether the weights were moved."""
    weights: list[torch.Tensor] = [w for layer in module.all_weights for w in layer]
    if not weights or not torch.backends.cudnn.enabled:
        return False
    dtype = weights[0].dtype
    if dtype not in _FLATTENED_DTYPES or any(w.dtype != dtype for w in weights):
        return False
    storages = [w.untyped_storage() for w in weights]  # held: ids are unique only among live objects
    # CUDA compares data pointers: views of one flat buffer are distinct
    if len({(id(st), w.storage_offset()) for st, w in zip(storages, weights)}) != len(weights):
        return False
    if not again and len({id(st) for st in storages}) == 1:
        return False
    del storages
    flat = weights[0].new_empty(sum(w.numel() for w in weights))
    with torch.no_grad():
        for piece, w in zip(_slices(flat, weights), weights):
            piece.copy_(w)
            w.data = piece
    return True


class RNNEmulation:
    """The ``aten::lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` kernels of a trace on ``gpu`` (its compute
    capability and SM count pick cuDNN's algorithm and size the dropout state), and the state PyTorch keeps across
    calls (the dropout state)."""

    def __init__(self, gpu: GpuSpec | None = None) -> None:
        self.gpu = gpu or gpu_spec()
        self._dropout_state: torch.Tensor | None = None

    def kernel(self, mode: str) -> Callable[..., Any]:
        def run(input: torch.Tensor, hx: Any, params: list[torch.Tensor], has_biases: bool, num_layers: int,
                dropout: float, train: bool, bidirectional: bool, batch_first: bool) -> Any:
            h, c = (hx[0], hx[1]) if mode == "LSTM" else (hx, None)
            return self._call(mode, input, h, c, list(params), has_biases, num_layers, dropout, train,
                              bidirectional, batch_first)

        return run

    def packed_kernel(self, mode: str) -> Callable[..., Any]:
        """``aten::lstm.data`` and friends: a packed sequence's rows, and its batch sizes (a CPU tensor with values,
        on CUDA too, and in the trace: memfit.estimate.data_dependent)."""
        def run(data: torch.Tensor, batch_sizes: torch.Tensor, hx: Any, params: list[torch.Tensor],
                has_biases: bool, num_layers: int, dropout: float, train: bool, bidirectional: bool) -> Any:
            h, c = (hx[0], hx[1]) if mode == "LSTM" else (hx, None)
            sizes = batch_sizes.tolist()
            return self._call(mode, data, h, c, list(params), has_biases, num_layers, dropout, train,
                              bidirectional, False, packed=(len(sizes), sizes[0] if sizes else 0))

        return run

    def _call(self, mode: str, input: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor | None,
              params: list[torch.Tensor], has_biases: bool, num_layers: int, dropout: float, train: bool,
              bidirectional: bool, batch_first: bool, packed: tuple[int, int] | None = None) -> Any:
        uses_dropout = dropout > 0 and train
        if uses_dropout and self._dropout_state is None:
            # RNN.cpp get_dropout_state, before _cudnn_rnn (and its autocast casts) runs; any number of layers
            self._dropout_state = input.new_empty(dropout_state_bytes(self.gpu), dtype=torch.uint8)
        weight_buf = None
        copy_weights = params[0].dtype == torch.bfloat16  # torch.backends.cudnn never flattens bf16 modules
        half = torch.float16
        if torch.is_autocast_enabled("cpu") and input.is_floating_point() and input.dtype != torch.float64:
            # AutocastRNN.cpp: fp16 whatever the autocast dtype (measured: the output is fp16 under bf16 autocast);
            # a new flat fp16 weight buffer filled through autograd (copy_ into pieces of it), then fp16 copies of
            # cx, hx and input, in the order the measured calls allocate them
            if params[0].dtype != half:
                weight_buf = input.new_zeros(sum(p.numel() for p in params), dtype=half)
                pieces = _slices(weight_buf, params)
                for piece, p in zip(pieces, params):
                    piece.copy_(p)
                params, copy_weights = pieces, False
            cx = cx.to(half) if cx is not None else None
            hx = hx.to(half)
            input = input.to(half)
        directions = 2 if bidirectional else 1
        if packed is not None:  # (time steps, largest batch); the reserve and workspace scale with the rows
            seq, batch = packed
        else:
            seq, batch = (input.shape[1], input.shape[0]) if batch_first else (input.shape[0], input.shape[1])
        shape = RNNShape(mode=mode, seq=seq, batch=batch, input_size=input.shape[-1], hidden=hx.shape[-1],
                         layers=num_layers, directions=directions, dtype=input.dtype,
                         rows=input.shape[0] if packed is not None else None)
        call = _Call(forward=rnn_algorithm(shape, self.gpu, forward=True),
                     backward=rnn_algorithm(shape, self.gpu, forward=False), dropout=uses_dropout and num_layers > 1)
        return CudnnRNN.apply(input, hx, cx, weight_buf, shape, batch_first, copy_weights, call, *params)

"""cuDNN's fused RNN (``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` on CUDA), allocation by allocation.

On CUDA these modules run one cuDNN call per direction of the whole sequence (``_cudnn_rnn``); on CPU they run cell
by cell, with other saved tensors and one dispatch per time step. During a trace the module's op (``aten::lstm``
and friends) is replaced by :class:`CudnnRNN`, which allocates what PyTorch's CUDA code allocates, in the same order
and with the same lifetimes, read from ``aten/src/ATen/native/cudnn/RNN.cpp`` and ``aten/src/ATen/cudnn/AutocastRNN.cpp``:

* **Autocast casts to fp16, under bf16 autocast too**: ``_cudnn_rnn``'s autocast kernel casts to ``at::kHalf``
  whatever the autocast dtype. It copies the weights into a new fp16 flat buffer (through autograd, so their
  gradients flow back to the fp32 weights) and casts input, ``hx`` and ``cx`` to fp16; the call saves all of them.
* **Weights not in one flat buffer** (a bf16 module: ``torch.backends.cudnn`` never flattens bf16) are copied into
  one for every call, and that copy is saved for backward.
* **batch_first**: the call copies the input to (T, N, I) and frees the copy when it returns; its output is
  allocated (T, N, D*H) and returned transposed, so it is not contiguous (a later ``reshape`` copies it).
* **Forward** keeps the output, ``hy``, ``cy`` and a reserve buffer for backward; a workspace lives only inside the
  call. **Backward** makes two calls (data, then weights), each with its own workspace and input copy; the data call
  also copies the output's gradient to (T, N, D*H), the weight call returns views of one flat gradient buffer.
* **Dropout between layers** takes a dropout state, allocated on the first call and kept by PyTorch for the process.

The sizes cuDNN computes itself (``cudnnGetRNNTempSpaceSizes``: reserve and workspace) come from measured rules:
``rnn_reserve_bytes`` and ``rnn_workspace_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

MiB = 1 << 20

GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}

# Reserve space per layer, in T*N*H*D elements: the gates' activations per step plus the layer's output, less the
# last layer's output (that is ``output`` itself): k*L - 1 with k = 6 for an LSTM (4 gates, cell, output), 7 for a
# GRU, 2 for a tanh/ReLU RNN. Within 4 % of the 20 MB+ calls of 192 shapes, 1-3 layers, 1-2 directions, fp32 and bf16 (the bf16
# rows once the per-call weight copy is taken out): benchmarks/results/estimate/cudnn_calibration_rnn_h200_torch2.11_20261126.json
RESERVE_PER_LAYER = {"LSTM": 6, "GRU": 7, "RNN_TANH": 2, "RNN_RELU": 2}

# Workspace (cudnnGetRNNTempSpaceSizes, training mode; forward and backward ask the same question) measured on the
# same calibration grid, H200, torch 2.11, cuDNN 9.19 (forward: peak minus what stays minus the input copy; backward:
# the same, less the gradients it returns). It is 8 MiB per layer and direction, plus the weights' bytes, plus a
# multiple of T*N*H (times the element size) that depends on the directions and the layers:
_WORKSPACE_PER_LAYER_BYTES = 8 * MiB
# T*N*H multiples at T=500 (at T=40 up to 0.5 higher), the same for H=96 and H=384 in bf16 and for H=384 in fp32.
# One direction: 6.0 for one layer, 5.15 for three, 5.58 for the issue-13 LSTM LM (2 layers, H=1024, I=512, fp32,
# benchmarks/results/estimate/gap_traces_h200_torch2.11_20261126.tar.gz): linear in the layers, 6.43 - 0.43 L,
# held at its 3-layer value beyond (no measurement there).
# Two directions (one and three layers): the 3-layer bidirectional fp32 GRU over 1000 steps of the same traces
# (H=256, I=64) took 12.5 where the grid (I=H=384) says 14.1.
_WORKSPACE_TNH_ONE_DIRECTION = (6.425, -0.425)  # (at zero layers, per layer)
_WORKSPACE_TNH_TWO_DIRECTIONS = {  # deep (2+ layers) -> {mode: multiple}
    False: {"LSTM": 15.1, "GRU": 13.1, "RNN_TANH": 12.1},
    True: {"LSTM": 15.2, "GRU": 14.1, "RNN_TANH": 14.1},
}
# fp32 with a small hidden size takes more: the multiples measured at H=96 (and, for tanh, H=384), the sizes for which
# PyTorch picks cuDNN's small-hidden persistent forward algorithm (RNN.cpp, use_rnn_persist_small_h: LSTM/GRU up to
# 192, tanh/ReLU up to 384). bf16 rows show no such change.
_SMALL_H = {"LSTM": 192, "GRU": 192, "RNN_TANH": 384}
_WORKSPACE_TNH_FP32_SMALL_H = {
    1: {"LSTM": 22.0, "GRU": 20.0, "RNN_TANH": 15.5},
    2: {"LSTM": 31.0, "GRU": 26.0, "RNN_TANH": 21.0},
}

# PyTorch keeps one cuDNN dropout state per GPU for the whole process, "slightly over 2MB"
# (aten/src/ATen/native/cudnn/RNN.cpp, get_dropout_state).
DROPOUT_STATE_BYTES = 2 * MiB


@dataclass(frozen=True)
class RNNShape:
    """What sizes a cuDNN RNN call: ``mode`` (LSTM, GRU, RNN_TANH, RNN_RELU), sequence length, batch, input and
    hidden sizes, layers, directions and the element size of the call's dtype."""

    mode: str
    seq: int
    batch: int
    input_size: int
    hidden: int
    layers: int
    directions: int
    itemsize: int
    rows: int | None = None
    """Rows of a packed sequence's data (``lstm.data``: no padding); None for a padded batch."""


def rnn_reserve_bytes(s: RNNShape) -> int:
    """The reserve space one training call keeps from forward to backward."""
    return s.seq * s.batch * s.hidden * s.directions * (RESERVE_PER_LAYER[s.mode] * s.layers - 1) * s.itemsize


def rnn_weight_numel(s: RNNShape, bias: bool = True) -> int:
    """Elements of the flat weight buffer: per layer and direction, the input and hidden matrices (and biases)."""
    g = GATES[s.mode] * s.hidden
    per_bias = 2 * g if bias else 0
    first = g * (s.input_size + s.hidden) + per_bias
    deeper = g * (s.directions * s.hidden + s.hidden) + per_bias
    return s.directions * (first + (s.layers - 1) * deeper)


def rnn_workspace_bytes(s: RNNShape, weight_bytes: int) -> int:
    """The workspace of one cuDNN RNN call (forward, backward data or backward weights)."""
    mode = "RNN_TANH" if s.mode == "RNN_RELU" else s.mode
    if s.directions == 1:
        base, per_layer = _WORKSPACE_TNH_ONE_DIRECTION
        multiple = (base + per_layer * min(s.layers, 3)) * s.hidden  # no data beyond 3 layers: held there
    else:
        multiple = _WORKSPACE_TNH_TWO_DIRECTIONS[s.layers > 1][mode] * s.hidden
    if s.itemsize == 4 and s.hidden <= _SMALL_H[mode]:
        multiple = _WORKSPACE_TNH_FP32_SMALL_H[s.directions][mode] * s.hidden
    per_step = int(multiple * s.seq * s.batch) * s.itemsize
    return _WORKSPACE_PER_LAYER_BYTES * s.layers * s.directions + weight_bytes + per_step


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
    """

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor | None,
                weight_buf: torch.Tensor | None, shape: RNNShape, batch_first: bool, copy_weights: bool,
                *weights: torch.Tensor) -> Any:
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
        workspace = input.new_empty(rnn_workspace_bytes(s, weight_bytes), dtype=torch.uint8)
        reserve = input.new_empty(rnn_reserve_bytes(s), dtype=torch.uint8)
        del workspace, x  # taken and given back inside the call
        out = output.transpose(0, 1) if batch_first else output
        ctx.save_for_backward(input, hx, cx, out, reserve, weight_buf, *weights)
        ctx.shape, ctx.batch_first, ctx.weight_bytes = s, batch_first, weight_bytes
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
        workspace = input.new_empty(rnn_workspace_bytes(s, ctx.weight_bytes), dtype=torch.uint8)
        del workspace, x, dy
        grad_input = dx.transpose(0, 1) if batch_first else dx
        grads: list[torch.Tensor | None] = [None] * len(weights)
        if any(ctx.needs_input_grad[7:]):
            # backward weights: the input copied again, one zeroed flat gradient buffer, a workspace
            x = input.transpose(0, 1).contiguous() if batch_first else input.contiguous()
            dw = (weight_buf if weight_buf is not None else weights[0]).new_zeros(sum(w.numel() for w in weights))
            workspace = input.new_empty(rnn_workspace_bytes(s, ctx.weight_bytes), dtype=torch.uint8)
            del workspace, x
            grads = list(_slices(dw, weights))
            del dw
        del grad_hy, grad_cy
        return (grad_input, dhx, dcx, None, None, None, None, *grads)


class RNNEmulation:
    """The ``aten::lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` kernels of a trace, and the state PyTorch keeps
    across calls (the dropout state)."""

    def __init__(self) -> None:
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
        weight_buf = None
        copy_weights = params[0].dtype == torch.bfloat16  # torch.backends.cudnn never flattens bf16 modules
        half = torch.float16
        if torch.is_autocast_enabled("cpu") and input.is_floating_point() and input.dtype != torch.float64:
            # AutocastRNN.cpp: fp16 whatever the autocast dtype; a new flat fp16 weight buffer filled through
            # autograd (copy_ into pieces of it), and fp16 copies of input, hx and cx
            if params[0].dtype != half:
                weight_buf = input.new_zeros(sum(p.numel() for p in params), dtype=half)
                pieces = _slices(weight_buf, params)
                for piece, p in zip(pieces, params):
                    piece.copy_(p)
                params, copy_weights = pieces, False
            input, hx = input.to(half), hx.to(half)
            cx = cx.to(half) if cx is not None else None
        if dropout > 0 and train and num_layers > 1 and self._dropout_state is None:
            self._dropout_state = input.new_empty(DROPOUT_STATE_BYTES, dtype=torch.uint8)
        directions = 2 if bidirectional else 1
        if packed is not None:  # (time steps, largest batch); the reserve and workspace sized as for that padding
            seq, batch = packed
        else:
            seq, batch = (input.shape[1], input.shape[0]) if batch_first else (input.shape[0], input.shape[1])
        shape = RNNShape(mode=mode, seq=seq, batch=batch, input_size=input.shape[-1], hidden=hx.shape[-1],
                         layers=num_layers, directions=directions, itemsize=input.element_size(),
                         rows=input.shape[0] if packed is not None else None)
        return CudnnRNN.apply(input, hx, cx, weight_buf, shape, batch_first, copy_weights, *params)

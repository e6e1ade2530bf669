"""Sparse COO gradients under the trace (memfit.estimate.sparse): the sizes CUDA's sparse kernels give."""

import torch

from memfit import Workload
from memfit.estimate.gpus import gpu_spec
from memfit.estimate.recorder import BATCH_SEED
from memfit.estimate.trace import trace_workload

GPU = gpu_spec("h100")
ROWS, DIM, BATCH, BAG = 10_000, 32, 64, 4


def _bags(optimizer, rows: int = ROWS) -> Workload:  # noqa: ANN001
    return Workload(model=lambda: torch.nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True),
                    batch=lambda n: (torch.randint(0, rows, (n, BAG)),), loss=lambda out, b: out.square().mean(),
                    optimizer=optimizer, batch_size=BATCH)


def _values_rows(trace, op: str, phase: str) -> list[tuple[int, int]]:  # noqa: ANN001
    """(step, rows) of each float32 (values) allocation ``op`` (or its foreach form) made in ``phase``."""
    return [(a.step, a.shape[0]) for a in trace.allocs
            if a.op in (op, f"_foreach_{op}") and a.phase == phase and a.dtype == "float32" and len(a.shape) == 2]


def test_a_sparse_gradient_has_a_row_per_index_looked_up():
    trace = trace_workload(_bags(lambda p: torch.optim.SGD(p, lr=0.1)), GPU)
    # index_select of the bag gradients: one row per index (uncoalesced), nnz 0 in FakeTensorMode's own kernel
    assert _values_rows(trace, "_embedding_bag_backward", "backward") == [(s, BATCH * BAG) for s in range(3)]


def test_sgd_momentum_on_a_sparse_gradient_grows_by_one_gradient_a_step():
    trace = trace_workload(_bags(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)), GPU)
    # step 0 clones the gradient into the buffer; each later step concatenates the new gradient to it (CUDA's
    # add_out_sparse_cuda does not merge)
    assert _values_rows(trace, "clone", "optimizer") == [(0, BATCH * BAG)]
    assert _values_rows(trace, "add_", "optimizer") == [(1, 2 * BATCH * BAG), (2, 3 * BATCH * BAG)]
    # the old buffer goes only after the new one is made: both are alive at once, as on the GPU
    grown = next(k for k, a in enumerate(trace.allocs) if a.op.endswith("add_") and a.step == 2 and a.dtype == "float32")
    old = next(k for k, a in enumerate(trace.allocs) if a.op.endswith("add_") and a.step == 1 and a.dtype == "float32")
    events = list(zip(trace.ops, trace.keys))
    assert events.index((1, grown)) < events.index((-1, old))


def test_coalescing_keeps_one_row_per_distinct_index_of_the_batch():
    rows = 50  # 256 lookups among 50 rows: many repeats
    trace = trace_workload(_bags(lambda p: torch.optim.SparseAdam(list(p), lr=0.1), rows=rows), GPU)
    assert "one random batch" in trace.uncertain["data_dependent_shape"]
    torch.manual_seed(BATCH_SEED)
    distinct = int(_bags(lambda p: None, rows).make_batch(BATCH)[0].unique().numel())
    assert distinct < BATCH * BAG
    coalesced = _values_rows(trace, "_coalesce", "optimizer")
    assert coalesced and all(n == distinct for _, n in coalesced)

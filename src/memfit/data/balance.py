"""A distributed batch sampler that gives every rank about the same cost at every step.

With variable-size inputs the rank that draws the biggest batch sets the peak, and with DDP every step waits for
it. ``DistributedSampler`` deals samples round-robin, so an outlier lands on whichever rank it lands on. Here:

1. The epoch's samples are shuffled (seeded by ``seed`` and the epoch), then pooled ``pool_steps`` global steps at
   a time and sorted by cost inside the pool, so each global step holds samples of similar size (less padding).
2. Inside each global step, samples are dealt round by round, one per rank per round, the largest of a round going
   to the rank with the least cost so far. This bounds the spread of per-rank cost in a step by the spread of
   sample costs within that step (proof: in a round, ranks sorted by load ascending receive costs sorted
   descending, so a gap between two ranks can never grow past the previous gap or the round's cost spread).
3. The order of the global steps is shuffled, so big-sample steps do not all come last.

Every rank computes the same plan from ``(seed, epoch)``, so no communication is needed. Each sample appears
exactly once per epoch: when the sample count does not divide into full steps, the last step carries the rest
(ranks get ``batch_size`` or a few more); ``drop_last=True`` instead drops the remainder (a different random
remainder each epoch).

Example:
    >>> sizes = [64 * 64] * 30 + [512 * 512] * 2
    >>> sampler = BalancedBatchSampler(sizes, batch_size=4, num_replicas=2, rank=0)
    >>> len(sampler), sum(len(b) for b in sampler)
    (4, 16)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from memfit.errors import UsageError
from memfit.records import JsonRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SamplerSettings(JsonRecord):
    """How a :class:`BalancedBatchSampler` deals its samples, for logs and result files."""

    num_samples: int
    batch_size: int
    num_replicas: int
    seed: int
    shuffle: bool
    drop_last: bool
    pool_steps: int
    steps: int
    """Global steps per epoch (``len(sampler)``)."""


class BalancedBatchSampler:
    """Batch sampler for DDP that balances per-rank cost (pixels, voxels, tokens, or your own cost) every step.

    Pass it as ``DataLoader(dataset, batch_sampler=sampler)`` on every rank and call :meth:`set_epoch` at the start
    of each epoch, as with ``DistributedSampler``.

    Args:
        costs: One cost per sample (e.g. ``height * width``), or a callable ``index -> cost`` evaluated once per
            sample here (keep it cheap: read sizes from metadata, not pixels).
        batch_size: Samples per rank per step.
        num_replicas: World size; defaults to ``torch.distributed.get_world_size()``.
        rank: This rank; defaults to ``torch.distributed.get_rank()``.
        seed: Same on every rank.
        shuffle: Shuffle samples and step order each epoch. Without it, the plan is fixed across epochs.
        drop_last: Drop the samples that do not fill a whole step instead of adding them to the last step.
        pool_steps: Global steps pooled and sorted by cost together. Larger pools group sizes more tightly (less
            padding, tighter balance) at the cost of less random batch composition; 1 disables grouping.
        num_samples: Needed only when ``costs`` is a callable.
    """

    def __init__(
        self,
        costs: Sequence[float] | np.ndarray | Callable[[int], float],
        *,
        batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        pool_steps: int = 8,
        num_samples: int | None = None,
    ) -> None:
        if callable(costs):
            if num_samples is None:
                raise UsageError("num_samples is required when costs is a callable; pass num_samples=len(dataset).")
            costs = [float(costs(i)) for i in range(num_samples)]
        self.costs = np.asarray(costs, dtype=np.float64)  # one array: worker-safe, no per-sample objects
        if self.costs.ndim != 1 or len(self.costs) == 0:
            raise UsageError(f"costs must be a non-empty 1D sequence, got shape {self.costs.shape}.")
        if not np.isfinite(self.costs).all() or (self.costs < 0).any():
            raise UsageError("costs must be finite and >= 0 (pixels, voxels or tokens per sample).")
        if num_replicas is None or rank is None:
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_initialized():
                raise UsageError("Pass num_replicas and rank, or call torch.distributed.init_process_group first.")
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        if batch_size < 1 or num_replicas < 1 or not 0 <= rank < num_replicas or pool_steps < 1:
            raise UsageError(
                f"Need batch_size >= 1, num_replicas >= 1, 0 <= rank < num_replicas and pool_steps >= 1; got "
                f"batch_size={batch_size}, num_replicas={num_replicas}, rank={rank}, pool_steps={pool_steps}."
            )
        per_step = batch_size * num_replicas
        if len(self.costs) < (per_step if drop_last else num_replicas):
            raise UsageError(
                f"{len(self.costs)} samples cannot give every one of {num_replicas} ranks a batch "
                f"(batch_size={batch_size}); use a smaller batch_size or more data."
            )
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.pool_steps = pool_steps
        self.epoch = 0
        self._num_steps = max(len(self.costs) // per_step, 1)

    def set_epoch(self, epoch: int) -> None:
        """Use the plan of ``epoch``; call on every rank before iterating, like ``DistributedSampler``."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self._num_steps

    def __iter__(self) -> Iterator[list[int]]:
        for step in self.plan():
            yield [int(i) for i in step[self.rank]]

    def plan(self, epoch: int | None = None) -> list[list[np.ndarray]]:
        """The whole epoch: ``plan[step][rank]`` is the array of sample indices of that rank's batch."""
        epoch = self.epoch if epoch is None else epoch
        rng = np.random.default_rng((self.seed, epoch))
        n = len(self.costs)
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        per_step = self.batch_size * self.num_replicas
        kept = self._num_steps * per_step if self.drop_last else n
        order = order[:kept]
        # step boundaries: full steps, the last one takes any remainder
        bounds = [s * per_step for s in range(self._num_steps)] + [kept]
        steps: list[np.ndarray] = []
        for pool_start in range(0, self._num_steps, self.pool_steps):
            pool_end = min(pool_start + self.pool_steps, self._num_steps)
            pool = order[bounds[pool_start] : bounds[pool_end]]
            # stable sort, descending cost: similar sizes share a step, so padding and spread stay small
            pool = pool[np.argsort(-self.costs[pool], kind="stable")]
            offset = bounds[pool_start]
            for s in range(pool_start, pool_end):
                steps.append(pool[bounds[s] - offset : bounds[s + 1] - offset])
        step_order = rng.permutation(len(steps)) if self.shuffle else np.arange(len(steps))
        return [self._deal(steps[s]) for s in step_order]

    def _deal(self, samples: np.ndarray) -> list[np.ndarray]:
        """Deal one global step to ranks, one sample per rank per round, largest to the lightest rank."""
        samples = samples[np.argsort(-self.costs[samples], kind="stable")]
        loads = np.zeros(self.num_replicas)
        batches: list[list[int]] = [[] for _ in range(self.num_replicas)]
        for start in range(0, len(samples), self.num_replicas):
            round_ = samples[start : start + self.num_replicas]
            # lightest ranks first (ties by rank id, for determinism); a short last round goes to the lightest
            ranks = np.lexsort((np.arange(self.num_replicas), loads))[: len(round_)]
            for r, sample in zip(ranks, round_, strict=True):
                batches[r].append(int(sample))
                loads[r] += self.costs[sample]
        return [np.asarray(b, dtype=np.int64) for b in batches]

    def rank_costs(self, epoch: int | None = None) -> np.ndarray:
        """Cost per step and rank, shape ``(steps, num_replicas)``: what the balance tests and reports check."""
        return np.array([[self.costs[b].sum() for b in step] for step in self.plan(epoch)])

    def settings(self) -> SamplerSettings:
        return SamplerSettings(
            num_samples=len(self.costs), batch_size=self.batch_size, num_replicas=self.num_replicas, seed=self.seed,
            shuffle=self.shuffle, drop_last=self.drop_last, pool_steps=self.pool_steps, steps=self._num_steps,
        )

    def to_dict(self) -> dict[str, Any]:
        """``settings().to_dict()``: the sampler is not a result, its settings are."""
        return self.settings().to_dict()


def baseline_rank_costs(costs: Sequence[float] | np.ndarray, *, batch_size: int, num_replicas: int, seed: int = 0,
                        epoch: int = 0) -> np.ndarray:
    """Per-step per-rank cost under ``DistributedSampler`` + ``BatchSampler`` (drop_last), for comparison."""
    import torch.utils.data

    costs = np.asarray(costs, dtype=np.float64)
    per_rank = []
    for rank in range(num_replicas):
        # DistributedSampler only takes len() of its dataset: a range stands in for one
        sampler: torch.utils.data.DistributedSampler[int] = torch.utils.data.DistributedSampler(
            range(len(costs)), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed  # type: ignore[arg-type]
        )
        sampler.set_epoch(epoch)
        batches = list(torch.utils.data.BatchSampler(sampler, batch_size, drop_last=True))
        per_rank.append([costs[b].sum() for b in batches])
    return np.array(per_rank).T

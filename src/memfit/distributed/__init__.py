"""Several GPUs: per-rank memory reports that name why one rank is heavier, and FSDP2 sharding with a model-state memory formula.

Names load on first use (``memfit._lazy``), so importing the package stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit._lazy import load_export as _load_export

_EXPORTS: dict[str, str] = {
    "collect_rank_memory": "memfit.distributed.ranks",
    "gather_rank_memory": "memfit.distributed.ranks",
    "diagnose": "memfit.distributed.imbalance",
    "GpuProcess": "memfit.distributed.ranks",
    "RankMemory": "memfit.distributed.ranks",
    "RankReport": "memfit.distributed.ranks",
    "Finding": "memfit.distributed.imbalance",
    "shard_model": "memfit.distributed.shard",
    "model_state_memory": "memfit.distributed.shard",
    "compare_sharding": "memfit.distributed.shard",
    "ModelStateMemory": "memfit.distributed.shard",
    "ShardingComparison": "memfit.distributed.shard",
    "Sharding": "memfit.distributed.shard",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    return _load_export(__name__, _EXPORTS, name)


if TYPE_CHECKING:  # pragma: no cover - what type checkers and IDEs see
    from memfit.distributed.imbalance import Finding as Finding
    from memfit.distributed.imbalance import diagnose as diagnose
    from memfit.distributed.ranks import GpuProcess as GpuProcess
    from memfit.distributed.ranks import RankMemory as RankMemory
    from memfit.distributed.ranks import RankReport as RankReport
    from memfit.distributed.ranks import collect_rank_memory as collect_rank_memory
    from memfit.distributed.ranks import gather_rank_memory as gather_rank_memory
    from memfit.distributed.shard import ModelStateMemory as ModelStateMemory
    from memfit.distributed.shard import Sharding as Sharding
    from memfit.distributed.shard import ShardingComparison as ShardingComparison
    from memfit.distributed.shard import compare_sharding as compare_sharding
    from memfit.distributed.shard import model_state_memory as model_state_memory
    from memfit.distributed.shard import shard_model as shard_model

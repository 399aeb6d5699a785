"""The serving engine of one rank of a tensor- and/or pipeline-parallel server.

Ranks are laid out stage-major: rank = stage · tp + tp rank, so a stage's TP group is tp
consecutive ranks. Every rank loads the full model, keeps its stage (`engine.pipeline_engine`)
and its TP shard (`engine.tensor_parallel`), and runs a `LeaderFollowerEngine`.
"""

from __future__ import annotations

import torch.distributed as dist

from engine.engine import EngineConfig
from engine.leader_follower import LeaderFollowerEngine
from engine.pipeline_engine import PipelineEngine, keep_stage
from engine.tensor_parallel import shard_for_serving
from engine.tokens import TokenizerInfo
from models.transformer import CausalLM


def build_parallel_engine(
    model: CausalLM, tokens: TokenizerInfo, config: EngineConfig, *, tp: int, pp: int
) -> LeaderFollowerEngine:
    """Keep this rank's stage and shard of the full `model` (in place) and wrap it in an engine.

    Needs the default process group of tp · pp ranks.
    """
    world = dist.group.WORLD
    assert world is not None, "multi-process serving needs the default process group"
    if dist.get_world_size() != tp * pp:
        raise ValueError(
            f"--tensor-parallel-size {tp} x --pipeline-parallel-size {pp} = {tp * pp} ranks, "
            f"but the process group has {dist.get_world_size()}"
        )
    if pp > 1:
        stage, stages = keep_stage(model, dist.get_rank() // tp, pp)
        if tp > 1:
            shard_for_serving(model, _stage_group(tp, pp))
        return PipelineEngine(model, tokens, config, stage, stages, tp_size=tp)
    shard_for_serving(model, world)
    return LeaderFollowerEngine(model, tokens, config)


def _stage_group(tp: int, pp: int) -> dist.ProcessGroup:
    """This rank's tensor-parallel group within its pipeline stage (every rank creates every
    stage's group, in the same order, as `new_group` requires)."""
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
    return groups[dist.get_rank() // tp]

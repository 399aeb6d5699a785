"""`ParallelDims`: the sizes of every parallel dimension, checked, and the named device mesh.

Mesh axes, outermost first: `pp`, `dp_replicate`, `dp_shard`, `cp`, `tp` — tensor parallel
innermost (its collectives are the most frequent, so its ranks should be neighbours), pipeline
outermost (it only sends activations between neighbours). Rank r's coordinates follow row-major
order over those axes, as in torchtitan and Megatron.

Expert parallelism carves its `ep` ranks out of the data-parallel shard axis (Megatron's layout):
`dp_shard = edp x ep` with `ep` inner, so the expert mesh is `pp, dp_replicate, edp, ep, cp, tp`
over the same ranks. Ranks along `ep` split the experts (and read different batches); ranks along
`edp` hold the same experts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kernels import device
from models.parallel_plan import check_split
from parallel.config import HasParallelConfig

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_AXES = ("pp", "dp_replicate", "edp", "ep", "cp", "tp")


@dataclass
class ParallelDims:
    """Sizes of the parallel dimensions of one job; `dp_shard=-1` takes what the others leave."""

    world_size: int
    """Processes in the job."""
    tp: int = 1
    """Tensor-parallel size (--tensor-model-parallel-size)."""
    pp: int = 1
    """Pipeline-parallel size (--pipeline-model-parallel-size)."""
    cp: int = 1
    """Context-parallel size (--context-parallel-size)."""
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP's replicate axis; 1 without HSDP)."""
    dp_shard: int = -1
    """Data-parallel shard ranks (FSDP/DDP axis); -1: world / (tp·pp·cp·dp_replicate)."""
    sequence_parallel: bool = False
    """Sequence parallelism inside the tensor-parallel group (--sequence-parallel)."""
    virtual_pp: int = 1
    """Virtual pipeline chunks per pipeline rank (interleaved 1F1B)."""
    ep: int = 1
    """Expert-parallel size (--expert-model-parallel-size), carved out of `dp_shard`."""
    _mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)
    _expert_mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "dp_replicate", "virtual_pp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelDims.{name} must be >= 1, got {getattr(self, name)}")
        model_parallel = self.tp * self.pp * self.cp * self.dp_replicate
        shards = check_world_size(
            self.world_size, tp=self.tp, pp=self.pp, cp=self.cp, dp_replicate=self.dp_replicate
        )
        if self.dp_shard == -1:
            self.dp_shard = shards
        if self.dp_shard != shards:
            raise ValueError(
                f"{_factors(self.tp, self.pp, self.cp, self.dp_replicate)} × data-parallel shards "
                f"{self.dp_shard} = {model_parallel * self.dp_shard} must equal the world size "
                f"{self.world_size} (WORLD_SIZE); leave the shard size to -1 to get {shards}"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
        if self.dp_shard % self.ep:
            raise ValueError(
                f"--expert-model-parallel-size {self.ep} must divide the data-parallel shard size "
                f"{self.dp_shard} (expert-parallel ranks are carved out of the data-parallel "
                "ranks); launch more processes or lower it"
            )
        if self.virtual_pp > 1 and self.pp == 1:
            raise ValueError(
                "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"
            )

    @property
    def dp(self) -> int:
        """Data-parallel size (replicas x shards): how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one copy of the batch: tensor x pipeline x context."""
        return self.tp * self.pp * self.cp

    @property
    def is_model_parallel(self) -> bool:
        """Tensor, pipeline, context or expert parallelism is on: the model is parallelized by
        `parallel.parallelize.parallelize_model` and fed by its `ModelParallelFeed`; otherwise
        the run is data-parallel only (or a single process)."""
        return self.model_parallel > 1 or self.ep > 1

    def check_model(
        self,
        *,
        num_layers: int | None,
        num_heads: int,
        num_kv_heads: int,
        ffn: int,
        vocab: int,
        seq_length: int | None = None,
    ) -> None:
        """Raise ValueError naming the flag and the numbers that this layout cannot split
        (`num_layers` None: an uneven pipeline split the caller checked itself); the shared
        `models.parallel_plan.check_split` with the trainer's flag names."""
        check_split(
            tp=self.tp,
            pp=self.pp,
            virtual=self.virtual_pp,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            ffn=ffn,
            vocab=vocab,
        )
        if seq_length is not None:
            check_seq_length(seq_length, self.cp)

    def build_mesh(self) -> DeviceMesh:
        """The 5-D named mesh over all ranks (built once; sizes of 1 are kept as axes)."""
        if self._mesh is None:
            shape = tuple(getattr(self, axis) for axis in AXES)
            self._mesh = init_device_mesh(device.current().type, shape, mesh_dim_names=AXES)
        return self._mesh

    def expert_mesh(self) -> DeviceMesh:
        """The 6-D mesh with `dp_shard` split into `edp` x `ep` (built once)."""
        if self._expert_mesh is None:
            sizes = {
                "edp": self.dp_shard // self.ep,
                "ep": self.ep,
                **{a: getattr(self, a) for a in AXES if a != "dp_shard"},
            }
            shape = tuple(sizes[axis] for axis in EXPERT_AXES)
            self._expert_mesh = init_device_mesh(
                device.current().type, shape, mesh_dim_names=EXPERT_AXES
            )
        return self._expert_mesh

    def submesh(self, *axes: str) -> DeviceMesh:
        """The sub-mesh over `axes` (e.g. "tp", or "dp_replicate", "dp_shard") containing this rank."""
        return self.build_mesh()[axes if len(axes) > 1 else axes[0]]

    def grad_sync_mesh(self) -> DeviceMesh | None:
        """Ranks whose gradients must be averaged: data parallel and context parallel together.

        Context-parallel ranks hold the same parameters and disjoint tokens, so their gradients are
        summed exactly as data-parallel ones are. None when that group is a single rank.
        """
        if self.dp * self.cp == 1:
            return None
        mesh = self.build_mesh()
        names = [a for a in ("dp_replicate", "dp_shard", "cp") if getattr(self, a) > 1]
        if len(names) == 1:
            return mesh[names[0]]
        return mesh[tuple(names)]._flatten("_".join(names))

    def hsdp_mesh(self) -> DeviceMesh:
        """HSDP's 2-D mesh: `dp_replicate`, then the axis FSDP2 shards over.

        That axis is `dp_shard`, or with context parallelism `dp_shard` x `cp` flattened
        ("dp_shard_cp", as torchtitan does): context-parallel ranks hold the same parameters, so
        they shard them too, and FSDP2 averages gradients over replicate x shard x cp — the group
        `grad_sync_mesh` gives the other data-parallel paths.
        """
        mesh = self.build_mesh()
        if self.cp == 1:
            return mesh["dp_replicate", "dp_shard"]
        # dp_replicate, dp_shard and cp are adjacent axes (in that order): flatten them, then
        # split the result into (replicate, shard x cp) — slicing a flattened axis out of the
        # root mesh is deprecated.
        data = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_hsdp")
        shape = (self.dp_replicate, self.dp_shard * self.cp)
        return data._unflatten(0, shape, ("dp_replicate", "dp_shard_cp"))

    def coordinate(self, axis: str) -> int:
        """This rank's index along `axis`."""
        return self.build_mesh()[axis].get_local_rank()

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (which batch slice it reads)."""
        return self.coordinate("dp_replicate") * self.dp_shard + self.coordinate("dp_shard")


def default_hsdp_shard_size(dp: int, model_parallel: int, local_world_size: int | None) -> int:
    """Data-parallel ranks per HSDP shard group when `--hsdp-shard-size` is not given.

    Node-local, as PyTorch FSDP's HYBRID_SHARD and DeepSpeed's hpZ: shard over the data-parallel
    ranks of one node (processes per node / model-parallel size), replicate across nodes, so the
    parameter all-gathers stay on the fast intra-node links. When the per-node count is unknown
    (no launcher) or does not tile the data-parallel ranks, shard over all of them (one replica).
    """
    if local_world_size and local_world_size % model_parallel == 0:
        per_node = local_world_size // model_parallel
        if 0 < per_node <= dp and dp % per_node == 0:
            return per_node
    return dp


def build_dims(
    config: HasParallelConfig, world_size: int, local_world_size: int | None = None
) -> ParallelDims:
    """The job's `ParallelDims` from a run's `ParallelConfig` (`config` is one, or a front end's
    config that maps onto one); built once per run and passed down.

    HSDP: `--hsdp-shard-size N` shards within groups of N data-parallel ranks and replicates
    across them; without it, the groups are the data-parallel ranks of one node
    (`default_hsdp_shard_size`). `local_world_size` is the launcher's processes per node
    (default: the LOCAL_WORLD_SIZE torchrun and `meshline train` set).
    """
    par = config.parallel_config()
    dp = world_size // par.model_parallel_size()
    replicate = 1
    if par.hsdp:
        if local_world_size is None and os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
            local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
        shard = par.hsdp_shard_size or default_hsdp_shard_size(
            dp, par.model_parallel_size(), local_world_size
        )
        replicate = dp // shard
    return ParallelDims(
        world_size=world_size,
        tp=par.tensor_model_parallel_size,
        pp=par.pipeline_model_parallel_size,
        cp=par.context_parallel_size,
        dp_replicate=replicate,
        sequence_parallel=par.sequence_parallel,
        ep=par.expert_model_parallel_size,
    )


def _factors(tp: int, pp: int, cp: int, dp_replicate: int = 1) -> str:
    """The model-parallel sizes as flags, multiplied out in words."""
    text = (
        f"--tensor-model-parallel-size {tp} × --pipeline-model-parallel-size {pp} × "
        f"--context-parallel-size {cp}"
    )
    return text + (f" × data-parallel replicas {dp_replicate}" if dp_replicate > 1 else "")


def check_world_size(world_size: int, *, tp: int, pp: int, cp: int, dp_replicate: int = 1) -> int:
    """Data-parallel shards: world / (tp·pp·cp·dp_replicate); ValueError naming the flags if it
    does not divide."""
    model_parallel = tp * pp * cp * dp_replicate
    if world_size % model_parallel:
        raise ValueError(
            f"{_factors(tp, pp, cp, dp_replicate)} = {model_parallel} does not divide the world "
            f"size {world_size} (WORLD_SIZE); launch a multiple of {model_parallel} processes or "
            f"choose sizes whose product divides {world_size}"
        )
    return world_size // model_parallel


def check_seq_length(seq_length: int, cp: int) -> None:
    """ValueError naming the flags when context parallelism of `cp` cannot cut `seq_length`."""
    if cp > 1 and seq_length % (2 * cp):
        raise ValueError(
            f"--seq-length {seq_length} is not divisible by 2 × --context-parallel-size {cp} = "
            f"{2 * cp} (ring attention cuts the sequence into 2·CP load-balanced chunks); choose a "
            f"sequence length that is a multiple of {2 * cp}"
        )

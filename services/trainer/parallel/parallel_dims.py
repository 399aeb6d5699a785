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

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kernels import device

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
        if self.dp_shard == -1:
            if self.world_size % model_parallel:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by --tensor-model-parallel-size "
                    f"{self.tp} x --pipeline-model-parallel-size {self.pp} x "
                    f"--context-parallel-size {self.cp} x data-parallel replicas "
                    f"{self.dp_replicate} = {model_parallel}; launch a multiple of {model_parallel} "
                    "processes"
                )
            self.dp_shard = self.world_size // model_parallel
        if self.dp_shard < 1 or model_parallel * self.dp_shard != self.world_size:
            raise ValueError(
                f"tp {self.tp} x pp {self.pp} x cp {self.cp} x dp_replicate {self.dp_replicate} x "
                f"dp_shard {self.dp_shard} must equal the world size {self.world_size}"
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

    def check_model(
        self, *, num_layers: int, num_heads: int, num_kv_heads: int, ffn: int, vocab: int
    ) -> None:
        """Raise ValueError naming the flag and the numbers that this layout cannot split."""
        for what, value in (
            ("num_attention_heads", num_heads),
            ("ffn_hidden_size", ffn),
            ("vocab_size", vocab),
        ):
            if value % self.tp:
                raise ValueError(
                    f"--tensor-model-parallel-size {self.tp} does not divide {what}={value}; "
                    "choose a tensor-parallel size that divides it"
                )
        if num_kv_heads % self.tp and self.tp % num_kv_heads:
            raise ValueError(
                f"--tensor-model-parallel-size {self.tp} and num_kv_heads={num_kv_heads}: one must "
                "divide the other (KV heads are split up to their number and replicated beyond)"
            )
        stages = self.pp * self.virtual_pp
        if num_layers < stages:
            raise ValueError(
                f"num_layers={num_layers} is fewer than the pipeline stages: "
                f"--pipeline-model-parallel-size {self.pp} x virtual chunks {self.virtual_pp} = "
                f"{stages}; every stage needs at least one layer"
            )

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

    def coordinate(self, axis: str) -> int:
        """This rank's index along `axis`."""
        return self.build_mesh()[axis].get_local_rank()

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (which batch slice it reads)."""
        return self.coordinate("dp_replicate") * self.dp_shard + self.coordinate("dp_shard")

"""DeepSpeed's run of a DeepSpeed JSON on the model and data a `meshline train` command line trains.

One rank of a gloo group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by the caller), on
DeepSpeed's CPU accelerator: `python -m tests.compat.deepspeed_reference DS_JSON OUT_JSON
<meshline train flags>`. From the Meshline flags it takes only what defines the model and the
data: the model is Meshline's own initialisation (`training.setup.create_model`, the run's
`--seed`), exported to its Hugging Face twin (`models.hf_adapters.to_hf`), which DeepSpeed
trains; the data are the run's `--mock-data` samples in Meshline's order
(`training.batching.pretraining_batches`: rank r's micro-batches of each step). Everything about
training (batch sizes, accumulation, ZeRO stage, optimizer, scheduler, clipping, precision) is
DeepSpeed's reading of the JSON. The parameters are passed in HF Trainer's two groups (norm
weights and biases without weight decay: Meshline's and Megatron's grouping). Rank 0 writes
OUT_JSON: per step the loss (mean over the global batch), the learning rate after the step (the
next step's, which Meshline's metrics.csv logs) and DeepSpeed's global gradient norm.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def main(argv: list[str]) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.hf_adapters import to_hf
    from models.hf_config import hf_config
    from services.trainer.arguments import parse_args
    from training.batching import pretraining_batches
    from training.optimizer import is_no_decay
    from training.setup import build_data, build_model_config, create_model

    ds_path, out_path, flags = argv[0], Path(argv[1]), argv[2:]
    ds_config = json.loads(Path(ds_path).read_text())
    config = parse_args(flags)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model_config = build_model_config(config)
    own = create_model(model_config, torch.device("cpu"), config.run.seed)
    settings = dict(hf_config(model_config))
    model_type = settings.pop("model_type")
    settings.pop("architectures", None)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings))
    model.load_state_dict(to_hf(own.state_dict(), model_config), strict=True)
    del own
    decay = [p for n, p in model.named_parameters() if not is_no_decay(n, p)]
    no_decay = [p for n, p in model.named_parameters() if is_no_decay(n, p)]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config)

    micro = engine.train_micro_batch_size_per_gpu()
    accumulation = engine.gradient_accumulation_steps()
    batch_flags = ["--micro-batch-size", str(micro), "--global-batch-size"]
    batch_flags.append(str(engine.train_batch_size()))  # sizes the sample set as Meshline's
    (train, _), _, collate = build_data(parse_args([*flags, *batch_flags]), world)
    batches = pretraining_batches(train, 0, micro, rank, world)
    record: dict[str, list[float]] = {"loss": [], "lr": [], "grad_norm": []}
    for _ in range(config.run.train_iters):
        total = torch.zeros(())
        for _ in range(accumulation):
            batch = collate([train[i] for i in next(batches)])
            logits = engine(input_ids=batch["input_ids"]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        record["loss"].append(float(total) / (accumulation * world))
        record["lr"].append(float(engine.get_lr()[0]))  # the next step's, as Meshline logs
        record["grad_norm"].append(float(engine.get_global_grad_norm()))
    if rank == 0:
        out_path.write_text(json.dumps(record))
    engine.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

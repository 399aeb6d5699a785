"""`meshline train`'s layout check before anything imports torch.

A `--tensor-model-parallel-size` that does not divide the attention heads, or a
`--pipeline-model-parallel-size` that does not divide the layers, is refused from the flags (or
the registry config `--model` names) alone, in well under a second: `meshline` runs `precheck`
before it imports the trainer (which imports torch). Only the heads and layers are checked here,
and only when the command line alone decides them (no `--config` file, no uneven or virtual
pipeline split); `launch_checks.check_model_layout` still checks the whole model before any
worker starts.
"""

from __future__ import annotations

import sys

from models.parallel_plan import TRAIN_FLAGS, check_split
from models.registry import get_config
from services.common.quiet_parser import QuietParser

# Flags that change the layer split (or the model) in ways only the full check follows.
_UNEVEN_LAYERS = (
    "--num-layers-per-virtual-pipeline-stage",
    "--virtual-pipeline-model-parallel-size",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
)


def _layout_flags() -> QuietParser:
    parser = QuietParser()
    p = parser.add_argument
    p("--nproc-per-node", "--nproc_per_node", type=int, default=None)
    p("--dry-run", action="store_true")
    p("--config", default=None)
    p("--model", default=None)
    p("--num-attention-heads", type=int, default=None)
    p("--num-layers", type=int, default=None)
    p("--tensor-model-parallel-size", type=int, default=1)
    p("--pipeline-model-parallel-size", type=int, default=1)
    return parser


def precheck(argv: list[str]) -> int | None:
    """Exit code 2 after one stderr line (as `meshline train` prints it) when the TP/PP flags of
    a launched run cannot split the heads/layers; None: nothing refused here."""
    try:
        args, _ = _layout_flags().parse_known_args(argv)
    except ValueError:
        return None  # the trainer's own parser reports it
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    # Only a launch (the path that starts workers); a config file may set any size.
    if args.nproc_per_node is None or args.dry_run or args.config is not None:
        return None
    if tp < 1 or pp < 1 or tp * pp == 1:
        return None
    heads, layers = args.num_attention_heads, args.num_layers
    if args.model is not None and (heads is None or layers is None):
        try:
            named = get_config(args.model)
        except (KeyError, ValueError):
            return None  # an unknown --model: the trainer names the known ones
        heads = named.num_attention_heads if heads is None else heads
        layers = named.num_layers if layers is None else layers
    if heads is None or heads < 1 or (layers is not None and layers < 1):
        return None
    if any(arg.split("=")[0] in _UNEVEN_LAYERS for arg in argv):
        layers = None
    try:
        # Heads stand in for the sizes unknown here (KV heads, FFN, vocabulary), so that only
        # the heads and the layers are checked, with the messages of the full check.
        check_split(tp=tp, pp=pp, num_layers=layers, num_heads=heads, num_kv_heads=heads,
                    ffn=heads, vocab=heads, flags=TRAIN_FLAGS)  # fmt: skip
    except ValueError as exc:
        print(f"meshline train: {exc}", file=sys.stderr)
        return 2
    return None

"""The pairwise batch the preference objectives read, and what they compute from a forward.

Shapes: B pairs, S sequence, V vocab. A pairwise micro-batch holds, for `side` in chosen and
rejected, `{side}_input_ids` [B,S] (the prompt followed by that response, right-padded),
`{side}_loss_mask` [B,S] (1 on the response's tokens, aligned with the ids, not shifted: a token
counts when it is predicted) and `{side}_attention_mask` [B,S] (1 on every real token). Optional:
`margin` [B] (reward models) and `ref_chosen_logps` / `ref_rejected_logps` [B] (precomputed
reference log-probabilities for DPO). Chosen and rejected run as one forward of [2B,S], chosen
first (as trl concatenates them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from parallel.tensor_parallel import tp_token_cross_entropy
from tokendata.datasets.samples import IGNORE_INDEX

SIDES = ("chosen", "rejected")
"""The two responses of a pair, in the order of the concatenated forward."""

PAIR_KEYS = tuple(
    f"{side}_{key}" for side in SIDES for key in ("input_ids", "loss_mask", "attention_mask")
)
"""Keys every pairwise micro-batch has."""


def check_pairwise(batch: dict[str, torch.Tensor], stage: str) -> None:
    """Refuse a batch that is not pairwise (e.g. token shards given to --stage rm/dpo)."""
    missing = [key for key in PAIR_KEYS if key not in batch]
    if missing:
        raise ValueError(
            f"--stage {stage} needs pairwise data (chosen/rejected: `meshline preprocess` with a "
            f"pairwise handler); this batch lacks {missing}"
        )


def concatenated(batch: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """`chosen_{key}` over `rejected_{key}`: [2B,S], chosen rows first."""
    return torch.cat([batch[f"chosen_{key}"], batch[f"rejected_{key}"]], dim=0)


def sequence_logps(
    logits_BSV: torch.Tensor, ids_BS: torch.Tensor, mask_BS: torch.Tensor
) -> torch.Tensor:
    """Summed log-probability [B] of the masked tokens, each predicted from the ones before it.

    The logits are taken in fp32 (as trl's fused head does): a sum over hundreds of tokens in
    bf16 loses the differences DPO is made of."""
    token_logps_BS = token_logps(logits_BSV, ids_BS)
    return (token_logps_BS * mask_BS[:, 1:].to(token_logps_BS.dtype)).sum(dim=1)


def token_logps(logits_BSV: torch.Tensor, ids_BS: torch.Tensor) -> torch.Tensor:
    """Log-probability [B,S-1] of each token after the first, predicted from the ones before it.

    Vocabulary-sharded logits (a DTensor under tensor parallelism) are never gathered: the
    loss-parallel cross entropy of the shifted ids is the negated log-probability (run inside
    the feed's `loss_parallel` context, as the loop does)."""
    if isinstance(logits_BSV, DTensor):
        labels_BS = F.pad(ids_BS[:, 1:], (0, 1), value=IGNORE_INDEX)
        return -tp_token_cross_entropy(logits_BSV, labels_BS)[:, :-1]
    logps_BSV = torch.log_softmax(logits_BSV[:, :-1].float(), dim=-1)
    return logps_BSV.gather(-1, ids_BS[:, 1:, None]).squeeze(-1)


def last_token_index(attention_mask_BS: torch.Tensor) -> torch.Tensor:
    """Index [B] of each row's last real token (rows are right-padded)."""
    return attention_mask_BS.long().sum(dim=1).clamp(min=1) - 1

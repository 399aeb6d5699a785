"""The datasets the trainer reads: GPT pretraining samples, instruction rows, blends, sampling.

config = DataConfig(data_path=["0.3", "out/a_text_document", "0.7", "out/b_text_document"])
train, valid, test = build_datasets(config, tokenizer, seq_length=2048, seed=1234,
                                    num_samples=(train_iters * global_batch, ..., ...))
sampler = PretrainingSampler(len(train), consumed, micro_batch_size, dp_rank, dp_size)
loader = DataLoader(train, batch_sampler=sampler, collate_fn=collate)
"""

from tokendata.datasets.blended import BlendedDataset, build_blending_indices
from tokendata.datasets.build import build_datasets
from tokendata.datasets.collate import collate
from tokendata.datasets.config import DataConfig, parse_data_path, parse_split
from tokendata.datasets.gpt import GPTDataset
from tokendata.datasets.gpt_index import build_gpt_indices
from tokendata.datasets.instruction import InstructionDataset
from tokendata.datasets.packing import first_fit
from tokendata.datasets.sampler import PretrainingSampler
from tokendata.datasets.samples import IGNORE_INDEX, TokenInfo
from tokendata.datasets.sources import (
    ArrowTokenSource,
    open_instruction,
    open_pretraining,
)

__all__ = [
    "IGNORE_INDEX",
    "ArrowTokenSource",
    "BlendedDataset",
    "DataConfig",
    "GPTDataset",
    "InstructionDataset",
    "PretrainingSampler",
    "TokenInfo",
    "build_blending_indices",
    "build_datasets",
    "build_gpt_indices",
    "collate",
    "first_fit",
    "open_instruction",
    "open_pretraining",
    "parse_data_path",
    "parse_split",
]

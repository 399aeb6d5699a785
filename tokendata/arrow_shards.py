"""Arrow IPC shards: the alternative to Megatron's `.bin/.idx`, split by size.

Each row is one document (one sample, or a pack of samples with `--pack`):

- `input_ids: list<int32>`: the tokens;
- `cu_seqlens: list<int32>`: sample boundaries inside the row, `[0, n1, n1 + n2, ..., len]`
  (document boundaries for packed training);
- instruction data only: `labels: list<int32>` (input ids, -100 where no loss) and
  `loss_mask: list<uint8>` (1 where labels carry loss).

Preference pairs (pairwise handlers) are rows of their own: one row per pair, no `input_ids`, with
`chosen_input_ids`, `chosen_labels`, `chosen_loss_mask` and the same three for `rejected`
(each side the prompt then its response; labels -100 and loss mask 0 on the prompt).

Pretraining writes one shard set per json key, `{prefix}_{key}_document-00000.arrow`, ...;
instruction data one set, `{prefix}_packed-00000.arrow`, ...; pairs one set,
`{prefix}_pairs-00000.arrow`, .... A new shard starts once the current
one passes `--arrow-shard-mb`. The schema's metadata (`meshline`) records the handler and keys.
The writer is the preprocess service's `ArrowSink` (services/preprocess/arrow_sink.py).
Files use the IPC *file* format (random access, `pyarrow.ipc.open_file`), one record batch per
`batch_rows` rows.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa


def read_arrow_shards(files: list[str | Path]) -> pa.Table:
    """All rows of a shard set, in order (a convenience for tests and inspection)."""
    tables = []
    for path in files:
        with pa.memory_map(str(path), "r") as source:
            tables.append(pa.ipc.open_file(source).read_all())
    return pa.concat_tables(tables)

"""`GeneralPretrainHandler`: plain text per `--json-keys` field, one document per record."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.preprocess.handlers.base import Handler, RecordError, Sample, require_text


class GeneralPretrainHandler(Handler):
    """Tokenises each `--json-keys` field into its own dataset; `--append-eod` ends documents.

    A document's ids are the tokenizer's own encoding with its default settings (transformers'
    `encode(text)`: BOS first where the tokenizer adds one), then the EOD id with `--append-eod`
    unless the tokenizer already ends every text with it (`add_eos_token`). Without
    `--append-eod`, empty documents (no text tokens) are dropped, as they would only add
    special-token-only entries to the index.
    """

    name = "GeneralPretrainHandler"

    def _finish(self, ids: list[int]) -> list[int]:
        tokenizer = self.tokenizer
        if not self.options.append_eod:
            empty = len(ids) <= len(tokenizer.prefix_ids) + len(tokenizer.suffix_ids)
            return [] if empty else ids
        ends_with_eod = tokenizer.suffix_ids[-1:] == (tokenizer.eod_id,)
        return ids if ends_with_eod else [*ids, tokenizer.eod_id]

    def process(self, record: dict[str, Any]) -> Sample | None:
        """Token ids of each json key of one record."""
        return self.process_batch([record])[0]  # type: ignore[return-value]

    def process_batch(self, records: Sequence[dict[str, Any]]) -> list[Sample | RecordError | None]:
        """Tokenise a batch with one native tokenizer call per json key."""
        keys = self.options.json_keys
        results: list[Sample | RecordError | None] = []
        texts: dict[str, list[str]] = {key: [] for key in keys}
        good: list[int] = []
        for index, record in enumerate(records):
            try:
                values = [require_text(record, key) for key in keys]
            except RecordError as exc:
                results.append(exc)
                continue
            results.append(None)
            good.append(index)
            for key, value in zip(keys, values, strict=True):
                texts[key].append(value)
        encoded = {
            key: self.tokenizer.encode_batch(texts[key], add_special_tokens=True) for key in keys
        }
        for position, index in enumerate(good):
            sample = {key: self._finish(encoded[key][position]) for key in keys}
            results[index] = sample if any(sample.values()) else None
        return results

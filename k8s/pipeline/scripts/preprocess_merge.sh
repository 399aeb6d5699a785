#!/bin/sh
# Pipeline stage 1b (Job "preprocess-merge", after every preprocess pod is done): joins the
# $MESHLINE_PREPROCESS_SHARDS shards under $PIPELINE_DIR/shards/corpus-shard-I-of-N into
# $PIPELINE_DIR/shards/corpus_text_document.bin/.idx (Megatron's merge_datasets behaviour: the
# same bytes one process over the whole corpus writes) with a manifest listing every part.
set -eu
shards=${MESHLINE_PREPROCESS_SHARDS:-1}
if [ "$shards" -le 1 ]; then
    echo "pipeline: one preprocess shard; it is already $PIPELINE_DIR/shards/corpus"
    exit 0
fi
exec meshline preprocess merge \
    --output-prefix "$PIPELINE_DIR/shards/corpus" \
    --num-shards "$shards" \
    --overwrite

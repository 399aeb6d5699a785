#!/bin/sh
# Pipeline stage 1, one pod of the Indexed Job "preprocess": token shards of $MESHLINE_CORPUS
# (a file, directory or glob) with the SentencePiece model $MESHLINE_TOKENIZER. The sorted input
# files are split into $MESHLINE_PREPROCESS_SHARDS contiguous, size-balanced shards; this pod
# (JOB_COMPLETION_INDEX, read by `meshline preprocess` itself) writes its shard under
# $PIPELINE_DIR/shards/corpus-shard-I-of-N, and the merge Job (preprocess_merge.sh) joins them.
#
# When neither corpus nor tokenizer exists, pod 0 first builds the demo corpus (the Python
# standard library's sources, as `make train` does, in $MESHLINE_DEMO_CORPUS_PARTS files) and
# trains the tokenizer on it, as stage "corpus"; the other pods wait for that stage.
set -eu
here=$(dirname "$0")
if [ "${1:-}" = corpus ]; then
    if [ ! -e "$MESHLINE_CORPUS" ]; then
        exec python "$here/demo_data.py" --corpus "$MESHLINE_CORPUS" \
            --tokenizer "$MESHLINE_TOKENIZER" --corpus-mb "${MESHLINE_DEMO_CORPUS_MB:-8}" \
            --parts "${MESHLINE_DEMO_CORPUS_PARTS:-12}"
    elif [ ! -e "$MESHLINE_TOKENIZER" ]; then
        echo "pipeline: corpus $MESHLINE_CORPUS exists but the tokenizer $MESHLINE_TOKENIZER does" \
            "not; put a SentencePiece .model there or point MESHLINE_TOKENIZER at one" >&2
        exit 2
    fi
    exit 0
fi
if [ "${JOB_COMPLETION_INDEX:-0}" = 0 ]; then
    sh "$here/stage.sh" run corpus sh "$0" corpus
else
    sh "$here/stage.sh" wait corpus
fi
exec meshline preprocess \
    --input "$MESHLINE_CORPUS" \
    --tokenizer-type SentencePiece \
    --tokenizer-model "$MESHLINE_TOKENIZER" \
    --append-eod \
    --workers "${MESHLINE_PREPROCESS_WORKERS:-2}" \
    --num-shards "${MESHLINE_PREPROCESS_SHARDS:-1}" \
    --output-prefix "$PIPELINE_DIR/shards/corpus" \
    --overwrite

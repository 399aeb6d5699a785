#!/bin/sh
# Orders the pipeline's Jobs through marker files on the shared volume, so that one
# `kubectl apply -k k8s/pipeline` can create all of them at once.
#
#   stage.sh wait STAGE...     block until every STAGE is done; exit 1 as soon as one has failed
#   stage.sh run STAGE CMD...  run CMD unless STAGE is already done for this run, then mark it
#
# Markers live in $PIPELINE_DIR/stages: STAGE.done (written atomically, by the Job's pod 0 only,
# after its command succeeded; by every pod when STAGE_EVERY_POD=1, for a per-pod STAGE such as
# preprocess-part-$(JOB_COMPLETION_INDEX)) or STAGE.failed (exit code and host). A done stage is skipped on
# the next apply, so a pipeline resumes where it stopped; a new PIPELINE_DIR starts afresh.
set -eu

usage() {
    echo "usage: stage.sh wait STAGE [STAGE...] | stage.sh run STAGE CMD [ARG...]" >&2
    exit 2
}

[ "$#" -ge 2 ] || usage
: "${PIPELINE_DIR:?set PIPELINE_DIR to the run directory on the shared volume}"
marks="$PIPELINE_DIR/stages"
mkdir -p "$marks"
action=$1
stage=$2
shift 2

case "$action" in
    wait)
        poll=${STAGE_POLL_SECONDS:-10}  # whole seconds (POSIX sh arithmetic)
        for stage in "$stage" "$@"; do
            waited=0
            while [ ! -e "$marks/$stage.done" ]; do
                if [ -e "$marks/$stage.failed" ]; then
                    echo "pipeline: stage $stage failed ($(cat "$marks/$stage.failed")); not" \
                        "starting. Fix it, delete its marker $marks/$stage.failed and the Jobs," \
                        "then apply again" >&2
                    exit 1
                fi
                if [ $((waited % 300)) -eq 0 ]; then
                    echo "pipeline: waiting for stage $stage (${waited}s)"
                fi
                sleep "$poll"
                waited=$((waited + poll))
            done
            echo "pipeline: stage $stage is done"
        done
        ;;
    run)
        [ "$#" -ge 1 ] || usage
        if [ -e "$marks/$stage.done" ]; then
            echo "pipeline: stage $stage already done in $PIPELINE_DIR; skipping"
            exit 0
        fi
        rm -f "$marks/$stage.failed"
        echo "pipeline: stage $stage starts: $*"
        code=0
        "$@" || code=$?
        if [ "$code" -ne 0 ]; then
            echo "exit code $code on $(hostname)" > "$marks/$stage.failed"
            echo "pipeline: stage $stage failed with exit code $code" >&2
            exit "$code"
        fi
        if [ "${JOB_COMPLETION_INDEX:-0}" = 0 ] || [ "${STAGE_EVERY_POD:-0}" = 1 ]; then
            date -u +%Y-%m-%dT%H:%M:%SZ > "$marks/$stage.done.tmp"
            mv "$marks/$stage.done.tmp" "$marks/$stage.done"
        fi
        echo "pipeline: stage $stage done"
        ;;
    *)
        usage
        ;;
esac

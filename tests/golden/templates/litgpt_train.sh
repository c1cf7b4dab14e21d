#!/bin/sh
# train.sh (onbox init litgpt): train.py under onbox's supervisor, detached from this shell and its SSH session.
#
#   ./train.sh [--key=value ...]       overrides for train.py (they become part of the run's recorded command)
#   onbox status lit-run            (also: onbox logs lit-run -f, onbox checkpoints lit-run)
#   onbox stop lit-run              checkpoint, commit, stop; ./train.sh again resumes
#
# The placeholders: set them here or export them before the first run.
#   DURABLE   storage that outlives the box: a mounted volume (/workspace/durable) or an rclone remote
#             (remote:bucket/dir). onbox commits every complete checkpoint there and restores from it.
#   CKPT_DIR  where train.py writes its checkpoints ($ONBOX_CKPT_DIR): the fast local disk (U8).
#   RUN_NAME  the run's name. After a preemption, run this script again: the run resumes from its newest
#             verified checkpoint (on a replacement box too, from DURABLE).
#   ONBOX     how onbox is started on this box: the one-file agent, python3 onbox.pyz.
# Keep this file's line ends LF (U26: a CRLF script fails in sh with "set: -: invalid option").
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
RUN_NAME=${RUN_NAME:-lit-run}
DURABLE=${DURABLE:-/workspace/durable}
CKPT_DIR=${CKPT_DIR:-$HERE/out/pretrain}
ONBOX=${ONBOX:-python3 $HOME/onbox.pyz}
PYTHON=${PYTHON:-python3}

# --resume-arg: onbox appends `--resume={ckpt}` to train.py's arguments, {ckpt} being the newest verified checkpoint,
# only when there is one to resume from.
# $ONBOX is a command line: left unquoted on purpose
exec $ONBOX run --name "$RUN_NAME" --ckpt-dir "$CKPT_DIR" --durable "$DURABLE" \
    --keep-last 3 --keep-best eval_loss:min --resume-arg=--resume={ckpt} \
    -- "$PYTHON" "$HERE/train.py" --config "$HERE/training_config.yaml" "$@"

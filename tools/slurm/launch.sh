# Shared body of the sbatch scripts in tools/slurm/ (sourced after they set their variables; not
# run on its own). Every variable can also be set in the environment of `sbatch`, which wins over
# the script's default (sbatch exports the submitting shell's environment):
#
#   LAUNCHER       torchrun: srun starts one torchrun per node, c10d rendezvous on the first host
#                  srun:     srun starts one task per GPU; pretrain_gpt.py reads SLURM_PROCID,
#                            SLURM_NTASKS, SLURM_LOCALID (MASTER_ADDR = first host of the job)
#   GPUS_PER_NODE  processes per node (one per GPU)
#   MODEL_ARGS DATA_ARGS LAYOUT_ARGS TRAIN_ARGS EXTRA_ARGS    pretrain_gpt.py flags
#   RUN_NAME       results under runs/$RUN_NAME/: checkpoints/, tensorboard/, metrics.jsonl
#                  (default: the job name, so a resubmitted job resumes too: give each
#                  experiment its own RUN_NAME or job name, or two runs share checkpoints)
#   SAVE_INTERVAL  iterations between checkpoints (also saved on exit)
#   LOG_INTERVAL   iterations between log lines / metrics records / straggler reports
#   REQUEUE        1: after a USR1/TERM (time limit near, pre-emption) the training saves, exits,
#                  and the job is requeued with `scontrol requeue` (needs #SBATCH --requeue)
#   MASTER_PORT    rendezvous port (default: derived from the job id)
#   PYTHON         interpreter with megatron_sp installed (default: python)
#   REPO           the checkout (default: the directory sbatch was called from)
set -euo pipefail
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$REPO"
PYTHON=${PYTHON:-python}
LAUNCHER=${LAUNCHER:-torchrun}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}
LOG_INTERVAL=${LOG_INTERVAL:-10}
REQUEUE=${REQUEUE:-1}
RUN_NAME=${RUN_NAME:-${SLURM_JOB_NAME:-megatron_sp}}
RUN_DIR=${RUN_DIR:-$REPO/runs/$RUN_NAME}
CKPT_DIR=${CKPT_DIR:-$RUN_DIR/checkpoints}
mkdir -p "$RUN_DIR"

NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
HEAD_NODE=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname)}" | head -n1)
MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
CPUS_PER_NODE=${SLURM_CPUS_ON_NODE:-$(nproc)}
export PYTHONUNBUFFERED=1                       # log lines reach the job log as they are printed

set -f                                          # flags are split on spaces, never globbed
ARGS=($MODEL_ARGS $DATA_ARGS $LAYOUT_ARGS $TRAIN_ARGS
      --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval "$SAVE_INTERVAL" --exit-signal-handler
      --log-interval "$LOG_INTERVAL" --metrics-jsonl "$RUN_DIR/metrics.jsonl"
      --tensorboard-dir "$RUN_DIR/tensorboard" ${EXTRA_ARGS:-})
set +f

echo "[$(date +%FT%T)] job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}) on $NNODES node(s)" \
     "${SLURM_JOB_NODELIST:-}, $GPUS_PER_NODE processes per node, launcher $LAUNCHER," \
     "rendezvous $HEAD_NODE:$MASTER_PORT, results in $RUN_DIR"

# Time limit near (#SBATCH --signal=B:USR1@...) or pre-emption (SIGTERM): ask every rank to save
# at the end of its current iteration and exit (--exit-signal-handler), then requeue below.
SIGNALLED=""
STEP_PID=""
on_signal() {
    SIGNALLED=$1
    echo "[$(date +%FT%T)] batch script got SIG$1: forwarding SIGUSR1 to the training step" \
         "(it saves a checkpoint at the end of this iteration and exits)"
    [[ -n "$STEP_PID" ]] && kill -s USR1 "$STEP_PID" 2>/dev/null || true
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

if [[ "$LAUNCHER" == torchrun ]]; then
    # torchrun forwards SIGUSR1 to its workers and gives them SHUTDOWN_TIMEOUT s to save.
    srun --ntasks-per-node=1 --cpus-per-task="$CPUS_PER_NODE" --cpu-bind=none --kill-on-bad-exit=1 \
        "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
        --rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:$MASTER_PORT" --rdzv-id "${SLURM_JOB_ID:-0}" \
        --max-restarts 0 --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
        --shutdown-timeout "${SHUTDOWN_TIMEOUT:-600}" \
        pretrain_gpt.py "${ARGS[@]}" &
elif [[ "$LAUNCHER" == srun ]]; then
    export MASTER_ADDR=$HEAD_NODE MASTER_PORT
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CPUS_PER_NODE / GPUS_PER_NODE > 0 ? CPUS_PER_NODE / GPUS_PER_NODE : 1 ))}
    srun --ntasks-per-node="$GPUS_PER_NODE" --cpus-per-task=$(( CPUS_PER_NODE / GPUS_PER_NODE > 0 ? CPUS_PER_NODE / GPUS_PER_NODE : 1 )) \
        --kill-on-bad-exit=1 "$PYTHON" pretrain_gpt.py "${ARGS[@]}" &
else
    echo "error: LAUNCHER must be torchrun or srun, got '$LAUNCHER'" >&2
    exit 2
fi
STEP_PID=$!
# A trapped signal interrupts `wait`: keep waiting until the step has really ended.
set +e
wait "$STEP_PID"
while kill -0 "$STEP_PID" 2>/dev/null; do wait "$STEP_PID"; done
wait "$STEP_PID"
RC=$?
set -e
echo "[$(date +%FT%T)] training step ended with exit code $RC"

# A run that already reached --train-iters is not requeued, even if a signal came at its end.
TRAIN_ITERS=$(printf '%s\n' "${ARGS[@]}" | grep -A1 -x -e --train-iters | tail -n1)
LATEST=$(cat "$CKPT_DIR/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)
FINISHED=0
[[ -n "$TRAIN_ITERS" && "$LATEST" =~ ^[0-9]+$ && "$LATEST" -ge "$TRAIN_ITERS" ]] && FINISHED=1
if [[ -n "$SIGNALLED" && "$REQUEUE" == 1 && -n "${SLURM_JOB_ID:-}" && "$FINISHED" == 0 ]]; then
    echo "[$(date +%FT%T)] requeueing job $SLURM_JOB_ID: it resumes from $CKPT_DIR"
    scontrol requeue "$SLURM_JOB_ID" || echo "warning: scontrol requeue failed (is --requeue set?)"
fi
exit "$RC"

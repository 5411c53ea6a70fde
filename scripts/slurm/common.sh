# Sourced by the sbatch launchers: NCCL and runtime settings for H100/H200 clusters.
export CUDA_DEVICE_MAX_CONNECTIONS=1      # Megatron's TP comm/compute overlap needs one hardware queue
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export NCCL_ASYNC_ERROR_HANDLING=1        # a failed collective aborts the job instead of hanging it
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# A collective that times out dumps every rank's recent collectives (NCCL's flight recorder) beside the job, which
# tells the rank that stopped calling them, and where: a stuck rank otherwise shows only as everyone's timeout.
export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-.cache/nccl_trace/rank_}
mkdir -p "$(dirname "$TORCH_NCCL_DEBUG_INFO_TEMP_FILE")"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLink multicast off unless the fabric is known good
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export MEGARL_RDZV_PORT=${MEGARL_RDZV_PORT:-29500}
# srun does not inherit the batch job's --cpus-per-task (Slurm 22.05 on): without this, clusters that bind tasks to
# CPUs would run torchrun, its workers, the engines and the reward workers on one core per node.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-$SLURM_CPUS_PER_TASK}; fi
# Compiled kernels (torch.compile's FlexAttention in the trainer, Triton kernels in the engines) cached beside the job
# rather than in each node's /tmp or home directory, so a requeued job or the next run does not compile them again (an H200's first
# step: 25.7 s of scoring and 11.5 s of generation on a fresh machine, 5.5 s and 3.4 s with the caches warm).
# Relative: the job's directory on bare metal and /workspace, the same directory, inside the containers.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-.cache/torchinductor}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-.cache/triton}
mkdir -p "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR"

# Slurm sends USR1 to this batch shell 10 minutes before the time limit (the launchers' --signal=B:USR1@600), and
# before a preemption only where the cluster sets PreemptParameters=send_user_signal; otherwise a preemption sends
# SIGTERM, which stops the trainer without a checkpoint, and the requeued job resumes from the last periodic one
# (checkpoint.save_every). train_until_signal runs the job step in the background, turns the
# signal into the trainer's stop file (checkpoint.stop_file: save after the current step, exit 0) and
# requeues the job, which resumes from that checkpoint (checkpoint.resume: auto).
export MEGARL_STOP_FILE=${MEGARL_STOP_FILE:-logs/megarl-${SLURM_JOB_ID:-local}.stop}
train_until_signal() {
  local stop_asked=0 pid rc
  # A requeued job keeps its id, so the stop file of a signal its last run never acknowledged would stop this run
  # after one step, as COMPLETED.
  rm -f "$MEGARL_STOP_FILE"
  trap 'stop_asked=1; echo "megarl: USR1 from Slurm: checkpoint after this step, then requeue"; touch "$MEGARL_STOP_FILE"' USR1
  "$@" --set checkpoint.stop_file="$MEGARL_STOP_FILE" &
  pid=$!
  while true; do
    rc=0
    wait "$pid" || rc=$?
    kill -0 "$pid" 2>/dev/null || break  # still running: wait was only interrupted by the signal
  done
  trap - USR1
  # The trainer deletes the stop file once it has saved for it: one still there came after the run's last step,
  # and a requeue would train the finished run again.
  if [ "$stop_asked" = 1 ] && [ "$rc" = 0 ] && [ -e "$MEGARL_STOP_FILE" ]; then
    echo "megarl: the run finished its last step before it read the stop request: not requeued"
    rm -f "$MEGARL_STOP_FILE"
  elif [ "$stop_asked" = 1 ] && [ "$rc" = 0 ] && [ -n "${SLURM_JOB_ID:-}" ] && [ "${MEGARL_REQUEUE:-1}" = 1 ]; then
    requeue_job "$SLURM_JOB_ID" || rc=$?
  fi
  return "$rc"
}

# scontrol requeue, asked again while it fails: a slurmctld busy with a large cluster's preemptions drops or times out
# clients, and a requeue lost there would end a job whose checkpoint is saved. After the last try: one paragraph that
# says the checkpoint is safe and what to do, and exit 1 (the job ends FAILED rather than COMPLETED, to be noticed).
requeue_job() {
  local job=$1 tries=${MEGARL_REQUEUE_TRIES:-5} delay=${MEGARL_REQUEUE_DELAY:-5} i out
  for ((i = 1; i <= tries; i++)); do
    if out=$(scontrol requeue "$job" 2>&1); then
      return 0
    fi
    echo "megarl: scontrol requeue $job failed (try $i of $tries): $out" >&2
    ((i < tries)) && sleep $((delay * i))
  done
  echo "megarl error: the run saved its checkpoint and stopped, but Slurm did not requeue job $job ($tries tries of" \
    "'scontrol requeue $job'; the last said: $out). Fix: submit the job again with the same checkpoint.dir; it" \
    "resumes from that checkpoint (checkpoint.resume: auto)." >&2
  return 1
}

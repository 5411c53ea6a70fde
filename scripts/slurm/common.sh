# Sourced by the sbatch launchers: NCCL and runtime settings for H100/H200 clusters.
export CUDA_DEVICE_MAX_CONNECTIONS=1      # Megatron's TP comm/compute overlap needs one hardware queue
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export NCCL_ASYNC_ERROR_HANDLING=1        # a failed collective aborts the job instead of hanging it
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLink multicast off unless the fabric is known good
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export MEGARL_RDZV_PORT=${MEGARL_RDZV_PORT:-29500}

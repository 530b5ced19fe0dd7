#!/usr/bin/env bash
# Launch a megamoe job on every local GPU (or 2 CPU ranks with gloo when there is none):
#   launch/ep.sh [module] [args...]      e.g.  launch/ep.sh megamoe.bench --preset pro
# Keeps NVLink multicast off (shared hosts) and passes the rest to the module.
set -euo pipefail
module=${1:-megamoe.bench}
shift || true
ngpu=$(python -c 'import torch; print(torch.cuda.device_count())')
nproc=${NPROC:-$(( ngpu > 0 ? ngpu : 2 ))}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec torchrun --standalone --nproc-per-node "$nproc" -m "$module" "$@"

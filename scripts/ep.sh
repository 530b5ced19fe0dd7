#!/usr/bin/env bash
# Launch a megamoe job on every local GPU (or 2 CPU ranks with gloo when there is none):
#   scripts/ep.sh [module] [args...]     e.g.  scripts/ep.sh megamoe.bench --preset pro
# Keeps NVLink multicast off (shared hosts) and passes the rest to the module. $PYTHON (default: python) runs it,
# with torchrun's module (torch.distributed.run): no torchrun on PATH needed.
set -euo pipefail
module=${1:-megamoe.bench}
shift || true
python=${PYTHON:-python}
ngpu=$("$python" -c 'import torch; print(torch.cuda.device_count())')
nproc=${NPROC:-$(( ngpu > 0 ? ngpu : 2 ))}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec "$python" -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m "$module" "$@"

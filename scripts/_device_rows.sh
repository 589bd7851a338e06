#!/usr/bin/env bash
# Restore to first token, one row per way an engine holds device memory (bench/restore_rows.py): PyTorch's default
# allocator, expandable_segments:True, backend:cudaMallocAsync, the JAX server (XLA's BFC pool growing; and XLA's
# platform allocator, no pool), the two-process server (engines/split_server.py: a front end and its engine core),
# each unchanged under the CUDA interposer with the node hydrator, 3 restores each;
# the uvicorn-on-uvloop row read from its recorded bench/e2e_serve.py run. CRIU under .device-criu, wheels under .whl.
#   scripts/device rows [--sizes 2,16] [--restores 3]
#                       [--rows torch,torch-expandable,torch-async,jax,jax-platform,split] [--no-hydrator]
# Expected: ~6-8 min at 2 and 16 GiB; each row prints its identical outputs and the share of device bytes moved
# at line rate; should it not fit, run `--sizes 16` alone.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1
python3 bench/restore_rows.py --criu "$(command -v criu)" --out "$OUT" "$@"

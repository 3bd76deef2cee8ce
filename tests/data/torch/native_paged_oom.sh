#!/bin/sh
# native_paged_oom_2.12.1.pickle: reservoir's own allocator under PyTorch
# 2.12.1 on the simulated device (8 GiB), policy:native_paged, the fourth of
# tests/torch/oracle.py's programs of seed 5 run through out-of-memory
# errors. Run with PyTorch 2.12.1 importable and the simulated device
# preloaded, as tests/torch/pypi_run.py sets them up for torch_2.12.1_release:
#   native_paged_oom.sh OUT_DIR   (writes OUT_DIR/p0003.pickle among four)
set -e
RESERVOIR_SIMCUDA_MEMORY=8GiB RESERVOIR_ALLOC_CONF=policy:native_paged PYTORCH_CUDA_ALLOC_CONF= \
  python3 -W ignore "$(dirname "$0")/../../torch/oracle.py" "$1" 5 4 --own --oom

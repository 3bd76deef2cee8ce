#!/usr/bin/env bash
# On a GPU machine: runs the GPU bundle (make gpu-bundle builds it, on any
# machine with our development packages; docs/integrations.md says how to
# carry it over). Arguments go to its run.sh: [OUTDIR] [--only STEP,...] [--budget S].
#
#   scripts/gpu_check.sh [OUTDIR] [...]
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=${RESERVOIR_GPU_BUNDLE:-build/gpu-bundle}
if [ ! -x "$bundle/run.sh" ]; then
  echo "gpu_check: no bundle at $bundle: run 'make gpu-bundle' first (or set RESERVOIR_GPU_BUNDLE)" >&2
  exit 2
fi
exec "$bundle/run.sh" "${@:-gpu-check-results}"

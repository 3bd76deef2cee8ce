#!/usr/bin/env bash
# The reservoir GPU bundle: runs every GPU proof on this machine, most
# important first, and writes OUTDIR/log.txt, OUTDIR/results.json and
# OUTDIR/summary.txt (README.txt beside this file says more).
#
#   ./run.sh [OUTDIR] [--only STEP,...] [--budget SECONDS]
#
# Exit status: 0 every step passed; 1 a step failed; 2 the bundle or its
# arguments are unusable; 77 no GPU found (the checks that need none passed).
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$PWD/gpu-bundle-results}
case "$out" in -*) out=$PWD/gpu-bundle-results ;; *) shift ;; esac
# A bare environment (env -i) still finds the system's programs.
export PATH=${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}
export LC_ALL=${LC_ALL:-C.UTF-8} PYTHONUNBUFFERED=1
py=
for c in "${RESERVOIR_PYTHON:-}" python3 /usr/bin/python3 python3.12; do
  [ -n "$c" ] || continue
  if command -v "$c" >/dev/null 2>&1 &&
     "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 8) else 1)' 2>/dev/null; then
    py=$(command -v "$c"); break
  fi
done
if [ -z "$py" ]; then
  echo "run.sh: no Python 3.8 or later found (python3 on PATH, or RESERVOIR_PYTHON): the bundle's driver needs one" >&2
  exit 2
fi
mkdir -p "$out" || { echo "run.sh: cannot create $out" >&2; exit 2; }
exec "$py" "$here/run_steps.py" "$out" "$@"

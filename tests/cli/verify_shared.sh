#!/bin/sh
# Runs `reservoir verify` on every real PyTorch snapshot in ../shared/traces;
# exits 77 (skipped) when that folder holds none.
cli="$1"; dir="$2"
set -- "$dir"/*.pickle
if [ ! -e "$1" ]; then echo "no traces in $dir: skipped"; exit 77; fi
out=$("$cli" verify "$@") || { echo "$out"; echo "reservoir verify failed"; exit 1; }
echo "$out"
agreed=$(echo "$out" | grep -c "agrees with the recording")
[ "$agreed" -eq "$#" ] || { echo "$agreed of $# traces agreed"; exit 1; }

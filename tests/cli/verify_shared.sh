#!/bin/sh
# Runs `reservoir verify` on every real PyTorch snapshot in ../shared/traces
# and its oom/ folder; exits 77 (skipped) when there are none.
cli="$1"; dir="$2"
set --
for f in "$dir"/*.pickle "$dir"/oom/*.pickle; do [ -e "$f" ] && set -- "$@" "$f"; done
if [ $# -eq 0 ]; then echo "no traces in $dir: skipped"; exit 77; fi
out=$("$cli" verify "$@") || { echo "$out"; echo "reservoir verify failed"; exit 1; }
echo "$out"
agreed=$(echo "$out" | grep -c "agrees with the recording")
[ "$agreed" -eq "$#" ] || { echo "$agreed of $# traces agreed"; exit 1; }

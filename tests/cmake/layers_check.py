"""The layers are enforced by the build: each layer's library sees the public
headers of its own layer and the layers below it, and none above.

For each layer, with the include directories CMake gives that layer's target
(from $<TARGET_PROPERTY>), the headers of that layer and of the layers it
stands on must compile, and no other layer's header may be found.

Usage: layers_check.py COMPILER SOURCE_DIR LAYER:BELOW,BELOW...=DIR;DIR...
"""
import pathlib
import subprocess
import sys
import tempfile

compiler, source = sys.argv[1], pathlib.Path(sys.argv[2])
layers = []
for arg in sys.argv[3:]:
    spec, dirs = arg.split("=", 1)
    name, _, below = spec.partition(":")
    layers.append((name, set(filter(None, below.split(","))) | {name}, dirs))
if not layers:
    sys.exit("no layers given")


def headers(layer):
    root = source / "src" / layer / "include"
    found = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.h*"))
    if not found:
        sys.exit(f"layer {layer}: no public headers under {root}")
    return found


def check(layer, visible, dirs):
    """One compile: every visible header included, every other one absent."""
    seen = [h for other, _, _ in layers if other in visible for h in headers(other)]
    hidden = [h for other, _, _ in layers if other not in visible for h in headers(other)]
    lines = [f'#include "{h}"' for h in seen]
    lines += [f'#if __has_include("{h}")\n#error "{h} is reachable from {layer}"\n#endif' for h in hidden]
    with tempfile.NamedTemporaryFile("w", suffix=".cpp") as probe:
        probe.write("\n".join(lines) + "\n")
        probe.flush()
        flags = [f"-I{d}" for d in dirs.split(";") if d]
        run = subprocess.run([compiler, "-std=c++20", "-fsyntax-only", *flags, probe.name],
                             capture_output=True, text=True)
    print(f"{layer}: sees the {len(seen)} headers of {', '.join(sorted(visible))}; "
          f"not the other {len(hidden)}")
    return run.returncode == 0, run.stderr


failures = []
for layer, visible, dirs in layers:
    ok, err = check(layer, visible, dirs)
    if not ok:
        failures.append(f"{layer}:\n{err}")
if failures:
    sys.exit("\n".join(failures))

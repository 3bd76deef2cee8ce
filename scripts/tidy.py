"""clang-tidy (the committed .clang-tidy) on reservoir's sources.

Usage: tidy.py BUILD_DIR BASE [JOBS]
  BASE: a commit, to check the sources changed since it (a changed header
        brings in the sources that include it), or "all".
BUILD_DIR must hold compile_commands.json (make clang configures one).
Exits non-zero when clang-tidy reports anything (warnings are errors).
"""
import json
import os
import pathlib
import re
import subprocess
import sys

build, base = sys.argv[1], sys.argv[2]
jobs = sys.argv[3] if len(sys.argv) > 3 else "2"
root = pathlib.Path(__file__).resolve().parent.parent
db = json.loads((pathlib.Path(build) / "compile_commands.json").read_text())
ours = re.compile(r"^(src|tools|tests)/")
units = sorted({os.path.relpath(e["file"], root) for e in db
                if ours.match(os.path.relpath(e["file"], root)) and e["file"].endswith((".cpp", ".c"))})

if base == "all":
    chosen = units
else:
    changed = subprocess.run(["git", "diff", "--name-only", base, "HEAD"], cwd=root,
                             capture_output=True, text=True, check=True).stdout.split()
    changed = [f for f in changed if ours.match(f) and (root / f).exists()]
    headers = {pathlib.Path(f).name for f in changed if f.endswith((".hpp", ".h"))}
    chosen = []
    for unit in units:
        if unit in changed:
            chosen.append(unit)
        elif headers:
            text = (root / unit).read_text(errors="replace")
            if any(re.search(r'#include [<"](?:[\w/]*/)?' + re.escape(h) + r'[>"]', text) for h in headers):
                chosen.append(unit)

if not chosen:
    print(f"tidy: no sources changed since {base}")
    sys.exit(0)
print(f"tidy: {len(chosen)} sources" + ("" if base == "all" else f" (changed since {base[:12]})"))
pattern = "^" + str(root) + "/(" + "|".join(re.escape(u) for u in chosen) + ")$"
run = subprocess.run(["run-clang-tidy", "-p", build, "-j", jobs, "-quiet", pattern], cwd=root,
                     capture_output=True, text=True)
findings = [l for l in run.stdout.splitlines() + run.stderr.splitlines()
            if re.search(r"(warning|error):", l)]
for line in findings:
    print(line)
if run.returncode != 0 or findings:
    sys.exit(f"tidy: {len(findings)} findings in {len(chosen)} sources")
print("tidy: clean")

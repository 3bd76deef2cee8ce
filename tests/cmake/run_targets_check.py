"""`make run` builds what it runs and nothing else: after `make run` into a
fresh build folder, the folder holds the command-line tool and the libraries
it links, and no object of a test, benchmark, fuzz target, the simulated CUDA
device, the Python module or the PyTorch plug-in; the run's output names
the pages it wrote, fits 100 columns a line and ends with where to look next
(README.md, "What `make run` shows"). (.ci/run runs it with RESERVOIR_PYPI_CACHE pointed at an
empty folder, so that a run that wanted anything from PyPI fails.)

Usage: run_targets_check.py BUILD_DIR RUN_OUTPUT_FILE
"""
import os
import sys

build, output = sys.argv[1], sys.argv[2]
problems = []

binaries = sorted(os.listdir(os.path.join(build, "bin")))
if binaries != ["reservoir"]:
    problems.append(f"bin/ holds {binaries}, not the tool alone")
# The libraries the tool links (tools/CMakeLists.txt, src/CMakeLists.txt).
LINKED = {"libreservoir_base.a", "libreservoir_device.a", "libreservoir_allocator.a", "libreservoir_saver.a",
          "libreservoir_trace.a", "libreservoir_capi.a", "libreservoir_views.a"}
libraries = set(os.listdir(os.path.join(build, "lib")))
if libraries - LINKED:
    problems.append(f"lib/ holds what the tool does not link: {sorted(libraries - LINKED)}")

# Objects compiled, by the CMake target that owns them.
built = {}
for root, _, files in os.walk(build):
    objects = [f for f in files if f.endswith(".o")]
    if objects and ".dir" in root:
        target = root.split(os.sep + "CMakeFiles" + os.sep, 1)[-1].split(".dir", 1)[0]
        built[target] = built.get(target, 0) + len(objects)
TOOL_TARGETS = {"reservoir_cli", "reservoir_views", "reservoir_base", "reservoir_device", "reservoir_allocator",
                "reservoir_saver", "reservoir_trace", "reservoir_capi"}
extra = sorted(t for t in built if t not in TOOL_TARGETS)
if extra:
    problems.append(f"objects of targets the run does not need: {extra}")
if "reservoir_cli" not in built:
    problems.append("no object of the tool itself (reservoir_cli) was built")

with open(output, errors="replace") as f:
    text = f.read()
for page in ("advice.html", "report.html"):
    if os.path.join(build, page) not in text or not os.path.isfile(os.path.join(build, page)):
        problems.append(f"the run did not write and name {os.path.join(build, page)}")

# README.md, "What `make run` shows": every line the run prints fits 100
# columns, and it ends with where to look next.
run_lines = text[text.find("== Replaying"):].splitlines() if "== Replaying" in text else []
if not run_lines:
    problems.append("the run printed no \"== Replaying\" line")
wide = [line for line in run_lines if len(line) > 100]
if wide:
    problems.append(f"{len(wide)} line(s) of the run wider than 100 columns, the first: {wide[0]!r}")
headers = [line for line in run_lines if line.startswith("== ")]
if not headers or headers[-1] != "== Where to look next":
    problems.append(f"the run does not end with where to look next (its last section: {headers[-1:]})")

if problems:
    print("make run builds more or less than it runs:\n  " + "\n  ".join(problems))
    sys.exit(1)
print(f"make run built {sum(built.values())} objects of {len(built)} targets, the tool alone; "
      f"wrote advice.html and report.html")

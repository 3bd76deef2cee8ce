"""Every benchmark command docs/benchmarks.md shows runs as shown, briefly,
so that none rots: the commands are read from the page itself (each
backticked span, a line or several, that runs a program of build/bin/ or a
script of bench/), never copied here.

Each runs from the source folder as the page writes it, with `build/` read
as the build folder given, `<torch site>` and the PyPI cache's folder of
the newest PyTorch as the --torch-site given, and options appended that make
it brief (the last occurrence of an option wins, in Google Benchmark as in
argparse): one repetition of a hundredth of a second for a Google Benchmark
program, small counts for the Python scripts. It must exit 0 and print
something that looks like its figures. Commands for the GPU (the bundle's
gpu_bench, or a command naming build/gpu-bundle) are the bundle's checks.

usage: benchmarks_doc_test.py --source DIR --build DIR --torch-site SITE [--list]
"""
import argparse
import os
import re
import shlex
import subprocess
import sys

BRIEF_GBENCH = ["--benchmark_min_time=0.01", "--benchmark_repetitions=1", "--benchmark_min_warmup_time=0",
                "--benchmark_report_aggregates_only=false"]
# The Python benchmarks' own options, for a run of a few seconds.
BRIEF_SCRIPTS = {
    "bench/torch_service.py": ["--requests", "12", "--explained", "2", "--timeout", "300"],
    "bench/torch_recording_bench.py": ["--pairs", "2000", "--steps", "4", "--repetitions", "1"],
    "bench/vllm_sleep_bench.py": ["--weights-mib", "48", "--blocks", "4", "--kv-mib", "16", "--cycles", "2",
                                  "--repetitions", "1"],
}
# What a run prints when it measured something.
FIGURES = {
    # A Google Benchmark row: name, time, CPU time, iterations.
    "gbench": re.compile(r"^\S+\s+[0-9.]+ (ns|us|ms|s)\s+[0-9.]+ (ns|us|ms|s)\s+[0-9]+", re.M),
    "bench/torch_service.py": re.compile(r"served|requests", re.I),
    "bench/torch_recording_bench.py": re.compile(r"^pair \(us per pair\)\s+[0-9.]+", re.M),
    "bench/vllm_sleep_bench.py": re.compile(r"^reservoir\s+[0-9.]+ ms\s+[0-9.]+ ms", re.M),
}
PROGRAM = re.compile(r"(?:^|\s)((?:build/bin/\w+_bench)|(?:bench/\w+\.py))(?=\s|$)")


def commands(page):
    """The distinct commands of the page, in its order, whitespace folded."""
    found = []
    # Fenced blocks: each command a line, with its backslash continuations.
    spans = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", page, re.M | re.S):
        spans += [c for c in re.sub(r"\\\n", " ", block).split("\n") if c.strip()]
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", page, flags=re.M | re.S)
    for span in spans + re.findall(r"`([^`]+)`", prose):
        text = " ".join(span.split()).replace("<torch site>", "<torch-site>")
        if text.startswith("...") or "gpu-bundle" in text or not PROGRAM.search(text):
            continue
        words = shlex.split(text)
        # A command: environment assignments, perhaps taskset, then the
        # program (`build/bin/X`, or python3 with a script of bench/).
        i = 0
        while i < len(words) and re.match(r"^[A-Z_][A-Z0-9_]*=", words[i]):
            i += 1
        if i < len(words) and words[i] == "taskset":
            i += 3
        if i >= len(words):
            continue
        head = words[i]
        if head in ("python3", "/usr/bin/python3") and i + 1 < len(words) and words[i + 1].startswith("bench/"):
            pass
        elif not re.fullmatch(r"build/bin/\w+_bench", head):
            continue
        if head.endswith("gpu_bench"):
            continue
        if text not in found:
            found.append(text)
    return found


def localized(text, build, torch_site):
    text = text.replace("<torch-site>", torch_site)
    text = re.sub(r"\$HOME/\.cache/reservoir/pypi/torch-[0-9.]+", torch_site, text)
    return re.sub(r"(?<![\w/.$-])build/", build.rstrip("/") + "/", text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--build", required=True)
    ap.add_argument("--torch-site", required=True)
    ap.add_argument("--list", action="store_true", help="print the commands found, run none")
    args = ap.parse_args()
    with open(os.path.join(args.source, "docs", "benchmarks.md"), encoding="utf-8") as f:
        page = f.read()
    found = commands(page)
    if args.list:
        print("\n".join(found))
        return 0
    if not found:
        print("FAIL  docs/benchmarks.md shows no benchmark command")
        return 1
    failures = []
    for text in found:
        script = next((s for s in BRIEF_SCRIPTS if s in shlex.split(text)), None)
        brief = BRIEF_SCRIPTS[script] if script else BRIEF_GBENCH
        line = localized(text, os.path.abspath(args.build), args.torch_site) + " " + shlex.join(brief)
        print(f"$ {line}", flush=True)
        r = subprocess.run(["bash", "-c", line], cwd=args.source, capture_output=True, text=True, timeout=600)
        out = r.stdout + r.stderr
        figures = FIGURES[script or "gbench"].search(out)
        ok = r.returncode == 0 and figures is not None
        print(("ok    " if ok else "FAIL  ") + text, flush=True)
        if not ok:
            why = f"exit {r.returncode}" if r.returncode else "no figures printed"
            print(f"      {why}; its output's end:\n" + out[-3000:], flush=True)
            failures.append(text)
    print(f"{len(found) - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

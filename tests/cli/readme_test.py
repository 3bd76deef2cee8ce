"""README.md's sections, run as a newcomer runs them, so that the text cannot
drift from what the commands do. The code and commands are read from the
README itself (its fenced blocks, by section), not copied here:

- "What `make run` shows": every `build/bin/reservoir SUBCOMMAND ...` line
  names a subcommand and options that `reservoir SUBCOMMAND --help` lists,
  the completion line prints a script, and the exit statuses the text gives
  are the ones `reservoir --help` gives.
- "My job runs out of memory": the RESERVOIR_EXPLAIN_OOM=1 line (a program
  that runs out of memory from fragmentation in place of `torchrun ...
  train.py`, on the simulated device) puts at most eight lines after
  PyTorch's message, the same lines on stderr first, and a pair of files
  into ./reservoir-oom, which `reservoir advise reservoir-oom/` then reads;
  the Python block (the history, the steps, the dump) writes oom.pickle, the
  observer line dumps it at the moment of the error, and the advise line
  reads it and names the setting that fits.
- "Using the library": the C++ blocks, as written, compiled against an
  install tree with find_package(reservoir) and run.
- "The real PyTorch, without a GPU": the command line, with a train.py.

usage: readme_test.py --source DIR --build DIR --torch-site SITE
"""
import argparse
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

failures = []

# Runs out of memory from fragmentation on a 1 GiB simulated device
# (tests/torch/scenarios.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch"))
from scenarios import FRAGMENTED_REQUEST as FAIL, FRAGMENTING_STEPS  # noqa: E402

STEPS = "MiB = 1 << 20\n" + FRAGMENTING_STEPS


def check(condition, what):
    print(("ok    " if condition else "FAIL  ") + what, flush=True)
    if not condition:
        failures.append(what)


def section(readme, title):
    match = re.search(r"^## " + re.escape(title) + r"\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    if match is None:
        sys.exit(f"README.md has no section {title!r}")
    return match.group(1)


def blocks(text, language=None):
    found = re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)
    return [body for lang, body in found if language is None or lang == language]


def run(cmd, env, cwd, timeout=600):
    print("$ " + (cmd if isinstance(cmd, str) else " ".join(cmd)), flush=True)
    return subprocess.run(cmd, env=env, cwd=cwd, text=True, capture_output=True, timeout=timeout,
                          shell=isinstance(cmd, str), executable="/bin/bash" if isinstance(cmd, str) else None)


def tool_section(readme, reservoir, work):
    text = section(readme, "What `make run` shows")
    lines = [x for b in blocks(text, "sh") for x in b.splitlines() if x.strip()]
    check(len(lines) >= 8, f"the command summary lists the subcommands ({len(lines)} lines)")
    helps = {}
    for line in lines:
        command = line.split("#")[0].strip()
        if command.startswith("source <("):
            inner = command[len("source <("):].rstrip(")")
            r = run(inner.replace("build/bin/reservoir", reservoir), dict(os.environ), work)
            check(r.returncode == 0 and "complete" in r.stdout, f"{inner!r} prints a completion script")
            continue
        words = command.split()
        check(words[0] == "build/bin/reservoir", f"{command!r} runs the tool as make builds it")
        sub = words[1]
        if sub not in helps:
            r = run([reservoir, sub, "--help"], dict(os.environ), work)
            check(r.returncode == 0, f"reservoir {sub} --help exits 0")
            helps[sub] = r.stdout
        for option in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", command):
            check(re.search(r"(?<![\w-])" + re.escape(option) + r"\b", helps[sub]) is not None,
                  f"reservoir {sub}: the README's {option} is an option of the command")
    r = run([reservoir, "--help"], dict(os.environ), work)
    statuses = re.search(r"exit statuses are the same\s+for every subcommand: (.*?) \(`reservoir --help`\)",
                         text, re.S)
    check(statuses is not None, "the exit statuses are given")
    if statuses:
        for code, meaning in re.findall(r"(\d) ([a-z ]+?)(?:,|$)", " ".join(statuses.group(1).split())):
            first = meaning.split()[0]
            check(re.search(rf"\b{code}\b[^;.]*\b{first}", " ".join(r.stdout.split())) is not None,
                  f"exit status {code} ({meaning}) is the one `reservoir --help` gives")


def installed(build, torch_site, work):
    """An environment with the package installed as pip installs it (its
    folder and its .pth in site-packages, linked from the build tree) and
    PyTorch beside it: the switch is read by that .pth at start-up, which a
    package on PYTHONPATH never is. Returns its python."""
    venv = os.path.join(work, "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    vpy = os.path.join(venv, "bin", "python")
    site = subprocess.run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    package = os.path.join(build, "python")
    for entry in ("reservoir", "reservoir_torch.py", "reservoir_autoinstall.pth"):
        if os.path.exists(os.path.join(package, entry)):
            os.symlink(os.path.join(package, entry), os.path.join(site, entry))
    with open(os.path.join(site, "pypi-torch.pth"), "w") as f:
        f.write(torch_site + "\n")
    return vpy


def oom_section(readme, reservoir, device_env, work, vpy):
    text = section(readme, "My job runs out of memory")
    sh = blocks(text, "sh")
    python = blocks(text, "python")
    check(len(sh) == 2 and len(python) == 1, f"two command blocks and one Python block ({len(sh)}, {len(python)})")

    # The switch: the first command, with a program of ours for the job.
    switch = sh[0].split("#")[0].strip()
    check(switch.startswith("RESERVOIR_EXPLAIN_OOM=1 torchrun "), f"the switch is an environment variable: {switch!r}")
    train = os.path.join(work, "train.py")
    with open(train, "w") as f:
        f.write("import torch\n" + STEPS + FAIL + "\n")
    command = switch.split(" torchrun ")[0] + f" {vpy} train.py"
    r = run(command, {k: v for k, v in device_env.items() if k != "PYTHONPATH"}, work)
    check(r.returncode != 0 and "torch.OutOfMemoryError: CUDA out of memory." in r.stderr,
          f"{command!r}: the program still ends with PyTorch's error (exit {r.returncode})")
    message = r.stderr[r.stderr.find("torch.OutOfMemoryError: "):]
    answer = [x for x in message.splitlines() if x.startswith("reservoir")]
    check(1 <= len(answer) <= 8, f"at most eight lines after PyTorch's message: {len(answer)}")
    check(answer and answer[0].startswith("reservoir: out of memory on a 500.00 MiB request: fragmentation"),
          f"the first line says why: {answer[:1]}")
    before = r.stderr[:r.stderr.find("torch.OutOfMemoryError: ")]
    check(answer and all(x in before for x in answer), "the same lines went to stderr first")
    folder = os.path.join(work, "reservoir-oom")
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*")))
    check(len(files) == 2 and files[0].endswith(".html") and files[1].endswith(".pickle"),
          f"one pair of files in ./reservoir-oom: {files}")
    follow = re.search(r"`(reservoir advise reservoir-oom/)`", text)
    check(follow is not None, "the text names the command for the whole job")
    if follow:
        r = run([reservoir] + follow.group(1).split()[1:], dict(os.environ), work)
        check(r.returncode == 0 and r.stdout.startswith("1 of 1 ranks ran out of memory: ")
              and "PYTORCH_ALLOC_CONF=" in r.stdout,
              f"{follow.group(1)!r} reads the folder (exit {r.returncode}: {r.stdout[:200]!r} {r.stderr[-300:]!r})")

    # The history, the steps, the dump; then advise on the file.
    body = python[0]
    check("# ... the training or inference steps that run out of memory ..." in body,
          "the Python block leaves the steps to the reader")
    steps = STEPS + f"try:\n    {FAIL}\nexcept torch.OutOfMemoryError:\n    pass\n"
    script = "import torch\n" + body.replace("# ... the training or inference steps that run out of memory ...\n",
                                             steps)
    with open(os.path.join(work, "record.py"), "w") as f:
        f.write(script)
    r = run([sys.executable, "record.py"], device_env, work)
    check(r.returncode == 0 and os.path.exists(os.path.join(work, "oom.pickle")),
          f"the Python block writes oom.pickle (exit {r.returncode}: {r.stderr[-500:]})")
    observer = re.search(r"\(`(torch\._C\._cuda_attach_out_of_memory_observer\(.*?\))`", text, re.S)
    check(observer is not None, "the observer line is given")
    if observer:
        os.remove(os.path.join(work, "oom.pickle"))
        with open(os.path.join(work, "observer.py"), "w") as f:
            f.write("import torch\ntorch.cuda.memory._record_memory_history(max_entries=100000)\n"
                    + observer.group(1) + "\n" + STEPS + FAIL + "\n")
        r = run([sys.executable, "observer.py"], device_env, work)
        check(r.returncode != 0 and os.path.exists(os.path.join(work, "oom.pickle")),
              f"the observer dumps oom.pickle at the moment of the error (exit {r.returncode})")
    advise = sh[1].split("#")[0].strip()
    advise = re.sub(r"\s*\[[^]]*\]", "", advise)  # the optional parts left out
    check(advise == "build/bin/reservoir advise oom.pickle", f"the advise line: {advise!r}")
    r = run([reservoir] + advise.split()[1:], dict(os.environ), work)
    variable = "PYTORCH_ALLOC_CONF="  # the recording is 2.9's or later
    check("`PYTORCH_ALLOC_CONF=...`" in text and "2.9" in text, "the text names the variable of 2.9 and later")
    check(r.returncode == 0 and variable in r.stdout,
          f"advise reads it and gives the line to put in the job's environment "
          f"(exit {r.returncode}: {r.stdout[:300]!r} {r.stderr[-300:]!r})")


def library_section(readme, source, build, work):
    text = section(readme, "Using the library")
    cpp = blocks(text, "cpp")
    check(len(cpp) == 2, f"two C++ blocks ({len(cpp)})")
    if len(cpp) != 2:
        return
    # The second block goes into the first one's main(), as it says.
    saver_lines = cpp[1].splitlines()
    includes = [x for x in saver_lines if x.startswith("#include")]
    statements = [x for x in saver_lines if x.strip() and not x.startswith("#include")]
    program = cpp[0]
    program = program.replace("#include <cstdio>\n", "#include <cstdio>\n" + "\n".join(includes) + "\n", 1)
    end = program.rstrip().rfind("}")
    program = program[:end] + "\n".join("  " + x for x in statements) + "\n  std::puts(\"paused and resumed\");\n}\n"
    project = os.path.join(work, "library")
    os.makedirs(project)
    with open(os.path.join(project, "main.cpp"), "w") as f:
        f.write(program)
    with open(os.path.join(project, "CMakeLists.txt"), "w") as f:
        f.write("cmake_minimum_required(VERSION 3.25)\nproject(readme_library LANGUAGES CXX)\n"
                "set(CMAKE_CXX_STANDARD 20)\nfind_package(reservoir REQUIRED)\n"
                "add_executable(program main.cpp)\ntarget_link_libraries(program PRIVATE reservoir::reservoir)\n")
    prefix = os.path.join(work, "prefix")
    env = dict(os.environ)
    for cmd in (["cmake", "--install", build, "--prefix", prefix],
                ["cmake", "-S", project, "-B", os.path.join(project, "build"), "-G", "Ninja",
                 f"-DCMAKE_PREFIX_PATH={prefix}"],
                ["cmake", "--build", os.path.join(project, "build")]):
        r = run(cmd, env, work)
        check(r.returncode == 0, f"{' '.join(cmd[:2])}: exit 0" + ("" if r.returncode == 0 else
                                                                   f"\n{r.stdout[-3000:]}{r.stderr[-3000:]}"))
        if r.returncode != 0:
            return
    r = run([os.path.join(project, "build", "program")], env, work)
    check(r.returncode == 0 and "Allocated memory" in r.stdout and r.stdout.rstrip().endswith("paused and resumed"),
          f"the program prints the memory summary, then pauses and resumes (exit {r.returncode}: "
          f"{r.stdout[:300]!r} {r.stderr[-300:]!r})")


def pytorch_section(readme, build, torch_site, work):
    text = section(readme, "The real PyTorch, without a GPU")
    command = [x for b in blocks(text) for x in b.splitlines() if "train.py" in x]
    check(len(command) == 1, f"one command line ({command})")
    if not command:
        return
    with open(os.path.join(work, "train.py"), "w") as f:
        f.write("import torch\nm = torch.nn.Linear(64, 8).cuda()\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                "for _ in range(3):\n    loss = m(torch.randn(16, 64, device='cuda')).square().mean()\n"
                "    loss.backward(); opt.step(); opt.zero_grad()\n"
                "print('device', torch.cuda.get_device_name(0), 'allocated', torch.cuda.memory_allocated())\n")
    line = command[0].replace("build/simcuda/", os.path.join(build, "simcuda") + "/")
    line = line.replace("~/.cache/reservoir/pypi/torch-2.15.0", torch_site)
    words = shlex.split(line)
    env = dict(os.environ, RESERVOIR_SIMCUDA_KERNELS="skip")
    for word in words[:-2]:
        name, _, value = word.partition("=")
        env[name] = value
    for name in ("PYTHONPATH",):
        if name not in dict(w.partition("=")[::2] for w in words[:-2]):
            env.pop(name, None)
    r = run([sys.executable if words[-2] == "python3" else words[-2], words[-1]], env, work)
    check(r.returncode == 0 and r.stdout.startswith("device "),
          f"the command runs train.py on the simulated device (exit {r.returncode}: {r.stdout[:200]!r} "
          f"{r.stderr[-500:]!r})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--build", required=True)
    ap.add_argument("--torch-site", required=True)
    args = ap.parse_args()
    readme = open(os.path.join(args.source, "README.md"), encoding="utf-8").read()
    build = os.path.abspath(args.build)
    reservoir = os.path.join(build, "bin", "reservoir")
    work = tempfile.mkdtemp(prefix="readme-")
    try:
        tool_section(readme, reservoir, work)
        device_env = {k: v for k, v in os.environ.items()
                      if not k.startswith(("RESERVOIR_", "PYTORCH_")) and k != "RANK"}
        device_env.update(PYTHONPATH=f"{args.torch_site}:{os.path.join(build, 'python')}",
                          LD_PRELOAD=os.path.join(build, "simcuda", "libcudart.so.13"),
                          RESERVOIR_SIMCUDA_MEMORY="1GiB", RESERVOIR_SIMCUDA_KERNELS="skip")
        oom_dir = os.path.join(work, "oom-section")
        os.makedirs(oom_dir)
        oom_section(readme, reservoir, device_env, oom_dir, installed(build, args.torch_site, work))
        library_section(readme, args.source, build, work)
        torch_dir = os.path.join(work, "pytorch-section")
        os.makedirs(torch_dir)
        pytorch_section(readme, build, args.torch_site, torch_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if failures:
        print(f"{len(failures)} check(s) failed:")
        for f in failures:
            print("  " + f.splitlines()[0])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

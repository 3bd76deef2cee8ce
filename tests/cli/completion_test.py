"""`reservoir completion bash|zsh`: the scripts complete subcommands, options
and files in real shells. bash: the completion function called as bash calls
it; zsh: an interactive zsh on a terminal, typing TAB.
usage: completion_test.py RESERVOIR WORKDIR"""
import os
import pty
import select
import shutil
import subprocess
import sys
import time

binary, work = os.path.abspath(sys.argv[1]), sys.argv[2]
os.makedirs(work, exist_ok=True)
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)


def bash_complete(*words):
    """COMPREPLY for the command line `words`, the last one being completed."""
    line = " ".join(f'"{w}"' for w in words)
    r = subprocess.run(
        ["bash", "-c", f'source <("{binary}" completion bash); COMP_WORDS=({line}); '
         f'COMP_CWORD={len(words) - 1}; _reservoir; printf "%s\\n" "${{COMPREPLY[@]}}"'],
        capture_output=True, text=True, cwd=work)
    check(r.returncode == 0, f"bash {words}: exit {r.returncode}: {r.stderr}")
    return sorted(x for x in r.stdout.split("\n") if x)


open(os.path.join(work, "run.pickle"), "wb").close()
check(bash_complete("reservoir", "re") == ["replay", "report"], f"subcommands: {bash_complete('reservoir', 're')}")
check(bash_complete("reservoir", "") ==
      sorted(["replay", "verify", "export", "summary", "compare", "report", "advise", "settings",
              "completion", "--help", "--version"]), f"all subcommands: {bash_complete('reservoir', '')}")
check(bash_complete("reservoir", "replay", "--ca") == ["--capacity"], "an option of replay")
check(bash_complete("reservoir", "verify", "--device-m") == ["--device-memory"], "an option of verify")
check(bash_complete("reservoir", "verify", "--ca") == [], "replay's option is not verify's")
check(bash_complete("reservoir", "replay", "--capacity", "") == [], "a size is not a file")
check(bash_complete("reservoir", "advise", "-o", "ru") == ["run.pickle"], "-o takes a path")
check(bash_complete("reservoir", "replay", "--json", "ru") == ["run.pickle"], "a flag takes nothing")

zsh = shutil.which("zsh")
check(zsh is not None, "zsh is not installed (make deps installs it)")
if zsh:
    fpath = os.path.join(work, "zfunc")
    os.makedirs(fpath, exist_ok=True)
    script = subprocess.run([binary, "completion", "zsh"], capture_output=True, text=True, check=True).stdout
    with open(os.path.join(fpath, "_reservoir"), "w") as f:
        f.write(script)
    check(subprocess.run([zsh, "-n", os.path.join(fpath, "_reservoir")]).returncode == 0, "zsh -n")
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(work)
        os.environ["PATH"] = os.path.dirname(os.path.abspath(binary)) + ":" + os.environ["PATH"]
        os.environ["TERM"] = "xterm"
        os.execvp(zsh, [zsh, "-f", "-i"])

    def read(until, timeout=10.0):
        out, end = "", time.time() + timeout
        while time.time() < end and until not in out:
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                try:
                    out += os.read(fd, 65536).decode(errors="replace")
                except OSError:
                    break
        return out

    os.write(fd, f"PS1='ready> '; fpath=({fpath} $fpath); autoload -U compinit; compinit -u -D\n".encode())
    read("ready> ")
    os.write(fd, b"reservoir rep\t")
    shown = read("report  --")
    check("replay  --" in shown and "report  --" in shown, f"zsh lists replay and report: {shown!r}")
    os.write(fd, b"\x15reservoir replay --capa\t")
    shown = read("--capacity")
    check("reservoir replay --capacity" in shown, f"zsh completes --capacity: {shown!r}")
    os.write(fd, b"\x15reservoir advise -o ru\t")
    shown = read("run.pickle")
    check("run.pickle" in shown, f"zsh completes a path after -o: {shown!r}")
    os.write(fd, b"\x15exit\n")
    os.waitpid(pid, 0)

if failures:
    print("\n".join(failures))
    sys.exit(1)
print("completion: bash and zsh complete subcommands, options and paths")

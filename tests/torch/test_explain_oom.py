"""The answer at the moment of an out-of-memory error (reservoir.explain_oom,
RESERVOIR_EXPLAIN_OOM=1) under the real PyTorch on the simulated device,
each program in its own process on a 1 GiB device: fragmentation answered
with a setting that the same program then runs under; a program that needs
more than the device answered with how much more; a memory fraction below 1;
memory held outside PyTorch's allocator; the switch off changes nothing; a
failure inside the analysis leaves PyTorch's error whole; every rank writes
its own files, which `reservoir advise DIR` reads for the job; reservoir as
PyTorch's own allocator answers from its own state.
"""
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest
from scenarios import FRAGMENTATION_LINE, FRAGMENTING_STEPS

torch = pytest.importorskip("torch")
pytest.importorskip("reservoir")
from reservoir.oom import format_size  # noqa: E402 - sizes as PyTorch's messages and reservoir's lines write them

DEVICE = "1GiB"
# The command the answer names for the folder: one that runs here (the
# package is used from PYTHONPATH in these tests: no `reservoir` on PATH).
ADVISE = "reservoir advise" if shutil.which("reservoir") else f"{shlex.quote(sys.executable)} -m reservoir advise"
MiB = 1 << 20

PRELUDE = """
import json, os, sys
import torch
MiB = 1 << 20
def report(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
def fail_big(nbytes, **more):
    try:
        torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        report(message=str(e), **more)
        return
    report(message=None, **more)
"""

# Two 400 MiB segments, cached, then carved into 60 MiB tensors of which every
# other one is freed: 440 MiB reserved and unusable (holes of 60 MiB, the
# largest 100 MiB with a segment's tail), and a 500 MiB request finds no
# room, though 360 MiB is all that is in use. FRACTION: the memory fraction a
# recommended setting asks for.
FRAGMENTED = """
if os.environ.get("FRACTION"):
    torch.cuda.set_per_process_memory_fraction(float(os.environ["FRACTION"]))
""" + FRAGMENTING_STEPS + """
fail_big(500 * MiB)
"""




def run(body, tmp_path, env=None, code_change=True, setting=None):
    full = {**os.environ, "RESERVOIR_SIMCUDA_KERNELS": "skip", "RESERVOIR_SIMCUDA_MEMORY": DEVICE,
            "RESERVOIR_OOM_DIR": str(tmp_path / "oom")}
    for name in ("RESERVOIR_EXPLAIN_OOM", "RANK", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF",
                 "RESERVOIR_TORCH_ALLOCATOR"):
        full.pop(name, None)
    if setting is not None:
        full["PYTORCH_ALLOC_CONF"] = setting
        full["PYTORCH_CUDA_ALLOC_CONF"] = setting
    full.update(env or {})
    # Without a code change, the .pth installed beside the package is what
    # reads the switch (read here by site.addsitedir, as Python's start-up
    # reads site-packages).
    site_dir = os.path.dirname(os.path.dirname(os.path.abspath(__import__("reservoir").__file__)))
    script = (f"import site; site.addsitedir({site_dir!r})\n" if not code_change else "") + PRELUDE + \
        ("import reservoir\nreservoir.explain_oom()\n" if code_change else "") + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True,
                       timeout=300, env=full)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    out["stderr"] = r.stderr
    return out


def answer_of(message):
    """PyTorch's message, then reservoir's lines."""
    assert message is not None, "the request did not fail"
    pytorch, _, ours = message.partition("\nreservoir")
    return pytorch, ("reservoir" + ours).splitlines() if ours else []


def test_fragmentation_names_a_setting_and_the_program_runs_under_it(tmp_path):
    got = run(FRAGMENTED, tmp_path)
    pytorch, lines = answer_of(got["message"])
    assert pytorch.startswith("CUDA out of memory. Tried to allocate 500.00 MiB.")
    assert 3 <= len(lines) <= 8, lines
    assert lines[0] == FRAGMENTATION_LINE
    # The same lines on stderr, before the error.
    assert "\n".join(lines) in got["stderr"]
    m = re.match(r"reservoir: set PYTORCH_ALLOC_CONF=(\S+?)(?: and call torch.cuda."
                 r"set_per_process_memory_fraction\(([0-9.]+)\) \(garbage collection runs only under one\))?"
                 r": the recorded part needs (\S+ \S+) under it, ", lines[1])
    assert m, lines
    setting, fraction = m.group(1), m.group(2)
    assert m.group(3) == "860.00 MiB"  # what is in use and the request: no setting needs less
    assert lines[2].startswith("reservoir: this covers the program up to the failed request")
    # The files, named by host and time, and the line that names them.
    snaps = glob.glob(str(tmp_path / "oom" / "*.pickle"))
    pages = glob.glob(str(tmp_path / "oom" / "*-advice.html"))
    assert len(snaps) == 1 and len(pages) == 1
    assert f"reservoir: snapshot: {snaps[0]}; the full answer: {pages[0]}" in lines
    assert re.fullmatch(re.escape(f"reservoir: next: {ADVISE} {tmp_path / 'oom'} (it weighs every setting of "
                                  "your release, not only the ") + r"\d+ weighed here\)", lines[-1]), lines[-1]
    # ... and that command runs as written.
    command = lines[-1].split(": ", 2)[2].split(" (it weighs")[0]
    r = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "<svg" in open(pages[0]).read()
    # The program runs to its end under the setting named.
    again = run(FRAGMENTED, tmp_path / "again", setting=setting, env={"FRACTION": fraction} if fraction else None)
    assert again["message"] is None


def test_too_little_memory_says_no_setting_helps_and_by_how_much(tmp_path):
    got = run("""
    a = torch.empty(600 * MiB, dtype=torch.uint8, device="cuda")
    free, total = torch.cuda.mem_get_info()
    fail_big(600 * MiB, free=free, reserved=torch.cuda.memory_reserved())
    """, tmp_path)
    pytorch, lines = answer_of(got["message"])
    assert pytorch.startswith("CUDA out of memory. Tried to allocate 600.00 MiB.")
    assert lines[0].startswith("reservoir: out of memory on a 600.00 MiB request: too little memory: "
                               "the recorded part alone needs 1.17 GiB at its peak, ")
    capacity = got["free"] + got["reserved"]  # what the device had at the error
    assert lines[1] == (f"reservoir: no setting helps: the program must need {format_size(1200 * MiB - capacity)} "
                        "less (smaller batches, activation checkpointing, lower precision).")


@pytest.mark.parametrize("allocator", ["pytorch", "own"])
def test_a_memory_fraction_below_one_is_named_with_the_limit(tmp_path, allocator):
    # 512 MiB of the 1 GiB device allowed, 300 MiB held, 300 MiB more asked
    # for. The error reports the limit (PyTorch gives its observers the
    # limit in place of the device's total; reservoir's allocator knows its
    # own), so the answer measures the shortfall against it: 600 MiB at the
    # peak, 88 MiB more than allowed (not against the 300 MiB the recording
    # alone shows the limit to be at least).
    env = {"RESERVOIR_TORCH_ALLOCATOR": "own"} if allocator == "own" else None
    got = run("""
    torch.cuda.set_per_process_memory_fraction(0.5)
    a = torch.empty(300 * MiB, dtype=torch.uint8, device="cuda")
    fail_big(300 * MiB)
    """, tmp_path, env=env)
    pytorch, lines = answer_of(got["message"])
    assert "512.00 MiB allowed" in pytorch, pytorch
    assert lines[0] == ("reservoir: out of memory on a 300.00 MiB request: the process's memory fraction "
                        "(set_per_process_memory_fraction) refused it: it allows 512.00 MiB, the process had "
                        "300.00 MiB reserved and the device 724.00 MiB free; and too little memory: the recorded "
                        "part alone needs 600.00 MiB at its peak, 88.00 MiB more than the 512.00 MiB its memory "
                        "fraction allows."), lines
    assert lines[1] == ("reservoir: no setting helps: the program must need 88.00 MiB less (smaller batches, "
                        "activation checkpointing, lower precision)."), lines


def test_memory_held_outside_the_allocator_is_named(tmp_path):
    # 500 MiB taken from CUDA directly (as another process or library would).
    got = run("""
    import ctypes
    cudart = ctypes.CDLL("libcudart.so.13")
    p = ctypes.c_void_p()
    assert cudart.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(500 * MiB)) == 0
    a = torch.empty(300 * MiB, dtype=torch.uint8, device="cuda")
    fail_big(300 * MiB)
    """, tmp_path)
    _, lines = answer_of(got["message"])
    assert lines[0].startswith("reservoir: out of memory on a 300.00 MiB request: 500.00 MiB of the "
                               "device's 1024.00 MiB was held outside this allocator"), lines


def test_the_switch_off_changes_nothing(tmp_path):
    got = run(FRAGMENTED, tmp_path, code_change=False)
    pytorch, lines = answer_of(got["message"])
    assert lines == [] and "reservoir" not in got["stderr"]
    assert not (tmp_path / "oom").exists()
    # ... and on, through the environment alone, the same error carries the answer.
    on = run(FRAGMENTED, tmp_path / "on", code_change=False, env={"RESERVOIR_EXPLAIN_OOM": "1"})
    on_pytorch, on_lines = answer_of(on["message"])
    assert on_pytorch == pytorch
    assert on_lines[0] == FRAGMENTATION_LINE


def test_a_failure_inside_the_analysis_leaves_pytorchs_error_whole(tmp_path):
    got = run(textwrap.dedent("""
    import reservoir._core
    def broken(*args, **kwargs):
        raise RuntimeError("the analysis broke")
    reservoir._core._explain_snapshot = broken
    """) + FRAGMENTED, tmp_path)
    clean = run(FRAGMENTED, tmp_path / "clean", code_change=False)
    pytorch, lines = answer_of(got["message"])
    assert pytorch == answer_of(clean["message"])[0]
    assert lines == ["reservoir: could not explain this out-of-memory error: RuntimeError: the analysis broke"]


def test_each_rank_writes_its_own_files_and_advise_reads_the_job(tmp_path):
    ranks = {}
    for rank in (0, 1):
        ranks[rank] = run(FRAGMENTED, tmp_path, code_change=False,
                          env={"RESERVOIR_EXPLAIN_OOM": "1", "RANK": str(rank)})
    for rank, got in ranks.items():
        _, lines = answer_of(got["message"])
        assert all(x.startswith(f"reservoir [rank {rank}, GPU 0]: ") for x in lines), lines
        assert lines[-1].startswith(f"reservoir [rank {rank}, GPU 0]: for the whole job: {ADVISE} "
                                    f"{tmp_path / 'oom'} (it weighs every setting of your release, not only the "), \
            lines[-1]
    snaps = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "oom" / "*.pickle")))
    assert len(snaps) == 2 and "-rank0-gpu0-" in snaps[0] and "-rank1-gpu0-" in snaps[1], snaps
    r = subprocess.run([os.environ["RESERVOIR"], "advise", str(tmp_path / "oom"), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    job = json.loads(r.stdout)
    assert sorted(x["name"] for x in job["ranks"]) == ["rank 0 (GPU 0)", "rank 1 (GPU 0)"]
    assert all(x["ran_out"] for x in job["ranks"])


@pytest.mark.parametrize("variable", ["SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"])
def test_each_launchers_rank_variable_names_the_rank(tmp_path, variable):
    # srun, Open MPI's mpirun, MPICH's Hydra and PMIx set no RANK: their own
    # variable names the rank, in the lines and the file's name.
    got = run(FRAGMENTED, tmp_path, code_change=False, env={"RESERVOIR_EXPLAIN_OOM": "1", variable: "3"})
    _, lines = answer_of(got["message"])
    assert lines and all(x.startswith("reservoir [rank 3, GPU 0]: ") for x in lines), lines
    snaps = [os.path.basename(p) for p in glob.glob(str(tmp_path / "oom" / "*.pickle"))]
    assert len(snaps) == 1 and "-rank3-gpu0-" in snaps[0], snaps


# PyTorch's DDP tutorial: torch.multiprocessing.spawn starts one process a
# device and passes each its rank; init_process_group takes it, and no
# variable says it. Each rank fragments its own device (cuda:rank) and
# fails; the answers and files name the rank and the device.
SPAWNED = """
import torch.distributed as dist
import torch.multiprocessing as mp

def worker(rank, init, out):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.cuda.set_device(rank)
""" + textwrap.indent(FRAGMENTING_STEPS.strip("\n"), "    ") + """
    try:
        torch.empty(500 * MiB, dtype=torch.uint8, device="cuda")
        message = None
    except torch.OutOfMemoryError as e:
        message = str(e)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"message": message}, f)
    dist.destroy_process_group()

if __name__ == "__main__":
    init, out = sys.argv[1], sys.argv[2]
    mp.spawn(worker, args=(init, out), nprocs=2, join=True)
    report(done=True)
"""


@pytest.mark.parametrize("allocator", ["pytorch", "own"])
def test_a_spawned_jobs_ranks_are_named_from_torch_distributed(tmp_path, allocator):
    env = {**os.environ, "RESERVOIR_SIMCUDA_KERNELS": "skip", "RESERVOIR_SIMCUDA_MEMORY": DEVICE,
           "RESERVOIR_SIMCUDA_DEVICES": "2", "RESERVOIR_OOM_DIR": str(tmp_path / "oom"),
           "RESERVOIR_EXPLAIN_OOM": "1"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                 "PMIX_RANK", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "RESERVOIR_TORCH_ALLOCATOR"):
        env.pop(name, None)
    if allocator == "own":
        env["RESERVOIR_TORCH_ALLOCATOR"] = "own"
    site_dir = os.path.dirname(os.path.dirname(os.path.abspath(__import__("reservoir").__file__)))
    script = tmp_path / "job.py"
    script.write_text(f"import site; site.addsitedir({site_dir!r})\n" + PRELUDE + textwrap.dedent(SPAWNED))
    out = tmp_path / "result"
    r = subprocess.run([sys.executable, "-W", "ignore", str(script), f"file://{tmp_path / 'store'}", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for rank in (0, 1):
        message = json.load(open(f"{out}.{rank}"))["message"]
        _, lines = answer_of(message)
        assert lines and all(x.startswith(f"reservoir [rank {rank}, GPU {rank}]: ") for x in lines), lines
        assert "GPU %d has a total capacity" % rank in message
    snaps = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "oom" / "*.pickle")))
    assert len(snaps) == 2 and "-rank0-gpu0-" in snaps[0] and "-rank1-gpu1-" in snaps[1], snaps
    r = subprocess.run([os.environ["RESERVOIR"], "advise", str(tmp_path / "oom")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("2 of 2 ranks ran out of memory: rank 0 (GPU 0), rank 1 (GPU 1).\n"), r.stdout
    assert "  ran out of memory: rank 0 (GPU 0), rank 1 (GPU 1)\n" in r.stdout, r.stdout
    # One variable for the release, whichever allocator wrote the files (the
    # own allocator's name the release it ran under).
    m = re.search(r"One setting for every rank \(for PyTorch (\S+)(?: or newer)?: (\w+)\)", r.stdout)
    assert m and m.group(2) == "PYTORCH_ALLOC_CONF", r.stdout
    if allocator == "own":
        assert m.group(1) == torch.__version__.split("+")[0].rsplit(".", 1)[0] and "or newer" not in m.group(0)


def test_reservoir_as_pytorchs_allocator_answers_from_its_own_state(tmp_path):
    got = run(FRAGMENTED, tmp_path, code_change=False,
              env={"RESERVOIR_EXPLAIN_OOM": "1", "RESERVOIR_TORCH_ALLOCATOR": "own"})
    pytorch, lines = answer_of(got["message"])
    assert pytorch.startswith("CUDA out of memory. Tried to allocate 500.00 MiB.")
    assert lines[0] == FRAGMENTATION_LINE, lines
    assert "\n".join(lines) in got["stderr"]
    assert len(glob.glob(str(tmp_path / "oom" / "*.pickle"))) == 1


# PyTorch's own figures for an error: the device's total and free memory, and
# what its allocator held reserved but unallocated.
def pytorch_figures(message):
    m = re.search(r"GPU \d+ has a total capacity of (\S+ \S+) of which (\S+ \S+) is free\.", message)
    u = re.search(r"and (\S+ \S+) is reserved by PyTorch but unallocated\.", message)
    assert m and u, message
    return {"total": m.group(1), "free": m.group(2), "unallocated": u.group(1)}


def size_bytes(text):
    number, unit = text.split()
    return float(number) * {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]


# FRAGMENTED with history recorded by the program itself, as people do.
HISTORY_ON = "torch.cuda.memory._record_memory_history()\n"
# More than the device holds beside what is kept: no setting helps.
TOO_BIG = """
torch.cuda.memory._record_memory_history()
keep = [torch.empty(100 * MiB, dtype=torch.uint8, device="cuda") for _ in range(6)]
fail_big(600 * MiB)
"""


@pytest.mark.parametrize("allocator,setting", [("pytorch", None), ("own", ""), ("own", "policy:native_paged")])
def test_the_answers_figures_are_those_of_the_error_it_answers(tmp_path, allocator, setting):
    # The lines' figures against the error's own message (PyTorch's, or
    # reservoir's as PyTorch's allocator), with history on: what sat unused,
    # what was free, never more than the device holds.
    env = {"RESERVOIR_EXPLAIN_OOM": "1"}
    if allocator == "own":
        env.update({"RESERVOIR_TORCH_ALLOCATOR": "own", "RESERVOIR_ALLOC_CONF": setting})
    for body in (HISTORY_ON + FRAGMENTED, TOO_BIG):
        got = run(body, tmp_path / str(len(body)), code_change=False, env=env)
        if got["message"] is None:
            assert setting == "policy:native_paged" and body != TOO_BIG  # native_paged serves the fragmented one
            continue
        pytorch, lines = answer_of(got["message"])
        figures = pytorch_figures(pytorch)
        assert figures["total"] == "1024.00 MiB"
        first = lines[0]
        frag = re.search(r"fragmentation: (\S+ \S+) sat reserved but unused, .* and the device had (\S+ \S+) free",
                         first)
        if body == TOO_BIG:
            assert frag is None, first
            m = re.search(r"too little memory: .* more than the (\S+ \S+) there is", first)
            assert m, lines
            # What there is: the allocator's reserved memory and the device's free.
            reserved = 600 * MiB + size_bytes(figures["unallocated"])
            there = reserved + size_bytes(figures["free"])
            assert abs(size_bytes(m.group(1)) - there) <= there * 1e-4, (first, figures)
        else:
            assert frag, lines
            assert frag.group(1) == figures["unallocated"] and frag.group(2) == figures["free"], (first, figures)
        # What the lines say the device had or the allocator held fits in the device.
        text = "\n".join(lines)
        held = re.findall(r"the device had ([\d.]+ \w+)", text) + re.findall(r"([\d.]+ \w+) sat reserved", text) + \
            re.findall(r"the ([\d.]+ \w+) there is", text)
        assert held, lines
        for size in held:
            assert size_bytes(size) <= 1 << 30, (size, lines)


def test_the_own_allocators_snapshot_at_an_error_verifies(tmp_path):
    # The snapshot the live answer writes under reservoir's own allocator
    # names the running release's rules: `reservoir verify` replays it to the
    # same addresses (PyTorch 2.13 and later break ties by segment age).
    got = run(HISTORY_ON + FRAGMENTED, tmp_path, code_change=False,
              env={"RESERVOIR_EXPLAIN_OOM": "1", "RESERVOIR_TORCH_ALLOCATOR": "own"})
    assert got["message"] is not None
    snaps = glob.glob(str(tmp_path / "oom" / "*.pickle"))
    assert len(snaps) == 1
    r = subprocess.run([os.environ["RESERVOIR"], "verify", snaps[0]], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "agrees with the recording" in r.stdout, r.stdout + r.stderr


# Errors raised where the answer is not made: in backward (autograd's thread
# makes the error, the thread that called backward() raises it), in a second
# Python thread, and in a DataLoader's pin-memory thread (its error raised
# again in the main thread). Each exception carries the lines of its own
# request; an exception made later, or by the program itself, carries none.
THREADS = """
import threading
results = {}
# backward: the gradient of a 300 MiB leaf does not fit beside 600 MiB kept.
x = torch.empty(300 * MiB // 4, device="cuda", requires_grad=True)
fill = torch.empty(600 * MiB, dtype=torch.uint8, device="cuda")
try:
    x.sum().backward()
    results["backward"] = None
except torch.OutOfMemoryError as e:
    results["backward"] = str(e)
del fill
# A second thread's own error.
def second():
    try:
        torch.empty(900 * MiB, dtype=torch.uint8, device="cuda")
        results["thread"] = None
    except torch.OutOfMemoryError as e:
        results["thread"] = str(e)
t = threading.Thread(target=second)
t.start()
t.join()
# A DataLoader's pin-memory thread (a batch type whose pinning allocates on the device).
class Batch:
    def pin_memory(self, device=None):
        torch.empty(800 * MiB, dtype=torch.uint8, device="cuda")
        return self
class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 1
    def __getitem__(self, i):
        return Batch()
try:
    for _ in torch.utils.data.DataLoader(Data(), batch_size=None, num_workers=1, pin_memory=True):
        pass
    results["pin"] = None
except torch.OutOfMemoryError as e:
    results["pin"] = str(e)
results["made"] = str(torch.OutOfMemoryError("made by the program"))
report(**results)
"""


@pytest.mark.parametrize("allocator", ["pytorch", "own"])
def test_errors_raised_in_other_threads_carry_their_own_lines(tmp_path, allocator):
    env = {"RESERVOIR_EXPLAIN_OOM": "1"}
    if allocator == "own":
        env["RESERVOIR_TORCH_ALLOCATOR"] = "own"
    got = run(THREADS, tmp_path, code_change=False, env=env)
    for where, size in (("backward", "300.00 MiB"), ("thread", "900.00 MiB"), ("pin", "800.00 MiB")):
        message = got[where]
        assert message is not None, where
        tried = re.search(r"Tried to allocate ([\d.]+ \w+)", message)
        assert tried and tried.group(1) == size, (where, message[:300])
        lines = [x for x in message.splitlines() if x.startswith("reservoir: ")]
        assert lines, (where, message[-2000:])
        assert lines[0].startswith(f"reservoir: out of memory on a {size} request: "), (where, lines)
        # One answer per error: its own, once.
        assert sum(x.startswith("reservoir: out of memory on a ") for x in lines) == 1, (where, lines)
    assert got["made"] == "made by the program"


# A batch-size finder of the usual kind: a step whose activations grow with
# the batch, run at a batch that shrinks by an eighth after each
# out-of-memory error until a step completes. Every error is caught and the
# program goes on, as accelerate's and Lightning's finders do.
PER_SAMPLE = (64 * 1024, 96 * 1024, 32 * 1024)  # bytes a sample of each activation
FINDER = """
weights = torch.empty(150 * MiB, dtype=torch.uint8, device="cuda")
stage = 0
def step(batch):
    global stage
    held = []
    for stage, per in enumerate((64 * 1024, 96 * 1024, 32 * 1024)):
        held.append(torch.empty(batch * per, dtype=torch.uint8, device="cuda"))
batch, errors = 16384, []
while batch >= 1:
    try:
        step(batch)
        break
    except torch.OutOfMemoryError as e:
        errors.append([str(e), batch, stage])
        batch = batch * 7 // 8
report(batch=batch, errors=errors)
"""


@pytest.mark.parametrize("allocator", ["pytorch", "own"])
def test_a_batch_size_finder_gets_each_error_explained_for_itself(tmp_path, allocator):
    env = {"RESERVOIR_EXPLAIN_OOM": "1", "RESERVOIR_EXPLAIN_OOM_KEEP": "3"}
    if allocator == "own":
        env["RESERVOIR_TORCH_ALLOCATOR"] = "own"
    got = run(FINDER, tmp_path, code_change=False, env=env)
    plain = run(FINDER, tmp_path / "plain")  # PyTorch's allocator, nothing explained: the same batch
    assert got["batch"] == plain["batch"] and len(got["errors"]) == len(plain["errors"])
    assert len(got["errors"]) >= 8, got["errors"]
    kept_said = 0
    for message, batch, stage in got["errors"]:
        _, lines = answer_of(message)
        # Each exception carries the answer to its own error, once: its own
        # request, and what was alive then (the weights and the step's
        # activations so far; earlier steps' failed requests got no memory).
        request = batch * PER_SAMPLE[stage]
        assert lines and lines[0].startswith(f"reservoir: out of memory on a {format_size(request)} request: "), \
            (batch, stage, lines)
        assert sum(x.startswith("reservoir: out of memory on a ") for x in lines) == 1, lines
        if "too little memory" in lines[0]:
            needs = 150 * MiB + sum(batch * per for per in PER_SAMPLE[:stage + 1])
            assert f"the recorded part alone needs {format_size(needs)} at its peak" in lines[0], (batch, stage, lines[0])
        kept_said += sum("most recent errors are kept" in x for x in lines)
    # The files of the 3 most recent errors stay, and that is said once.
    assert kept_said == 1
    assert len(glob.glob(str(tmp_path / "oom" / "*.pickle"))) == 3
    assert len(glob.glob(str(tmp_path / "oom" / "*-advice.html"))) == 3


def test_the_gpu_bundles_batch_finder_check_runs_here(tmp_path):
    # tests/gpu/explain_oom_check.py's batch_finder (the GPU bundle's
    # explain_oom step) on the simulated device, under a 1 GiB memory
    # fraction: 256 MiB of weights, then batches of 16,384 samples shrunk by
    # an eighth until the three activations (192 KiB a sample) fit beside
    # them. 3,769 would fit into an empty 1 GiB, but the segments cached from
    # the batches that failed before it, each split for its smaller
    # activations, leave its last one no room (fragmentation): 3,297 after
    # 12 errors, under PyTorch's allocator with nothing explained, and with
    # every error explained under PyTorch's allocator and reservoir's own.
    script = os.path.join(os.path.dirname(__file__), "..", "gpu", "explain_oom_check.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESERVOIR_EXPLAIN", "PYTORCH_"))}
    env.update({"RESERVOIR_SIMCUDA_KERNELS": "skip", "TMPDIR": str(tmp_path)})
    r = subprocess.run([sys.executable, script, "--only", "batch_finder", "--finder-gib", "1"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert [x.get("check") for x in lines] == ["batch_finder", None] and lines[-1] == {"checks": {"batch_finder": True}}
    finder = lines[0]
    assert finder["ok"] and finder["problems"] == [], finder
    assert (finder["cap_bytes"], finder["batch"], finder["errors"]) == (1 << 30, 3297, 12), finder
    assert {m: (x["allocator"], x["errors"]) for m, x in finder["explained"].items()} == \
        {"pytorch": ("native", 12), "own": ("reservoir", 12)}
    # The first error's answer: the 1 GiB request (16,384 x 64 KiB) beside
    # 256 MiB of weights, refused by the memory fraction, more than it allows.
    for mode in ("pytorch", "own"):
        first = finder["explained"][mode]["first_answer"]
        assert first.startswith("reservoir: out of memory on a 1024.00 MiB request: the process's memory fraction "
                                "(set_per_process_memory_fraction) refused it: "), first
        assert "the recorded part alone needs 1.25 GiB at its peak" in first, first

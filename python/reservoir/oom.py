"""The answer at the moment of an out-of-memory error, in any PyTorch program.

reservoir.explain_oom() (or RESERVOIR_EXPLAIN_OOM=1 in the environment, read
when `import torch` finishes) makes every CUDA out-of-memory error explain
itself:

- under PyTorch's own allocator, it turns on PyTorch's history recording
  (the latest `max_entries` events, no stacks: the cost of a ring buffer
  entry per allocation and free) and attaches to PyTorch's out-of-memory
  observer; at the error it takes the snapshot in the process and runs
  reservoir's analysis (replays of PyTorch's decisions on a simulated device,
  in the library, about a second at 100,000 events);
- under reservoir as PyTorch's allocator (RESERVOIR_TORCH_ALLOCATOR), the
  allocator answers from its own state and history.

The answer, at most eight lines, goes to stderr before the error and is
appended to the torch.OutOfMemoryError message (PyTorch's message first and
whole). The snapshot and the page (advice.html) go to `directory`
(RESERVOIR_OOM_DIR, else ./reservoir-oom), named by host, rank and time;
`reservoir advise DIR` reads every rank's for the job-level answer.
"""
import os
import pickle
import re
import shlex
import shutil
import sys
import threading

from . import _core

EXPLAIN_VARIABLE = "RESERVOIR_EXPLAIN_OOM"
DIRECTORY_VARIABLE = "RESERVOIR_OOM_DIR"
KEEP_VARIABLE = "RESERVOIR_EXPLAIN_OOM_KEEP"
DEFAULT_MAX_ENTRIES = 100_000

_lock = threading.Lock()
_settings = None  # (directory, rank, host) once on
# The answers the observer made that no exception has taken yet, oldest
# first: (thread, device, the request as PyTorch's message writes it, lines).
# The error is raised where the allocation failed, but its Python exception
# can be made on another thread: autograd's engine rethrows an error of
# backward's on the thread that called backward(). Each exception takes the
# answer of its own thread first, else the latest of another thread for the
# same request and device; an answer no exception takes is dropped when its
# thread meets its next error, and the list holds at most _MAX_PENDING.
_pending = []
_MAX_PENDING = 64
_patched = False


def _directory(directory):
    if directory is not None:
        return os.path.abspath(os.fspath(directory))
    return os.path.abspath(os.environ.get(DIRECTORY_VARIABLE) or "reservoir-oom")


def _rank(rank):
    """The rank given to explain_oom; None: the library takes it at each
    error from torch.distributed (as _follow_distributed_rank tells it) or
    from the launcher's variables (RANK, SLURM_PROCID, OMPI_COMM_WORLD_RANK,
    PMI_RANK, PMIX_RANK, MV2_COMM_WORLD_RANK)."""
    return None if rank is None else int(rank)


def _distributed_rank(torch):
    """torch.distributed's rank where a process group is made, else None."""
    try:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001 - a half-made process group tells nothing
        pass
    return None


def _follow_distributed_rank(torch):
    """Tells the library the process's rank once torch.distributed knows it:
    a job started by torch.multiprocessing.spawn (PyTorch's DDP tutorial)
    passes the rank to init_process_group and sets no variable. Every way
    of making the default process group (init_process_group, device meshes,
    Lightning's and accelerate's launchers) ends in distributed_c10d's
    _update_default_pg, which is wrapped; init_process_group too, for
    releases without it."""
    current = _distributed_rank(torch)
    if current is not None:
        _core._set_process_rank(current)
    try:
        c10d = torch.distributed.distributed_c10d
    except Exception:  # noqa: BLE001 - a PyTorch built without distributed
        return
    if getattr(c10d, "_reservoir_follows_rank", False):
        return

    def after(original):
        def wrapped(*args, **kwargs):
            result = original(*args, **kwargs)
            rank = _distributed_rank(torch)
            if rank is not None:
                _core._set_process_rank(rank)
            return result
        wrapped.__wrapped__ = original
        return wrapped

    for module in (c10d, torch.distributed):
        for name in ("_update_default_pg", "init_process_group"):
            original = getattr(module, name, None)
            if callable(original) and not hasattr(original, "__wrapped__"):
                setattr(module, name, after(original))
    c10d._reservoir_follows_rank = True


def explain_oom(directory=None, max_entries=DEFAULT_MAX_ENTRIES, rank=None, stacks=False, keep=None):
    """Explains every CUDA out-of-memory error from now on (see the module's
    text). `stacks=True` records Python stacks too: the page then names the
    code that allocated the largest blocks, at several microseconds per
    allocation. `keep`: the errors whose files this process keeps in the
    directory (default RESERVOIR_EXPLAIN_OOM_KEEP, else 20); older errors'
    files are removed. Returns the directory the files go to."""
    import torch

    global _settings
    if max_entries < 1:
        raise ValueError(f"explain_oom: max_entries must be at least 1, not {max_entries}")
    if keep is not None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"explain_oom: keep must be a whole number from 1, not {keep!r}")
        os.environ[KEEP_VARIABLE] = str(keep)
    directory = _directory(directory)
    rank = _rank(rank)
    _follow_distributed_rank(torch)
    with _lock:
        _settings = (directory, rank)
        from . import torch_installed

        if torch_installed():
            # reservoir serves PyTorch's allocations: it answers from its own
            # state, in its own error (no snapshot taken, no observer).
            _core._explain_torch_allocator(directory, -1 if rank is None else rank, max_entries, _advise_command())
            return directory
        torch.cuda.memory._record_memory_history(
            enabled="all", context="all" if stacks else None, stacks="python", max_entries=max_entries)
        _patch_error(torch)
        if not getattr(explain_oom, "_observing", False):
            torch._C._cuda_attach_out_of_memory_observer(_observer)
            explain_oom._observing = True
    return directory


def _advise_command():
    """The command the answer's last line names: `reservoir advise` where the
    package's command is on PATH, else this interpreter running the package
    (a package used from PYTHONPATH has no command on PATH)."""
    if shutil.which("reservoir"):
        return "reservoir advise"
    return f"{shlex.quote(sys.executable)} -m reservoir advise"


def _observer(device, alloc, device_total, device_free):
    """PyTorch's out-of-memory observer: called before the error is raised,
    with the allocator's lock released (device_total: the memory fraction's
    limit instead where one is set)."""
    settings = _settings
    if settings is None:
        return
    directory, rank = settings
    me = threading.get_ident()
    if rank is None:
        import torch

        rank = _distributed_rank(torch)
    with _lock:
        _pending[:] = [p for p in _pending if p[0] != me]
    try:
        import torch

        data = pickle.dumps(torch.cuda.memory._snapshot(), protocol=pickle.HIGHEST_PROTOCOL)
        # Under a memory fraction PyTorch gives its observers the limit in
        # place of the device's total: the answer judges against the limit,
        # and tells memory held outside the allocator by the device's total.
        whole = torch.cuda.get_device_properties(int(device)).total_memory
        limit = int(device_total) if 0 < int(device_total) < whole else 0
        answer = _core._explain_snapshot(data, int(device), directory, -1 if rank is None else rank,
                                         int(whole if limit else device_total), _advise_command(), limit)
        lines = list(answer["lines"])
    except BaseException as e:  # noqa: BLE001 - the error in hand is PyTorch's, never ours
        lines = [f"reservoir: could not explain this out-of-memory error: {type(e).__name__}: {e}"]
    try:
        print("\n".join(lines), file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a closed stderr must not hide the error
        pass
    with _lock:
        _pending.append((me, int(device), f"Tried to allocate {format_size(int(alloc))}", lines))
        del _pending[:-_MAX_PENDING]


def format_size(n):
    """A size as PyTorch's messages write it (c10's format_size)."""
    if n <= 1024:
        return f"{n} bytes"
    if n <= 1 << 20:
        return f"{n / 1024:.2f} KiB"
    if n <= 1 << 30:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n / (1 << 30):.2f} GiB"


_GPU = re.compile(r"\bGPU (\d+)\b")


def _claim(message):
    """The pending answer for the error whose PyTorch message this is (see
    _pending), taken out of the list; None when none is for it."""
    gpu = _GPU.search(message)
    device = int(gpu.group(1)) if gpu else None
    me = threading.get_ident()
    with _lock:
        fits = [i for i, (_, d, request, _) in enumerate(_pending)
                if request in message and (device is None or d == device)]
        if not fits:
            return None
        own = [i for i in fits if _pending[i][0] == me]
        return _pending.pop((own or fits)[-1])[3]


def _patch_error(torch):
    """Appends the pending answer to the torch.OutOfMemoryError made for it
    (PyTorch makes it right after the observers ran, on the failing thread or
    on the one its error is handed to)."""
    global _patched
    if _patched:
        return
    cls = torch.OutOfMemoryError
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        if _pending and args and isinstance(args[0], str) and "\nreservoir" not in args[0]:
            lines = _claim(args[0])
            if lines:
                args = (args[0] + "\n" + "\n".join(lines),) + tuple(args[1:])
        original(self, *args, **kwargs)

    cls.__init__ = __init__
    _patched = True

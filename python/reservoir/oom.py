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
import sys
import threading

from . import _core

EXPLAIN_VARIABLE = "RESERVOIR_EXPLAIN_OOM"
DIRECTORY_VARIABLE = "RESERVOIR_OOM_DIR"
DEFAULT_MAX_ENTRIES = 100_000

_lock = threading.Lock()
_settings = None  # (directory, rank, host) once on
_pending = threading.local()  # the answer for the error the observer saw, per thread
_patched = False


def _directory(directory):
    if directory is not None:
        return os.path.abspath(os.fspath(directory))
    return os.path.abspath(os.environ.get(DIRECTORY_VARIABLE) or "reservoir-oom")


def _rank(rank):
    if rank is not None:
        return int(rank)
    value = os.environ.get("RANK", "")
    return int(value) if value.isdigit() else None


def explain_oom(directory=None, max_entries=DEFAULT_MAX_ENTRIES, rank=None, stacks=False):
    """Explains every CUDA out-of-memory error from now on (see the module's
    text). `stacks=True` records Python stacks too: the page then names the
    code that allocated the largest blocks, at several microseconds per
    allocation. Returns the directory the files go to."""
    import torch

    global _settings
    if max_entries < 1:
        raise ValueError(f"explain_oom: max_entries must be at least 1, not {max_entries}")
    directory = _directory(directory)
    rank = _rank(rank)
    with _lock:
        _settings = (directory, rank)
        from . import torch_installed

        if torch_installed():
            # reservoir serves PyTorch's allocations: it answers from its own
            # state, in its own error (no snapshot taken, no observer).
            _core._explain_torch_allocator(directory, -1 if rank is None else rank, max_entries)
            return directory
        torch.cuda.memory._record_memory_history(
            enabled="all", context="all" if stacks else None, stacks="python", max_entries=max_entries)
        _patch_error(torch)
        if not getattr(explain_oom, "_observing", False):
            torch._C._cuda_attach_out_of_memory_observer(_observer)
            explain_oom._observing = True
    return directory


def _observer(device, alloc, device_total, device_free):
    """PyTorch's out-of-memory observer: called before the error is raised,
    with the allocator's lock released (device_total: the memory fraction's
    limit instead where one is set)."""
    settings = _settings
    if settings is None:
        return
    directory, rank = settings
    _pending.lines = None
    try:
        import torch

        data = pickle.dumps(torch.cuda.memory._snapshot(), protocol=pickle.HIGHEST_PROTOCOL)
        answer = _core._explain_snapshot(data, int(device), directory, -1 if rank is None else rank,
                                         int(device_total))
        lines = list(answer["lines"])
    except BaseException as e:  # noqa: BLE001 - the error in hand is PyTorch's, never ours
        lines = [f"reservoir: could not explain this out-of-memory error: {type(e).__name__}: {e}"]
    try:
        print("\n".join(lines), file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a closed stderr must not hide the error
        pass
    _pending.lines = lines


def _patch_error(torch):
    """Appends the pending answer to the next torch.OutOfMemoryError made on
    this thread (PyTorch makes it right after the observers ran)."""
    global _patched
    if _patched:
        return
    cls = torch.OutOfMemoryError
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        lines = getattr(_pending, "lines", None)
        if lines and args and isinstance(args[0], str):
            _pending.lines = None
            args = (args[0] + "\n" + "\n".join(lines),) + tuple(args[1:])
        original(self, *args, **kwargs)

    cls.__init__ = __init__
    _patched = True

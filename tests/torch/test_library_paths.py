"""The default code paths of the libraries PyTorch calls, on reservoir's
simulated CUDA device, under PyTorch's allocator and under reservoir's own.

Kernels are skipped (RESERVOIR_SIMCUDA_KERNELS=skip): what is checked is
that each path runs as on a GPU and asks the caching allocator for what it
asks there: cuDNN's convolutions (through the backend API), batch norm and
LSTMs (the legacy API), scaled-dot-product attention with each backend
selected (flash, memory-efficient, cuDNN, math), the CUB-based ops (cumsum,
nonzero, sort, unique, topk) and an embedding's backward over 131,072
indices. Each program runs twice, in fresh interpreters: the allocation
sequence (every request's size, in order, and its free) must be the same
under both allocators, and the sizes cuDNN asks for are the simulated
cuDNN's model's (simcuda/cudnn_model.cpp), worked out by hand below.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

PRELUDE = """
import json, sys
import torch
import torch.nn.functional as F
events = []
def record():
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100000)
def requests():
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return [[e["action"], e["size"]] for t in snap["device_traces"] for e in t
            if e["action"] in ("alloc", "free_requested")]
def emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
"""


def run(body, allocator):
    env = {k: v for k, v in os.environ.items() if k != "RESERVOIR_TORCH_ALLOCATOR"}
    env["RESERVOIR_SIMCUDA_KERNELS"] = "skip"
    code = PRELUDE + textwrap.dedent(body)
    if allocator == "own":
        import reservoir
        site_dir = os.path.dirname(os.path.dirname(os.path.abspath(reservoir.__file__)))
        code = f"import site; site.addsitedir({site_dir!r})\n" + code
        env["RESERVOIR_TORCH_ALLOCATOR"] = "own"
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=600,
                       env=env)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"{allocator}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def both(body):
    """The program's result under PyTorch's allocator; it must be the same under reservoir's."""
    native = run(body, "native")
    if os.environ.get("RESERVOIR_EXPECT_OWN_ALLOCATOR") == "1":
        ours = run(body, "own")
        assert ours == native
    return native


def allocations(result):
    return [size for action, size in result["requests"] if action == "alloc"]


# A convolution net's forward and backward with cuDNN on: each convolution
# asks for its plan's workspace. The model's first engine (tensor cores)
# works on channels-last data and takes NCHW tensors' copies into its
# workspace: x, w and y, each 256-byte aligned; its second (CUDA cores)
# needs none.
CONV = """
torch.backends.cudnn.allow_tf32 = {tf32}
dtype = getattr(torch, "{dtype}")
net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                          torch.nn.Conv2d(16, 8, 3, padding=1)).cuda().to(dtype)
x = torch.randn(4, 3, 32, 32, device="cuda", dtype=dtype)
record()
y = net(x)
y.sum().backward()
emit(requests=requests(), cudnn=torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled)
"""


def aligned(n):
    return (n + 255) // 256 * 256


def workspace(x, w, y, element):
    return sum(aligned(element * a * b * c * d) for a, b, c, d in (x, w, y))


@pytest.mark.parametrize("dtype,element", [("float16", 2), ("bfloat16", 2)])
def test_convolutions_ask_for_their_cudnn_workspaces(dtype, element):
    result = both(CONV.format(dtype=dtype, tf32=True))
    assert result["cudnn"]
    sizes = allocations(result)
    # Forward: conv1 (x 4x3x32x32, w 16x3x3x3, y 4x16x32x32), conv2 (16 -> 8).
    conv1 = workspace((4, 3, 32, 32), (16, 3, 3, 3), (4, 16, 32, 32), element)
    conv2 = workspace((4, 16, 32, 32), (8, 16, 3, 3), (4, 8, 32, 32), element)
    # conv1's for its forward and its weights' gradient (x needs none);
    # conv2's for its forward, its input's and its weights' gradients.
    assert (sizes.count(conv1), sizes.count(conv2)) == (2, 3), sizes
    # No im2col column buffer: the largest request is an activation's, not
    # the (16*9) x (32*32) x 4 columns of a fallback convolution.
    assert max(sizes) < 16 * 9 * 32 * 32 * 4 * 4


@pytest.mark.parametrize("tf32", [True, False])
def test_float32_takes_the_engine_without_a_workspace(tf32):
    # PyTorch filters tensor-core and down-converting (TF32) engines out of a
    # float32 convolution's list: the CUDA-core engine runs, and no request
    # is a workspace of the tensor-core engine's.
    result = both(CONV.format(dtype="float32", tf32=tf32))
    sizes = allocations(result)
    assert result["cudnn"]
    conv1 = workspace((4, 3, 32, 32), (16, 3, 3, 3), (4, 16, 32, 32), 4)
    conv2 = workspace((4, 16, 32, 32), (8, 16, 3, 3), (4, 8, 32, 32), 4)
    assert conv1 not in sizes and conv2 not in sizes, sizes
    assert max(sizes) < 16 * 9 * 32 * 32 * 4 * 4


# An LSTM: PyTorch flattens its weights into one buffer of cuDNN's weight
# space, then keeps cuDNN's reserve for the backward pass.
LSTM = """
m = torch.nn.LSTM(32, 64, num_layers=2).cuda()
x = torch.randn(10, 4, 32, device="cuda", requires_grad=True)
record()
y, _ = m(x)
y.sum().backward()
emit(requests=requests(), weight_bytes=sum(p.numel() for p in m.parameters()) * 4)
"""


def test_lstm_takes_cudnns_weight_space_workspace_and_reserve():
    result = both(LSTM)
    # Weight space: layer 0 W_ih 256x32, W_hh 256x64, two biases of 256;
    # layer 1 W_ih 256x64, W_hh 256x64, two biases: 58,368 floats.
    assert result["weight_bytes"] == 58368 * 4
    sizes = allocations(result)
    # The reserve: 10 steps x 4 x 2 layers x (4 gates x 64 + h 64 + c 64) floats;
    # the workspace: 10 steps x 4 x 4 gates x 64 floats.
    assert 10 * 4 * 2 * (4 * 64 + 64 + 64) * 4 in sizes, sizes
    assert 10 * 4 * 4 * 64 * 4 in sizes, sizes


SDPA = """
from torch.nn.attention import sdpa_kernel, SDPBackend
backend = getattr(SDPBackend, "{backend}")
dtype = getattr(torch, "{dtype}")
q, k, v = (torch.randn(2, 8, 256, {head}, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
record()
with sdpa_kernel([backend]):
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o.sum().backward()
emit(requests=requests(), grads=[t.grad is not None for t in (q, k, v)])
"""


@pytest.mark.parametrize("backend,dtype,head", [
    ("FLASH_ATTENTION", "float16", 128),
    ("EFFICIENT_ATTENTION", "float16", 128),
    ("EFFICIENT_ATTENTION", "float32", 64),
    ("CUDNN_ATTENTION", "float16", 128),
    ("MATH", "float16", 128),
])
def test_each_attention_backend_runs_forward_and_backward(backend, dtype, head):
    result = both(SDPA.format(backend=backend, dtype=dtype, head=head))
    assert result["grads"] == [True, True, True]
    sizes = allocations(result)
    # The output and the three gradients, each 2 x 8 x 256 x head elements.
    element = 2 if dtype == "float16" else 4
    assert sizes.count(2 * 8 * 256 * head * element) >= 4, sizes
    if backend == "MATH":  # the attention matrix, 2 x 8 x 256 x 256, in fp16
        assert 2 * 8 * 256 * 256 * element in sizes


# CUB's ops. The counts they copy back to the host (nonzero's, unique's)
# are what a kernel would have written; with kernels skipped they are what
# the memory holds: zeros, as fresh pages are after empty_cache().
CUB = """
torch.cuda.empty_cache()
x = torch.zeros(100000, device="cuda")
i = torch.zeros(100000, dtype=torch.int64, device="cuda")
record()
c = x.cumsum(0)
s, order = x.sort()
t = x.topk(10)
n = x.nonzero()
u = i.unique()
emit(requests=requests(), shapes=[list(c.shape), list(s.shape), list(t.values.shape), list(n.shape), list(u.shape)])
"""


def test_cub_ops_run():
    result = both(CUB)
    assert result["shapes"] == [[100000], [100000], [10], [0, 1], [0]]
    sizes = allocations(result)
    assert 100000 * 4 in sizes and 100000 * 8 in sizes  # sort's values and indices


EMBEDDING = """
e = torch.nn.Embedding(50000, 64).cuda()
ix = torch.randint(0, 50000, (131072,), device="cuda")
record()
e(ix).sum().backward()
emit(requests=requests(), grad=list(e.weight.grad.shape))
"""


def test_embedding_backward_sorts_its_indices():
    result = both(EMBEDDING)
    assert result["grad"] == [50000, 64]
    sizes = allocations(result)
    assert 50000 * 64 * 4 in sizes  # the gradient
    assert sizes.count(131072 * 8) >= 2  # the sorted indices and their order

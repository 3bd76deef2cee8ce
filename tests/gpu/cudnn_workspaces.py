"""What cuDNN asks PyTorch's allocator for on this GPU: the allocation
sequence (every request's size, in order) of a convolution net's forward
and backward (float16, bfloat16 and float32, NCHW, and float16
channels-last), an LSTM's forward and backward, and cuDNN attention's
forward and backward, under PyTorch's own allocator with real kernels.
The same programs run on reservoir's simulated device in
tests/torch/test_library_paths.py; the figures this prints are what the
simulated cuDNN's model (simcuda/cudnn_model.cpp) is corrected by.

Prints one JSON line {"check": "cudnn", ...}: the cuDNN version, the device,
and each program's requests. Exit status 0 when every program ran; 77 when
there is no GPU (or no cuDNN).
"""
import json
import sys

import torch
import torch.nn.functional as F


def requests(fn):
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    fn()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return [e["size"] for t in snap["device_traces"] for e in t if e["action"] == "alloc"]


def conv_net(dtype, channels_last=False):
    def run():
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                                  torch.nn.Conv2d(16, 8, 3, padding=1)).cuda().to(dtype)
        x = torch.randn(4, 3, 32, 32, device="cuda", dtype=dtype)
        if channels_last:
            net = net.to(memory_format=torch.channels_last)
            x = x.to(memory_format=torch.channels_last)
        net(x).sum().backward()
    return run


def lstm():
    m = torch.nn.LSTM(32, 64, num_layers=2).cuda()
    x = torch.randn(10, 4, 32, device="cuda", requires_grad=True)
    y, _ = m(x)
    y.sum().backward()


def attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(2, 8, 256, 128, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()


def main():
    if not torch.cuda.is_available() or not torch.backends.cudnn.is_available():
        print("no GPU or no cuDNN here")
        return 77
    programs = {"conv_float16": conv_net(torch.float16), "conv_bfloat16": conv_net(torch.bfloat16),
                "conv_float32": conv_net(torch.float32),
                "conv_float16_channels_last": conv_net(torch.float16, channels_last=True),
                "lstm": lstm, "cudnn_attention": attention}
    recorded, errors = {}, {}
    for name, fn in programs.items():
        try:
            recorded[name] = requests(fn)
        except Exception as e:  # noqa: BLE001 - each program reports its own failure
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    print(json.dumps({"check": "cudnn", "ok": not errors, "cudnn": torch.backends.cudnn.version(),
                      "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "requests": recorded, "errors": errors}))
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())

"""What reservoir.explain_oom() costs a running program: PyTorch's history
recording, measured side by side in one process under PyTorch's allocator.

Three settings, each timed in turn (interleaved, so drift hits all alike):
  off       no recording (PyTorch's default)
  explain   explain_oom()'s: every event, no stacks, the latest 100,000
  stacks    explain_oom(stacks=True): every event with its Python stack

Two workloads: an allocate/free pair of a 16 KiB tensor (the allocator's
hot path, recording included), and a step of a small training loop (a
four-layer MLP, forward, backward and Adam). Medians of the repetitions,
and each setting's ratio to `off`.

On the simulated device (kernels skipped, so the allocator's share of a step
is far larger than on a GPU):
  PYTHONPATH=$HOME/.cache/reservoir/pypi/torch-2.15.0:build/python \
  LD_PRELOAD=build/simcuda/libcudart.so.13 RESERVOIR_SIMCUDA_KERNELS=skip \
  python3 bench/torch_recording_bench.py
On a GPU: the same without LD_PRELOAD and RESERVOIR_SIMCUDA_KERNELS (the GPU
bundle's `explain_oom` step runs it).
"""
import argparse
import json
import statistics
import sys
import time

import torch


def set_recording(mode):
    if mode == "off":
        torch.cuda.memory._record_memory_history(enabled=None)
    elif mode == "explain":
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                 max_entries=100_000)
    else:
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                 max_entries=100_000)


def pairs(n):
    t0 = time.perf_counter()
    for _ in range(n):
        x = torch.empty(16384, dtype=torch.uint8, device="cuda")
        del x
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def make_training():
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU())
                                  for _ in range(4)]).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.randn(64, 512, device="cuda")

    def steps(n):
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            loss = model(data).square().mean()
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    return steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repetitions", type=int, default=7)
    ap.add_argument("--pairs", type=int, default=20_000)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    modes = ("off", "explain", "stacks")
    steps = make_training()
    pairs(1000)
    steps(5)  # warm: the cache holds the step's blocks
    times = {(w, m): [] for w in ("pair", "step") for m in modes}
    for _ in range(args.repetitions):
        for m in modes:
            set_recording(m)
            times[("pair", m)].append(pairs(args.pairs))
            times[("step", m)].append(steps(args.steps))
    set_recording("off")
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
           "repetitions": args.repetitions}
    print(f"PyTorch {torch.__version__} on {out['device']}; medians of {args.repetitions}")
    print(f"{'workload':<28}{'off':>12}{'explain':>12}{'stacks':>12}{'explain/off':>13}{'stacks/off':>12}")
    for w, unit, scale in (("pair", "us per pair", 1e6), ("step", "ms per step", 1e3)):
        med = {m: statistics.median(times[(w, m)]) for m in modes}
        out[w] = {m: med[m] for m in modes}
        print(f"{w + ' (' + unit + ')':<28}" + "".join(f"{med[m] * scale:>12.2f}" for m in modes) +
              f"{med['explain'] / med['off']:>12.2f}x{med['stacks'] / med['off']:>11.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

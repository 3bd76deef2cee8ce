#!/usr/bin/env python3
"""Record allocation traces of real model architectures, as PyTorch snapshots.

Runs training steps of a GPT-style transformer, a ResNet and a diffusion
UNet on the CPU (with the PyTorch on PYTHONPATH: the tests use the newest
release the tests install; Debian's python3-torch 1.13 also works), and
records every storage the step creates and frees through a
TorchDispatchMode: the bytes a CUDA caching
allocator would have been asked for, in order, with the Python stack of the
model code that asked and the module path as annotations. The transformer
runs on the meta device, so a full-size model is traced without its memory;
the convolutional models run on real CPU tensors (PyTorch 1.13 has no meta
kernel for the convolution backward), at small sizes.

Each trace is written as a snapshot pickle (torch.cuda.memory._dump_snapshot's
layout: device_traces with alloc / free_requested / free_completed events and
frames; no segments, since no caching allocator ran), which `reservoir
replay`, `report`, `summary` and `export` read. Storage addresses are the
host's storage identities: unique while a storage lives, which is all a
replay needs.

    python3 scripts/record_torch_traces.py [--out DIR] [--steps N] [--only NAME] [--small]

--small records the reduced sizes committed as examples/traces/*.pickle.
"""
import argparse
import os
import pickle
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

THIS_FILE = os.path.abspath(__file__)


class Recorder(TorchDispatchMode):
    """Storages created and freed while active, with their context."""

    def __init__(self):
        super().__init__()
        self.events = []
        self.live = {}  # storage identity -> (weak reference, bytes, frames)
        self.annotations = []
        self._frame_cache = {}
        self._frames_cache = {}

    # -- context ---------------------------------------------------------------
    def _frame(self, filename, line, name):
        key = (filename, line, name)
        f = self._frame_cache.get(key)
        if f is None:  # one dict per distinct frame: the pickle stores it once
            f = self._frame_cache[key] = {"filename": filename, "line": line, "name": name}
        return f

    def _frames(self):
        stack = traceback.extract_stack()
        model_frames = [fs for fs in stack
                        if fs.filename == THIS_FILE and fs.name not in
                        ("_frames", "track", "__torch_dispatch__", "sweep", "main", "<module>")]
        frames = [self._frame(fs.filename, fs.lineno, fs.name) for fs in reversed(model_frames)]
        frames += [self._frame("<annotation>", 0, a) for a in reversed(self.annotations)]
        key = tuple(id(f) for f in frames)
        cached = self._frames_cache.get(key)
        if cached is None:
            cached = self._frames_cache[key] = frames
        return cached

    def push(self, name):
        self.annotations.append(name)

    def pop(self):
        self.annotations.pop()

    # -- storages --------------------------------------------------------------
    def _event(self, action, addr, size, frames):
        self.events.append({"action": action, "addr": addr, "size": size, "stream": 0,
                            "time_us": int(time.time() * 1e6), "frames": frames})

    def track(self, t):
        if not isinstance(t, torch.Tensor):
            return
        storage = t.storage()
        size = storage.nbytes()
        if size == 0:
            return
        ref = StorageWeakRef(storage)
        if ref.cdata in self.live:
            return  # a view of a storage already recorded
        frames = self._frames()
        self.live[ref.cdata] = (ref, size, frames)
        self._event("alloc", ref.cdata, size, frames)

    def sweep(self):
        for key, (ref, size, frames) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self._event("free_requested", key, size, frames)
                self._event("free_completed", key, size, frames)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sweep()  # storages dropped since the last op were freed before this one
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self.track(t)
        return out

    def snapshot(self):
        return {"segments": [], "device_traces": [self.events],
                "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""}}


def annotate_modules(model, recorder):
    """Module paths as annotations while each module's forward runs."""
    for name, module in model.named_modules():
        label = name or type(model).__name__
        module.register_forward_pre_hook(lambda m, i, label=label: recorder.push(label))
        module.register_forward_hook(lambda m, i, o: recorder.pop())


# -- models ------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, d, heads, dev):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, device=dev)
        self.proj = nn.Linear(d, d, device=dev)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (d // self.heads) ** 0.5)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = F.dropout(torch.softmax(att.masked_fill(mask, float("-inf")), dim=-1), 0.1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return F.dropout(self.proj(y), 0.1)


class Block(nn.Module):
    def __init__(self, d, heads, dev):
        super().__init__()
        self.ln1 = nn.LayerNorm(d, device=dev)
        self.attn = CausalSelfAttention(d, heads, dev)
        self.ln2 = nn.LayerNorm(d, device=dev)
        self.fc = nn.Linear(d, 4 * d, device=dev)
        self.out = nn.Linear(4 * d, d, device=dev)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)))), 0.1)


class GPT(nn.Module):
    def __init__(self, vocab, seq, d, layers, heads, dev):
        super().__init__()
        self.tok = nn.Embedding(vocab, d, device=dev)
        self.pos = nn.Embedding(seq, d, device=dev)
        self.blocks = nn.ModuleList([Block(d, heads, dev) for _ in range(layers)])
        self.ln = nn.LayerNorm(d, device=dev)
        self.head = nn.Linear(d, vocab, bias=False, device=dev)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet-18's layout (BasicBlock x [2, 2, 2, 2])."""

    def __init__(self, width, classes):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], width
        for i, cout in enumerate([width, 2 * width, 4 * width, 8 * width]):
            layers += [BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim):
        super().__init__()
        self.norm1 = nn.GroupNorm(8, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.temb = nn.Linear(tdim, cout)
        self.norm2 = nn.GroupNorm(8, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, t):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(F.silu(t))[:, :, None, None]
        h = self.conv2(F.dropout(F.silu(self.norm2(h)), 0.1))
        return h + self.skip(x)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = nn.GroupNorm(8, c)
        self.qkv = nn.Conv2d(c, 3 * c, 1)
        self.proj = nn.Conv2d(c, c, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, c, h * w).unbind(1)
        att = torch.softmax(q.transpose(1, 2) @ k / c ** 0.5, dim=-1)
        return x + self.proj((v @ att.transpose(1, 2)).reshape(b, c, h, w))


class UNet(nn.Module):
    """A DDPM-style UNet: residual blocks with time embedding, attention at
    the lowest resolutions, skip connections."""

    def __init__(self, ch, mults=(1, 2, 4)):
        super().__init__()
        self.ch = ch
        tdim = 4 * ch
        self.time = nn.Sequential(nn.Linear(ch, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.inp = nn.Conv2d(3, ch, 3, padding=1)
        self.down = nn.ModuleList()
        chans, c = [ch], ch
        for i, m in enumerate(mults):
            for _ in range(2):
                self.down.append(ResBlock(c, ch * m, tdim))
                c = ch * m
                chans.append(c)
            if i != len(mults) - 1:
                self.down.append(nn.Conv2d(c, c, 3, stride=2, padding=1))
                chans.append(c)
        self.mid1, self.mid_attn, self.mid2 = ResBlock(c, c, tdim), Attention(c), ResBlock(c, c, tdim)
        self.up = nn.ModuleList()
        for i, m in reversed(list(enumerate(mults))):
            for _ in range(3):
                self.up.append(ResBlock(c + chans.pop(), ch * m, tdim))
                c = ch * m
            if i == len(mults) - 1:
                self.up.append(Attention(c))
            if i != 0:
                self.up.append(nn.Upsample(scale_factor=2, mode="nearest"))
        self.out = nn.Sequential(nn.GroupNorm(8, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))

    def embed_time(self, t):
        half = self.ch // 2
        freqs = torch.exp(-torch.arange(half, dtype=torch.float32) * (9.21 / half))
        args = t[:, None].float() * freqs[None]
        return self.time(torch.cat([torch.sin(args), torch.cos(args)], dim=1))

    def forward(self, x, t):
        temb = self.embed_time(t)
        hs = [self.inp(x)]
        h = hs[-1]
        for layer in self.down:
            h = layer(h, temb) if isinstance(layer, ResBlock) else layer(h)
            hs.append(h)
        h = self.mid2(self.mid_attn(self.mid1(h, temb)), temb)
        for layer in self.up:
            if isinstance(layer, ResBlock):
                h = layer(torch.cat([h, hs.pop()], dim=1), temb)
            else:
                h = layer(h)
        return self.out(h)


# -- training steps -------------------------------------------------------------------
def train(name, model, batch_fn, loss_fn, steps, recorder):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    annotate_modules(model, recorder)
    with recorder:
        recorder.push("load")
        for t in list(model.parameters()) + list(model.buffers()):
            recorder.track(t)
        recorder.pop()
        for step in range(steps):
            recorder.push(f"step{step}")
            recorder.push("data")
            inputs = batch_fn()
            recorder.pop()
            recorder.push("forward")
            loss = loss_fn(model, *inputs)
            recorder.pop()
            recorder.push("backward")
            loss.backward()
            del loss, inputs
            recorder.pop()
            recorder.push("optimizer")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            recorder.pop()
            recorder.sweep()
            recorder.pop()
    print(f"{name}: {len(recorder.events)} events, "
          f"{sum(1 for e in recorder.events if e['action'] == 'alloc')} allocations",
          file=sys.stderr)


def gpt(steps, small):
    dev = torch.device("meta")
    vocab, seq, d, layers, heads, batch = ((50257, 512, 768, 6, 12, 8) if small else
                                           (50257, 1024, 768, 12, 12, 16))
    model = GPT(vocab, seq, d, layers, heads, dev)
    rec = Recorder()

    def batch_fn():
        return (torch.zeros(batch, seq, dtype=torch.long, device=dev),
                torch.zeros(batch, seq, dtype=torch.long, device=dev))

    def loss_fn(m, idx, targets):
        logits = m(idx)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    train("gpt", model, batch_fn, loss_fn, steps, rec)
    return rec


def resnet(steps, small):
    torch.manual_seed(0)
    width, batch, res = (32, 16, 64) if small else (64, 32, 128)
    model = ResNet(width, 100)
    rec = Recorder()

    def batch_fn():
        return torch.randn(batch, 3, res, res), torch.randint(0, 100, (batch,))

    train("resnet", model, batch_fn, lambda m, x, y: F.cross_entropy(m(x), y), steps, rec)
    return rec


def unet(steps, small):
    torch.manual_seed(0)
    ch, batch, res = (32, 8, 32) if small else (64, 16, 64)
    model = UNet(ch)
    rec = Recorder()

    def batch_fn():
        x0 = torch.randn(batch, 3, res, res)
        t = torch.randint(0, 1000, (batch,))
        noise = torch.randn_like(x0)
        return x0 * 0.7 + noise * 0.7, t, noise

    train("unet", model, batch_fn, lambda m, x, t, n: F.mse_loss(m(x, t), n), steps, rec)
    return rec


MODELS = {"gpt_training": gpt, "resnet_training": resnet, "unet_training": unet}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="examples/traces")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", choices=sorted(MODELS))
    parser.add_argument("--small", action="store_true", help="the sizes of the committed examples")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name, fn in MODELS.items():
        if args.only and name != args.only:
            continue
        rec = fn(args.steps, args.small)
        path = os.path.join(args.out, f"{name}.pickle")
        with open(path, "wb") as f:
            pickle.dump(rec.snapshot(), f, protocol=4)
        print(f"wrote {path} ({os.path.getsize(path)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()

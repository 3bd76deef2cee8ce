#!/usr/bin/env python3
"""Writes the bundled example traces (examples/traces/*.trace).

Each is a seeded model of a real workload's allocation pattern, written in
reservoir's text format (docs/replay.md). Run it again to regenerate the files;
the output is deterministic.
"""
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "examples", "traces")


class Writer:
    def __init__(self, header):
        self.lines = ["reservoir-trace 1", f"# {header}"]
        self.next_id = 0
        self.live = {}

    def alloc(self, size, stream=0):
        i = self.next_id
        self.next_id += 1
        self.live[i] = size
        self.lines.append(f"alloc {i} {size}" + (f" stream {stream}" if stream else ""))
        return i

    def free(self, i):
        del self.live[i]
        self.lines.append(f"free {i}")

    def save(self, name):
        with open(os.path.join(OUT, name), "w") as f:
            f.write("\n".join(self.lines) + "\n")


def transformer_training():
    """GPT-style decoder training: weights, AdamW state, activations saved in the
    forward pass and released in reverse during backward, gradients, and an
    optimizer step; the batch's sequence length varies from step to step."""
    rng = random.Random(1)
    w = Writer("GPT-style training: 12 layers, d_model 1024, bf16 activations, fp32 master weights")
    layers, d, vocab, batch = 12, 1024, 32000, 8
    params = []
    for _ in range(layers):
        for shape in [(d, 3 * d), (3 * d,), (d, d), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,), (d,), (d,)]:
            n = 1
            for s in shape:
                n *= s
            params.append(n * 4)
    params.append(vocab * d * 4)
    weights = [w.alloc(p) for p in params]
    adam = [w.alloc(p) for p in params for _ in range(2)]
    for step in range(6):
        seq = rng.choice([384, 448, 512])
        tokens = batch * seq
        saved = []
        x = w.alloc(tokens * d * 2)
        for _ in range(layers):
            ln = w.alloc(tokens * d * 2)
            qkv = w.alloc(tokens * 3 * d * 2)
            scores = w.alloc(batch * 16 * seq * seq * 2)
            probs = w.alloc(batch * 16 * seq * seq * 2)
            w.free(scores)
            attn = w.alloc(tokens * d * 2)
            proj = w.alloc(tokens * d * 2)
            h = w.alloc(tokens * 4 * d * 2)
            act = w.alloc(tokens * 4 * d * 2)
            out = w.alloc(tokens * d * 2)
            stats = w.alloc(tokens * 4)
            saved.append([ln, qkv, probs, attn, proj, h, act, stats])
            w.free(x)
            x = out
        logits = w.alloc(tokens * vocab * 2)
        loss = w.alloc(4)
        grad_logits = w.alloc(tokens * vocab * 2)
        w.free(logits)
        grad = w.alloc(tokens * d * 2)
        w.free(grad_logits)
        grads = []
        for layer in reversed(saved):
            tmp = w.alloc(tokens * 4 * d * 2)
            grads.extend(w.alloc(p) for p in params[:10])
            for t in layer:
                w.free(t)
            nxt = w.alloc(tokens * d * 2)
            w.free(tmp)
            w.free(grad)
            grad = nxt
        w.free(grad)
        w.free(loss)
        w.free(x)
        for g in grads:
            w.free(g)
    w.save("transformer_training.trace")


def inference_varying_batch():
    """LLM serving: a KV cache grown per request batch, decode steps with
    temporary buffers, batches of varying size and length (the pattern that
    fragments a caching allocator)."""
    rng = random.Random(2)
    w = Writer("LLM serving: 24 layers, d_model 2048, varying batches and prompt lengths")
    layers, d = 24, 2048
    weights = [w.alloc(d * d * 2 * 12) for _ in range(layers)]
    for request in range(60):
        batch = rng.randint(1, 16)
        prompt = rng.randint(64, 1024)
        kv = [w.alloc(batch * (prompt + 64) * d * 2) for _ in range(2 * layers)]
        for _ in range(prompt // 256 + 1):
            tmp = [w.alloc(batch * prompt * d * 2 * rng.choice([1, 3, 4])) for _ in range(4)]
            for t in tmp:
                w.free(t)
        for step in range(8):
            logits = w.alloc(batch * 32000 * 2)
            small = [w.alloc(rng.choice([512, 2048, 8192, 65536])) for _ in range(6)]
            for s in small:
                w.free(s)
            w.free(logits)
        for k in kv:
            w.free(k)
        if request % 20 == 19:
            w.lines.append("empty_cache")
    w.save("inference_varying_batch.trace")


def multistream_mixed():
    """A data pipeline and a compute stream sharing the device: many small and
    medium buffers with lifetimes that overlap across two streams."""
    rng = random.Random(3)
    w = Writer("two streams: a loader staging batches, a compute stream with mixed buffers")
    live = []
    for i in range(20000):
        stream = 1 if rng.random() < 0.3 else 0
        r = rng.random()
        if r < 0.5:
            size = rng.randint(1, 256) * 512
        elif r < 0.85:
            size = rng.randint(1, 40) * 262144 + rng.randint(0, 511)
        else:
            size = rng.randint(10, 300) * 1048576
        live.append(w.alloc(size, stream))
        while len(live) > 60 or (live and rng.random() < 0.45):
            w.free(live.pop(rng.randrange(len(live))))
    for i in live:
        w.free(i)
    w.save("multistream_mixed.trace")


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    transformer_training()
    inference_varying_batch()
    multistream_mixed()

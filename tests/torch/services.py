"""Programs that catch error after error, as services and batch finders do,
run on the simulated device (kernels skipped: only what each step
allocates, in the order a GPU would see it, matters here).

    python services.py SERVICE [--upto N] [--alone N]

SERVICE is one of:
  pipeline  an image pipeline service (weights, then per request of px
            pixels x n images: denoising steps whose attention blocks grow
            with the fourth power of the side, then a decoder at full size);
  generate  a text-generation service (weights, then per request of b
            sequences: a prompt's prefill, then a KV cache grown by
            reallocation every 16 tokens and a logits block per token);
  finder    a batch-size finder (weights, then a step at batch 16,384 shrunk
            by an eighth after each error until one completes).

Each request prints one RESULT line: its index, whether it completed, and,
where it failed, PyTorch's message, the size the failed allocation asked
for and which of the request's allocations it was (1: its first). --upto N stops after request N; --alone N serves request N alone, right
after the weights. FRACTION in the environment: the memory fraction to set.
"""
import json
import os
import random
import sys

import torch

MiB = 1 << 20
KiB = 1 << 10


def report(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def empty(nbytes):
    return torch.empty(int(nbytes), dtype=torch.uint8, device="cuda")


def weights(total, piece=16 * MiB):
    return [empty(piece) for _ in range(total // piece)]


def pipeline_requests():
    rng = random.Random(7)
    return [(rng.choice((512, 768, 1024)), rng.randint(1, 4)) for _ in range(24)]


def pipeline_step(request):
    px, n = request
    tokens = (px // 16) ** 2
    latents = empty(n * 4 * (px // 8) ** 2 * 2)
    for _ in range(3):  # denoising steps, classifier-free guidance doubling the batch
        held = []
        for channels in (320, 640, 1280):
            held.append(empty(2 * n * tokens * channels * 2))
            scores = empty(2 * n * 8 * tokens * tokens * 2)
            probs = empty(2 * n * 8 * tokens * tokens * 2)
            del scores
            held.append(empty(2 * n * tokens * channels * 2))
            del probs
        del held
    # The decoder at full size: two activations of 128 channels alive at once.
    first = empty(n * 128 * px * px * 2)
    second = empty(n * 128 * px * px * 2)
    del first
    image = empty(n * 3 * px * px)
    del second, latents
    return image


def generate_requests():
    rng = random.Random(11)
    return [(rng.choice((1, 4, 8, 16, 32)), rng.choice((128, 512, 2048)), rng.choice((32, 128)))
            for _ in range(24)]


def generate_step(request):
    batch, prompt, new = request
    per_token = 64 * KiB  # 8 layers x keys and values x 2,048 x 2 bytes
    scores = empty(batch * 16 * prompt * prompt * 2)  # the prefill's attention
    cache = empty(batch * prompt * per_token)
    del scores
    length = prompt
    for t in range(new):
        if t % 16 == 0:  # the cache grows by reallocation, as torch.cat does
            grown = empty(batch * (length + 16) * per_token)
            del cache
            cache = grown
        logits = empty(batch * 32000 * 4)
        del logits
        length += 1
    return cache


def finder_requests():
    batches, batch = [], 16384
    while batch >= 1:
        batches.append(batch)
        batch = batch * 7 // 8
    return batches


def finder_step(batch):
    return [empty(batch * per) for per in (64 * KiB, 96 * KiB, 32 * KiB)]


SERVICES = {
    "pipeline": (1600 * MiB, pipeline_requests, pipeline_step),
    "generate": (1024 * MiB, generate_requests, generate_step),
    "finder": (150 * MiB, finder_requests, finder_step),
}


def main():
    name = sys.argv[1]
    args = dict(zip(sys.argv[2::2], sys.argv[3::2]))
    if os.environ.get("FRACTION"):
        torch.cuda.set_per_process_memory_fraction(float(os.environ["FRACTION"]))
    held, requests, step = SERVICES[name]
    requests = requests()
    indices = range(len(requests))
    if "--alone" in args:
        indices = [int(args["--alone"])]
    elif "--upto" in args:
        indices = range(int(args["--upto"]) + 1)
    w = weights(held)
    for i in indices:
        failed, calls = [], [0]
        original = torch.empty

        def empty_seen(*a, **k):
            calls[0] += 1
            try:
                return original(*a, **k)
            except torch.OutOfMemoryError:
                failed.append((int(a[0]), calls[0]))
                raise

        torch.empty = empty_seen
        try:
            out = step(requests[i])
            del out
            report(i=i, request=requests[i], ok=True)
        except torch.OutOfMemoryError as e:
            size, at = failed[0] if failed else (None, None)
            report(i=i, request=requests[i], ok=False, size=size, at=at, message=str(e))
            if name == "finder":
                continue
        finally:
            torch.empty = original
        if name == "finder" and not failed:
            break
    del w


if __name__ == "__main__":
    main()

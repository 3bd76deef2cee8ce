import torch, pickle, sys, os
torch.cuda.memory._record_memory_history(max_entries=100000)
s2 = torch.cuda.Stream()
keep = []
for i in range(200):
    n = [512, 4096, 1<<20, 3<<20, 25<<20, 300<<20][i % 6] + i
    t = torch.empty(n, dtype=torch.uint8, device='cuda')
    if i % 3: keep.append(t)
    if i % 7 == 0 and keep: keep.pop(0)
    if i % 50 == 49: torch.cuda.empty_cache()
with torch.cuda.stream(s2):
    u = torch.empty(5<<20, dtype=torch.uint8, device='cuda')
del u
torch.cuda.memory._dump_snapshot(sys.argv[1])
print(torch.cuda.memory_reserved(), torch.cuda.memory_allocated())

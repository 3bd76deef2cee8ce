import torch, sys
torch.cuda.memory._record_memory_history(max_entries=100000)
MB=1<<20
x = torch.empty(400*MB, dtype=torch.uint8, device='cuda')   # low addresses
a = torch.empty(300*MB+41, dtype=torch.uint8, device='cuda') # older segment, higher address
del x; torch.cuda.empty_cache()
b = torch.empty(300*MB+41, dtype=torch.uint8, device='cuda') # newer segment, lower address (first fit)
c = torch.empty(MB+44, dtype=torch.uint8, device='cuda')
print(torch.__version__, 'a', hex(a.data_ptr()), 'b', hex(b.data_ptr()), 'c', hex(c.data_ptr()), 'in', 'a' if a.data_ptr() < c.data_ptr() < a.data_ptr()+400*MB else 'b')
torch.cuda.memory._dump_snapshot(sys.argv[1])

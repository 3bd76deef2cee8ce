"""The GPU bundle's driver (run_steps.py) on a machine without a GPU, with
stand-ins for what only a GPU machine has: the GPU programs (gpu_test,
gpu_bench, cuda_probe) are scripts that print and write what the real ones
do on a GPU, a `torch` package that says CUDA is available, nvidia-smi, and
the PyTorch test scripts. The bundle's real CLI, libraries and extension
module stay. This exercises every step's parsing and bookkeeping, which
otherwise first runs on a GPU machine: the figures land in results.json,
the summary names each step, and a failing step does not stop the others.

Usage: driver_test.py BUNDLE_DIR
"""
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile

from checks import check, finish

bundle = os.path.abspath(sys.argv[1])


def write(path, text, executable=False):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    if executable:
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


PY = sys.executable

GPU_TEST = f"""#!{PY}
import json, sys
args = sys.argv[1:]
if "--gtest_list_tests" in args:
    print("Gpu.\\n  RuntimeDeviceSegmentsEventsAndCopies")
    sys.exit(0)
out = [a.split("json:", 1)[1] for a in args if a.startswith("--gtest_output=json:")][0]
fail = {{fail}}
tests = [{{"name": "RuntimeDeviceSegmentsEventsAndCopies", "time": "0.25s"}},
         {{"name": "VmmDeviceMapsAndUnmapsRealMemory", "time": "0.5s"}}]
if fail:
    tests[1]["failures"] = [{{"failure": "gpu_test.cpp:70\\nExpected equality"}}]
json.dump({{"testsuites": [{{"name": "Gpu", "testsuite": tests}}]}}, open(out, "w"))
print("granularity 2097152, GPUDirect RDMA yes")
if fail:
    print("tests/gpu/gpu_test.cpp:70: Failure")
    print("Expected equality of these values: d->unmap(va, 3 * g) Which is: 3")
    print("[  FAILED  ] Gpu.VmmDeviceMapsAndUnmapsRealMemory (12 ms)")
    sys.exit(1)
print("[  PASSED  ] 2 tests.")
"""

GPU_BENCH = f"""#!{PY}
import json, sys
args = sys.argv[1:]
if "--benchmark_list_tests" in args:
    print("BM_Reservoir_CacheHit/4096/real_time")
    sys.exit(0)
out = [a.split("=", 1)[1] for a in args if a.startswith("--benchmark_out=")][0]
benchmarks = []
if "--benchmark_filter=^BM_" in args:
    for name, t in (("BM_Reservoir_CacheHit/4096/real_time", 40.0),
                    ("BM_CudaMalloc_Free/4096/real_time", 9000.0)):
        for agg, v in (("mean", t * 1.1), ("median", t), ("stddev", 1.0)):
            benchmarks.append({{"name": name + "_" + agg, "run_name": name, "run_type": "aggregate",
                               "aggregate_name": agg, "real_time": v, "time_unit": "ns", "iterations": 5}})
    benchmarks.append({{"name": "BM_Vmm_CreateMapUnmapRelease/2097152/real_time_median",
                       "run_name": "BM_Vmm_CreateMapUnmapRelease/2097152/real_time", "run_type": "aggregate",
                       "aggregate_name": "median", "real_time": 30000.0, "time_unit": "ns",
                       "iterations": 5, "per_2MiB_page_ns": 30000.0}})
else:
    for mib in (1024, 4096, 16384):
        for name, gib_s in (("Copy_DeviceToPinned", 50.0), ("Copy_PinnedToDevice", 52.0),
                            ("Pause_Backup", 45.0), ("Resume_Backup", 47.0)):
            benchmarks.append({{"name": f"{{name}}/{{mib}}/0/iterations:5/manual_time",
                               "run_name": f"{{name}}/{{mib}}/0/iterations:5/manual_time",
                               "run_type": "iteration", "real_time": 20.0, "time_unit": "ms",
                               "iterations": 5, "median_ms": 20.0, "median_GiB_per_s": gib_s}})
json.dump({{"context": {{"host_name": "gpu", "num_cpus": 16}}, "benchmarks": benchmarks}}, open(out, "w"))
"""

CUDA_PROBE = f"""#!{PY}
import json, os
print("cuda_probe: ok, 31 allocations checked, checksum 00ff00ff00ff00ff")
stats = os.environ.get("RESERVOIR_PRELOAD_STATS")
if stats and os.environ.get("LD_PRELOAD", "").endswith("libreservoir_preload.so"):
    json.dump({{"0": {{"allocation.all.allocated": 31, "segment.all.allocated": 9,
                       "allocated_bytes.all.current": 0, "reserved_bytes.all.peak": 123}}}}, open(stats, "w"))
"""

NVIDIA_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=*) echo "NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB, 9.0, 00000000:00:05.0" ;;
  *) echo "| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: 13.0 |" ;;
esac
"""

FAKE_TORCH = '''__version__ = "2.11.0+cu130"
class version:
    cuda = "13.0"
class cuda:
    @staticmethod
    def is_available():
        return True
    @staticmethod
    def get_device_name(i):
        return "NVIDIA H100 80GB HBM3"
    @staticmethod
    def device_count():
        return 1
'''
FAKE_CPP_EXTENSION = "def verify_ninja_availability():\n    pass\n"

TRAINING = '''import json
print(json.dumps({"native": {"losses": ["0x1p+0"], "steps_per_second": 10.0},
                  "reservoir": {"losses": ["0x1p+0"], "steps_per_second": 10.5}}))
print("steps per second: native 10.00, reservoir 10.50")
print("identical losses and request statistics")
'''
PAUSE = '''import json
for c in ("", "expandable_segments:True", "policy:paging"):
    print(f"config '{c}': 1.00 GiB  pause 20.0 GiB/s (pinned copy 22.0)  resume 19.0 GiB/s (pinned copy 21.0)")
print(json.dumps({"freed": 1, "released": 1, "cycles": []}))
print("OK")
'''
PRELOAD = '''import json
print("preload: PyTorch made 4 device allocations (segments); reservoir served 4, peak reserved 1 bytes")
print(json.dumps({"plain": {"losses": ["0x1p+0"]}}))
'''
NATIVE = '''import json
print(json.dumps({"cache_hit": {"4096": {"torch": 100.0, "reservoir": 60.0}},
                  "ratio_reservoir_over_torch": {"4096": 0.6, "1048576": 0.62}}))
'''

SAVERS = '''import json
for impl, p, r in (("torch_memory_saver", 20.0, 21.0), ("reservoir", 22.0, 23.0)):
    print(json.dumps({"impl": impl, "gib": 1, "cycles": 3, "pause_GiB_per_s": p, "resume_GiB_per_s": r,
                      "released_bytes": 2 << 30, "expected_release": 2 << 30, "addresses_and_bytes_kept": True}))
'''
RMM = '''import json
for impl, ns in (("torch_native", 900.0), ("reservoir", 700.0), ("reservoir_paging", 710.0),
                 ("rmm_cuda", 9000.0), ("rmm_pool", 1500.0), ("rmm_arena", 1400.0), ("rmm_cuda_async", 1300.0)):
    print(json.dumps({"impl": impl, "hit_pair_ns": {"4096": ns, "1048576": ns, "67108864": ns},
                      "growth_us_median": 5.0, "growth_us_first": 6.0, "pairs": 2000}))
'''

OWN = '''import json
for config, seconds in (("native", 2.0), ("", 1.9), ("expandable_segments:True", 2.1), ("policy:paging", 2.0)):
    print(json.dumps({"config": config, "seconds": seconds, "live": 1, "reserved_after_empty_cache": 2,
                      "oom_under_fraction": "OutOfMemoryError", "graph_same_as_eager": True}))
print("identical losses under 3 reservoir policies and native (own allocator)")
'''


GRAPHS = '''import json, os, time
time.sleep(float(os.environ.get("STANDIN_SLEEP", "0")))  # a step that outlives its limit
print(json.dumps({"check": "stream_capture", "ok": True, "answers": 61, "differ": {"merge: wait": {"gpu": 905,
                  "simulated": 902}}}))
print(json.dumps({"check": "pools", "ok": True, "differ": [], "errors": {}}))
print(json.dumps({"check": "eager_vs_graph", "ok": True, "policies": {}}))
print(json.dumps({"check": "rl_loop", "ok": True, "runs": {}}))
print(json.dumps({"checks": {"stream_capture": True, "pools": True, "eager_vs_graph": True, "rl_loop": True}}))
'''

CUDNN = '''import json
print(json.dumps({"check": "cudnn", "ok": True, "cudnn": 92600, "device": "NVIDIA H100 80GB HBM3",
                  "torch": "2.11.0", "requests": {"conv_float16": [131072, 156672], "lstm": [233472]},
                  "errors": {}}))
'''

EXPLAIN = '''import json
print(json.dumps({"check": "answer", "ok": True, "lines": ["reservoir: out of memory on a 1000.00 MiB request: x"],
                  "files": ["h-1.pickle", "h-1-advice.html"], "seconds_at_error": 0.4}))
print(json.dumps({"check": "batch_finder", "ok": True, "problems": [], "cap_bytes": 4 << 30, "batch": 14000,
                  "errors": 11, "plain_seconds": 0.2,
                  "explained": {
                      "pytorch": {"allocator": "native", "errors": 11, "seconds": 3.5, "ms_per_error": 300.0},
                      "own": {"allocator": "reservoir", "errors": 11, "seconds": 1.3, "ms_per_error": 100.0}}}))
print(json.dumps({"check": "recording_cost", "ok": True, "pair": {"off": 10.0, "explain": 12.0, "stacks": 30.0},
                  "step": {"off": 2.0, "explain": 2.1, "stacks": 3.0}}))
print(json.dumps({"checks": {"answer": True, "batch_finder": True, "recording_cost": True}}))
'''

NATIVE_PAGED = '''import json
pair = {"calls": 4000, "same_program": True, "identical_losses": True, "calls_above_native": 0,
        "most_above_native_bytes": 0, "first_call_above": None,
        "peak_reserved": {"native": 600 << 20, "native_paged": 580 << 20}, "reserved_below_native_calls": 3000,
        "steps_per_second": {"native": 20.0, "native_paged": 19.5}}
print(json.dumps({"check": "native_paged", "torch": "2.11.0", "ok": True,
                  "pairs": {"2.11 (running)": pair, "pytorch_version:2.15": pair}}))
'''

# bench/torch_service.py: the arguments the step gives, and its figures
# written where --json says.
SERVICE = '''import argparse, json
p = argparse.ArgumentParser()
for a in ("--requests", "--explained", "--timeout", "--json"):
    p.add_argument(a)
a = p.parse_args()
assert (a.requests, a.explained) == ("2000", "300"), a
row = lambda served, failed, frag: {"served": served, "failed": failed, "fragmentation": frag,
                                    "peak_reserved_GiB": 11.8, "ms_per_request": 0.2}
service = {"default": row(1640, 360, 21), "expandable": row(1655, 345, 0), "native": row(1640, 360, 21),
           "native_paged": row(1655, 345, 0)}
explained = {m: {"failed": 52, "ms_per_failed": ms, "ms_per_failed_without": 0.1,
                 "verdicts": {"agree": 52, "disagree": 0, "none": 0}}
             for m, ms in (("default", 310.0), ("expandable", 320.0), ("native", 55.0), ("native_paged", 60.0))}
json.dump({"service": service, "explained": explained, "errors": None}, open(a.json, "w"))
'''

# scripts/peer_suites.py --device as-is: the arguments the step gives, the
# wheels it installed where it says, then a report of three tests.
PEERS = '''import argparse, json, os, sys
p = argparse.ArgumentParser()
for a in ("--device", "--pytorch", "--package", "--site", "--jobs", "--timeout", "--json"):
    p.add_argument(a)
p.add_argument("--batch", action="store_true")
a = p.parse_args()
assert a.device == "as-is" and a.batch and a.jobs == "1", a
assert open(a.pytorch).read() == "# test_cuda.py\\n", a.pytorch
assert os.path.isfile(os.path.join(a.package, "reservoir_autoinstall.pth")), os.listdir(a.package)
for name in ("expecttest", "psutil", "pynvml.py", "pytest", "pluggy", "iniconfig", "pygments", "packaging"):
    assert os.path.exists(os.path.join(a.site, name)), os.listdir(a.site)
results = {"test_cuda.py::TestCuda::test_memory_stats": ["pass", "pass"],
           "test_cuda.py::TestCuda::test_out_of_memory": ["pass", "pass"],
           "test_cuda.py::TestCuda::test_graph_memory_stats": ["skip", "skip"],
           "test_cuda.py::TestCuda::test_cudart_register": ["fail", "fail"]}
json.dump({"pytorch": {"release": "2.11.0", "results": results, "differ": [],
                       "passes": {"pytorch": 2, "reservoir": 2}}}, open(a.json, "w"))
print("passes: PyTorch's allocator 2 of 4, reservoir's 2")
'''


def make_fake(top, fail_gpu_test):
    fake = os.path.join(top, "gpu-bundle")
    shutil.copytree(bundle, fake)
    write(os.path.join(fake, "bin", "gpu_test"), GPU_TEST.replace("{fail}", str(fail_gpu_test)), True)
    write(os.path.join(fake, "bin", "gpu_bench"), GPU_BENCH, True)
    write(os.path.join(fake, "bin", "cuda_probe"), CUDA_PROBE, True)
    for name, text in (("torch_training_test.py", TRAINING), ("torch_pause_test.py", PAUSE),
                       ("torch_preload_test.py", PRELOAD), ("torch_native_bench.py", NATIVE),
                       ("torch_saver_compare.py", SAVERS), ("rmm_compare.py", RMM),
                       ("own_allocator_check.py", OWN), ("graphs_check.py", GRAPHS),
                       ("explain_oom_check.py", EXPLAIN), ("native_paged_check.py", NATIVE_PAGED),
                       ("cudnn_workspaces.py", CUDNN),
                       ("torch_service.py", SERVICE),
                       ("peer_suites.py", PEERS)):
        write(os.path.join(fake, "tests", name), text)
    tools = os.path.join(top, "tools")
    write(os.path.join(tools, "nvidia-smi"), NVIDIA_SMI, True)
    write(os.path.join(tools, "c++"), "#!/bin/sh\nexit 0\n", True)
    site = os.path.join(top, "site")
    write(os.path.join(site, "torch", "__init__.py"), FAKE_TORCH)
    write(os.path.join(site, "torch", "utils", "__init__.py"), "")
    write(os.path.join(site, "torch", "utils", "cpp_extension.py"), FAKE_CPP_EXTENSION)
    # python3 on PATH is the CPython 3.12 the module was built for, with the
    # stand-in torch importable, as on the GPU machines.
    with open(os.path.join(bundle, "BUILD_INFO.json")) as f:
        py312 = json.load(f)["python_used"]
    write(os.path.join(tools, "python3"), f'#!/bin/sh\nPYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}" '
          f'exec {py312} "$@"\n', True)
    return fake, tools


def run(fail_gpu_test, *args, env=None, results=True):
    top = tempfile.mkdtemp(prefix="bundle-driver-")
    fake, tools = make_fake(top, fail_gpu_test)
    write(os.path.join(top, "peers", "test_cuda.py"), "# test_cuda.py\n")
    out = os.path.join(top, "out")
    env = {"PATH": f"{tools}:/usr/local/bin:/usr/bin:/bin", "HOME": top, **(env or {})}
    args = args or ("--test-cuda", "peers/test_cuda.py")
    p = subprocess.run(["/bin/bash", os.path.join(fake, "run.sh"), out, *args], env=env, cwd=top,
                       capture_output=True, text=True, timeout=600)
    if not results:
        shutil.rmtree(top, ignore_errors=True)
        return p.returncode, p.stdout + p.stderr, None, None
    with open(os.path.join(out, "results.json")) as f:
        results = json.load(f)
    with open(os.path.join(out, "summary.txt")) as f:
        summary = f.read()
    shutil.rmtree(top, ignore_errors=True)
    return p.returncode, p.stdout + p.stderr, results, summary


# Every step passes.
rc, text, r, summary = run(False)
print(summary)
steps = r["steps"]
check(rc == 0, f"all steps pass: exit {rc}")
check(all(s["status"] == "passed" for s in steps.values()),
      "every step passed: " + ", ".join(f"{k} {v['status']} ({v['note'][:60]})" for k, v in steps.items()))
facts = r["facts"]
check(facts.get("gpus", [{}])[0].get("name") == "NVIDIA H100 80GB HBM3" and
      facts["gpus"][0]["driver"] == "580.159.04" and facts.get("driver_cuda_version") == "13.0",
      f"facts: GPU, driver, CUDA ({facts.get('gpus')}, {facts.get('driver_cuda_version')})")
check(facts.get("pytorch", {}).get("torch") == "2.11.0+cu130", f"facts: PyTorch {facts.get('pytorch')}")
fig = r["figures"]
gt = fig.get("gpu_test", {})
check(gt.get("vmm_granularity") == 2097152 and gt.get("tests", {}).get(
      "Gpu.VmmDeviceMapsAndUnmapsRealMemory") == {"passed": True, "seconds": 0.5},
      f"gpu_test figures: {gt}")
check(fig.get("torch_training", {}).get("reservoir", {}).get("steps_per_second") == 10.5,
      "torch_training figures")
check(steps["torch_training"]["note"] == "identical losses; steps/s native 10.00, reservoir 10.50",
      f"torch_training note: {steps['torch_training']['note']}")
check(len(fig.get("torch_pause", [])) == 3 and fig["torch_pause"][0]["pause_gib_s"] == 20.0 and
      fig["torch_pause"][2]["config"] == "policy:paging", f"torch_pause rows: {fig.get('torch_pause')}")
pc = fig.get("preload_cuda_program", {})
check(pc.get("program_allocations") == 31 and pc.get("reservoir_allocations") == 31 and
      pc.get("reservoir_segments") == 9, f"preload_cuda_program figures: {pc}")
gb = fig.get("gpu_bench", {})
check(gb.get("BM_Reservoir_CacheHit/4096/real_time", {}).get("real_time") == 40.0,
      "gpu_bench: the median of the repetitions, not the mean")
check(gb.get("BM_Vmm_CreateMapUnmapRelease/2097152/real_time", {}).get("per_2MiB_page_ns") == 30000.0,
      "gpu_bench: VMM cost per 2 MiB page")
check(fig.get("pause_resume_bench", {}).get("Pause_Backup/16384/0/iterations:5/manual_time", {})
      .get("median_GiB_per_s") == 45.0, "pause_resume_bench: medians of the cycles")
check(steps["pause_resume_bench"]["note"] == "pause/resume over pinned copy: 1 GiB 0.90/0.90, "
      "4 GiB 0.90/0.90, 16 GiB 0.90/0.90", f"pause_resume_bench note: {steps['pause_resume_bench']['note']}")
vs = fig.get("pause_resume_vs_pinned_copy", {})
check(sorted(vs) == ["1024 MiB", "16384 MiB", "4096 MiB"] and abs(vs["1024 MiB"]["pause_over_copy"] - 0.9) < 1e-9
      and abs(vs["16384 MiB"]["resume_over_copy"] - 47.0 / 52.0) < 1e-9, f"pause/resume vs pinned copy: {vs}")
check(fig.get("torch_native_bench", {}).get("ratio_reservoir_over_torch", {}).get("4096") == 0.6,
      "torch_native_bench figures")
check("4 KiB 0.60x, 1 MiB 0.62x" in steps["torch_native_bench"]["note"], f"native note: {steps['torch_native_bench']['note']}")
tms = fig.get("tms_beside_reservoir", {})
check(sorted(tms) == ["reservoir", "torch_memory_saver"] and tms["reservoir"]["pause_GiB_per_s"] == 22.0,
      f"tms_beside_reservoir figures: {tms}")
check(steps["tms_beside_reservoir"]["note"] == "1 GiB backed up: pause GiB/s tms 20.0, reservoir 22.0; "
      "resume tms 21.0, reservoir 23.0", f"tms note: {steps['tms_beside_reservoir']['note']}")
rmm = fig.get("rmm_beside_reservoir", {})
check(len(rmm) == 7 and rmm["rmm_pool"]["hit_pair_ns"]["1048576"] == 1500.0, f"rmm figures: {sorted(rmm)}")
check(steps["rmm_beside_reservoir"]["note"].startswith("1 MiB hit pair, ns: torch_native 900, reservoir 700"),
      f"rmm note: {steps['rmm_beside_reservoir']['note']}")
own = fig.get("own_allocator", [])
check(len(own) == 4 and own[1]["graph_same_as_eager"], f"own_allocator figures: {own}")
check(steps["own_allocator"]["note"] == "identical losses; seconds per 10 steps: native 2.00, "
      "reservoir native 1.90, expandable_segments:True 2.10, policy:paging 2.00",
      f"own_allocator note: {steps['own_allocator']['note']}")
graphs = fig.get("graphs", [])
check([c["check"] for c in graphs] == ["stream_capture", "pools", "eager_vs_graph", "rl_loop"],
      f"graphs figures: {graphs}")
check(steps["graphs"]["note"] == "pools as PyTorch's; replays equal eager after pause under 4 policies; "
      "1 stream-capture answers differ from the simulated device's", f"graphs note: {steps['graphs']['note']}")
explain = fig.get("explain_oom", [])
check([c["check"] for c in explain] == ["answer", "batch_finder", "recording_cost"], f"explain_oom figures: {explain}")
check(steps["explain_oom"]["note"] == "answered in 0.40 s; batch finder: batch 14000 after 11 errors, each "
      "answered, pytorch 300 ms, own 100 ms per error; recording: pair 1.20x, step 1.05x of none",
      f"explain_oom note: {steps['explain_oom']['note']}")
sv = fig.get("service", {})
check(sorted(sv.get("service", {})) == ["default", "expandable", "native", "native_paged"] and
      sv["explained"]["native"]["ms_per_failed"] == 55.0, f"service figures: {sv}")
check(steps["service"]["note"] == "served/failed/fragmentation: default 1640/360/21, expandable 1655/345/0, "
      "native 1640/360/21, native_paged 1655/345/0; the answer per error: default 310 ms, expandable 320 ms, "
      "native 55 ms, native_paged 60 ms", f"service note: {steps['service']['note']}")
np_fig = fig.get("native_paged", [])
check(len(np_fig) == 1 and sorted(np_fig[0]["pairs"]) == ["2.11 (running)", "pytorch_version:2.15"],
      f"native_paged figures: {np_fig}")
check(steps["native_paged"]["note"].startswith("2.11 (running): 0 of 4000 calls above native (most 0 MiB), "
                                               "peak 580 vs 600 MiB, steps/s 19.5 vs 20.0; pytorch_version:2.15:"),
      f"native_paged note: {steps['native_paged']['note']}")
pt = fig.get("pytorch_tests", {})
check(pt.get("counts", {}).get("reservoir") == {"pass": 2, "fail": 1, "skip": 1, "timeout": 0},
      f"pytorch_tests figures: {pt}")
check(steps["pytorch_tests"]["note"] == "PyTorch 2.11.0's test_cuda.py, 4 tests: PyTorch's allocator passes 2 "
      "(skips 1), reservoir's 2 (skips 1); none passes only under PyTorch's",
      f"pytorch_tests note: {steps['pytorch_tests']['note']}")
check(steps["cudnn"]["note"] == "cuDNN 92600: 2 programs' requests recorded (3 allocations)",
      f"cudnn note: {steps['cudnn']['note']}")
check(fig.get("cudnn", {}).get("requests", {}).get("lstm") == [233472], f"cudnn figures: {fig.get('cudnn')}")
check(list(steps) == ["bundle", "pytorch_tests", "own_allocator", "native_paged", "graphs", "cudnn", "explain_oom",
                      "service", "tms_beside_reservoir", "torch_training", "gpu_test", "torch_pause",
                      "preload_cuda_program", "preload_torch", "gpu_bench", "torch_native_bench",
                      "pause_resume_bench", "rmm_beside_reservoir"],
      f"the steps in their order, most needed first: {list(steps)}")
check(r.get("exit_status") == 0 and "PASSED: every step (18)" in summary, "verdict and summary")
check(summary.splitlines()[0].startswith("reservoir GPU bundle") and "NVIDIA H100 80GB HBM3" in summary,
      "summary names the GPU")

# gpu_test fails: its first error is reported, every other step still runs.
rc, text, r, summary = run(True)
print(summary)
steps = r["steps"]
check(rc == 1, f"a failing step: exit {rc}")
check(len(steps) == 18, "every step reported")
check(steps["gpu_test"]["status"] == "failed" and "gpu_test.cpp:70: Failure" in steps["gpu_test"]["note"]
      and "Expected equality" in steps["gpu_test"]["note"], f"first error: {steps['gpu_test']['note']}")
check(all(s["status"] == "passed" for k, s in steps.items() if k != "gpu_test"),
      "the other steps still ran and passed")
check("FAILED: 1 of 18 steps failed" in summary and "FAILED   gpu_test" in summary, "summary says which")

# PyTorch's tests alone (--only): the step installs the wheel itself; without
# --test-cuda it says what it needs.
rc, text, r, summary = run(False, "--only", "pytorch_tests", "--test-cuda", "peers/test_cuda.py")
check(rc == 0 and r["steps"]["pytorch_tests"]["status"] == "passed", f"pytorch_tests alone: {summary}")
rc, text, r, summary = run(False, "--only", "pytorch_tests")
check(r["steps"]["pytorch_tests"] == {"status": "skipped", "seconds": r["steps"]["pytorch_tests"]["seconds"],
      "note": "no copy of PyTorch's test/test_cuda.py given (run.sh OUT --test-cuda FILE; the file of the "
              "release this machine runs, 2.11.0+cu130)"}, f"without the file: {r['steps']['pytorch_tests']}")

# A step that outlives its limit is stopped there and says so; the next one
# still runs. A limit of no step, or not a number, is refused.
start = __import__("time").monotonic()
rc, text, r, summary = run(False, "--only", "graphs,explain_oom", "--limit", "graphs=3", env={"STANDIN_SLEEP": "30"})
took = __import__("time").monotonic() - start
check(rc == 1 and r["steps"]["graphs"]["status"] == "failed" and
      r["steps"]["graphs"]["note"].startswith("stopped at its 3 s limit: ") and r["steps"]["graphs"]["seconds"] < 10,
      f"a step stopped at its limit: {r['steps']['graphs']}")
check(r["steps"]["explain_oom"]["status"] == "passed" and took < 25, f"the next step ran: {summary} ({took:.0f} s)")
for bad in ("graphs", "graph=10", "graphs=x", "graphs=0"):
    rc, text, r, summary = run(False, "--only", "graphs", "--limit", bad, results=False)
    check(rc == 2 and f"--limit {bad}: expected STEP=SECONDS" in text, f"--limit {bad}: exit {rc}, {text[-300:]}")

finish("driver checks")

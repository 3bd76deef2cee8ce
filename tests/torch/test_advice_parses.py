"""Every setting `reservoir advise` sweeps, and the line it recommends, is
accepted by the installed PyTorch's own parser: the settings written for
this release (--torch-version), and those for a recording that shows no
release (written for the oldest 2.x that reads them).

Environment (ctest): PyTorch on PYTHONPATH, LD_PRELOAD the simulated
runtime, RESERVOIR the command-line tool.
"""
import json
import os
import subprocess
import sys

import pytest

RESERVOIR = os.environ["RESERVOIR"]
HERE = os.path.dirname(os.path.abspath(__file__))
TRACE = os.path.join(HERE, "..", "..", "examples", "traces", "gpt_training.pickle")

PARSE = """
import json, sys, torch
failures = {}
for config in json.loads(sys.argv[1]):
    try:
        torch.cuda.memory._set_allocator_settings(config)
    except RuntimeError as e:
        failures[config] = str(e).splitlines()[0]
print(json.dumps(failures))
"""


def torch_release():
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return out.split("+")[0]


def advise(*extra):
    r = subprocess.run([RESERVOIR, "advise", TRACE, "--json", *extra], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("for_this_release", [True, False], ids=["torch_version", "recording"])
def test_every_swept_setting_parses(for_this_release):
    release = torch_release()
    a = advise("--torch-version", release) if for_this_release else advise()
    if for_this_release:
        assert a["pytorch_since"] == release and a["torch_version_given"]
    configs = [c["config"] for c in a["candidates"] if c["config"] and not c["reservoir_only"]]
    assert len(configs) >= 15, configs
    r = subprocess.run([sys.executable, "-c", PARSE, json.dumps(configs)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {}


def test_the_recommended_line_works_at_start_up():
    a = advise("--torch-version", torch_release())
    line = a["recommendation"]["pytorch"]["env"]
    name, _, value = line.partition("=")
    assert name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"), line
    env = dict(os.environ)
    env[name] = value
    r = subprocess.run([sys.executable, "-c", "import torch; x = torch.empty(1 << 20, device='cuda'); "
                        "print('ok')"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], (line, r.stderr[-500:])


def test_a_version_that_is_no_release_is_refused():
    r = subprocess.run([RESERVOIR, "advise", TRACE, "--torch-version", "banana"], capture_output=True,
                       text=True)
    assert r.returncode == 2
    assert "--torch-version 'banana': expected a release such as 2.5 or 2.11.0" in r.stderr

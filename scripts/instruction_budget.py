#!/usr/bin/env python3
"""The hot paths' instruction budgets: runs each case of pair_instructions
under callgrind, divides the instructions collected by the units it did
(allocate+free pairs, or replayed events), and compares each with its budget
in bench/instruction_budgets.json. Fails when a case exceeds its budget by
more than 2%, or when a case has no budget (or a budget no case).

usage: instruction_budget.py PAIR_INSTRUCTIONS BUDGETS.json [--jobs N] [--write]

--write puts the measured figures into BUDGETS.json (rounded up to the next
instruction): raising a budget is a deliberate commit that says why.
Instructions are exact for a given binary: the budgets hold for the build
they were measured on (make test's RelWithDebInfo build with Debian's g++).
"""
import argparse
import concurrent.futures
import json
import math
import os
import re
import subprocess
import sys
import tempfile

TOLERANCE = 0.02

# Targets the budgets must stay within, whatever they are raised to: the
# cache-hit pair under every policy, and what a saver's tags add to its pair.
# 605 since PyTorch 2.12's tie rule (a block's own age: two predictable
# branches per pair, paging/two_streams 598.5 -> 604.5); back to 600 is open.
PAIR_LIMIT = 605
TAG_EXISTS_LIMIT = 1.05  # times the saver's pair with no tag
INSIDE_TAG_LIMIT = 1.15
POLICIES = ("native", "expandable", "paging", "native_paged")


def target_failures(measured):
    failures = []
    for policy in POLICIES:
        for shape in ("one_size", "mixed_sizes", "two_streams"):
            case = f"{policy}/{shape}"
            if case in measured and measured[case] > PAIR_LIMIT:
                failures.append(f"{case}: {measured[case]:.1f} instructions, over the pair's "
                                f"target of {PAIR_LIMIT}")
        base = measured.get(f"{policy}/saver_no_tag")
        for name, limit in (("saver_tag_exists", TAG_EXISTS_LIMIT),
                            ("saver_inside_tag", INSIDE_TAG_LIMIT)):
            got = measured.get(f"{policy}/{name}")
            if base and got:
                print(f"{policy}/{name} is {got / base:.3f}x the pair with no tag "
                      f"(target {limit:.2f}x)")
                if got > base * limit:
                    failures.append(f"{policy}/{name}: {got / base:.3f}x the saver's pair with no "
                                    f"tag ({base:.1f}), over the target of {limit:.2f}x")
    return failures


def measure(binary, case):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        r = subprocess.run(["valgrind", "--tool=callgrind", "--collect-atstart=no",
                            f"--callgrind-out-file={out}", binary, case],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"{case}: pair_instructions failed ({r.returncode}): {r.stderr[-2000:]}")
        name, units = r.stdout.split()
        assert name == case, (name, case)
        with open(out) as f:
            text = f.read()
        m = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
        if m is None:
            raise RuntimeError(f"{case}: no instruction total in callgrind's output")
        return int(m.group(1)) / int(units)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("binary")
    p.add_argument("budgets")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--write", action="store_true")
    args = p.parse_args()
    cases = subprocess.run([args.binary, "--list"], capture_output=True, text=True,
                           check=True).stdout.split()
    with open(args.budgets) as f:
        budgets = json.load(f)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        measured = dict(zip(cases, pool.map(lambda c: measure(args.binary, c), cases)))
    if args.write:
        budgets = {c: math.ceil(v) for c, v in sorted(measured.items())}
        with open(args.budgets, "w") as f:
            json.dump(budgets, f, indent=2)
            f.write("\n")
        print(f"wrote {len(budgets)} budgets to {args.budgets}")
    failures = []
    print(f"{'case':<28} {'instructions':>12} {'budget':>8} {'use':>7}")
    for case in cases:
        got = measured[case]
        budget = budgets.get(case)
        if budget is None:
            failures.append(f"{case}: no budget in {args.budgets} (measured {got:.1f})")
            print(f"{case:<28} {got:>12.1f} {'-':>8}")
            continue
        use = got / budget
        mark = "" if use <= 1 + TOLERANCE else "  OVER BUDGET"
        print(f"{case:<28} {got:>12.1f} {budget:>8} {use:>6.1%}{mark}")
        if mark:
            failures.append(f"{case}: {got:.1f} instructions, {use - 1:.1%} over its budget of {budget}")
    for case in sorted(set(budgets) - set(cases)):
        failures.append(f"{case}: a budget for a case pair_instructions does not have")
    failures += target_failures(measured)
    for f in failures:
        print("FAIL " + f)
    glibc = {k.split("/")[1]: v for k, v in measured.items() if k.startswith("glibc/")}
    for size, v in sorted(glibc.items()):
        native = measured.get(f"native/{size}")
        if native:
            print(f"native/{size} is {native / v:.2f}x glibc's {v:.1f}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

"""What the bundle's checks share: each check prints ok or FAIL with what it
looked at, and the program's exit status says whether any failed."""
import sys

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def finish(name):
    print(f"\n{len(failures)} failed" if failures else f"\n{name}: all passed")
    sys.exit(1 if failures else 0)

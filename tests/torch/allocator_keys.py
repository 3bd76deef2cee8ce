"""The allocator settings keys the running PyTorch accepts, read from its
own libraries: every lowercase identifier with an underscore that
libc10.so and libc10_cuda.so hold as a string, and the keys given on the
command line, each put to the release's own parser
(torch.cuda.memory._set_allocator_settings("KEY:1")); a key is accepted
unless the parser answers that it does not recognize it (a value it
refuses is still an accepted key). Prints "RESULT <json list>".

usage: allocator_keys.py [KEY ...]
"""
import glob
import json
import os
import re
import sys

import torch

# A string of the library: NUL before and after (.rodata's literals).
IDENTIFIER = re.compile(rb"(?<=\x00)([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?=\x00)")


def library_strings():
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    found = set()
    for name in ("libc10.so", "libc10_cuda.so"):
        for path in glob.glob(os.path.join(lib, name)):
            with open(path, "rb") as f:
                data = f.read()
            found.update(m.decode() for m in IDENTIFIER.findall(data) if 6 <= len(m) <= 48)
    return found


def accepted(key):
    try:
        torch.cuda.memory._set_allocator_settings(f"{key}:1")
    except Exception as e:  # noqa: BLE001 - the release's own words decide
        text = str(e)
        return not ("nrecognized" in text and key in text)
    return True


def main():
    candidates = sorted(library_strings() | set(sys.argv[1:]))
    keys = [k for k in candidates if accepted(k)]
    print("RESULT " + json.dumps({"candidates": len(candidates), "keys": keys}), flush=True)


if __name__ == "__main__":
    main()

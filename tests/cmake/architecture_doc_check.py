"""docs/architecture.md describes the house as it is: every file it names
exists. A name (outside code blocks, which show what a change would write) is a backticked word or a word of the text that ends as a
source, script or document does (.cpp, .hpp, .h, .c, .py, .md, .txt, .cmake,
.json, .sh, .map) or is a folder path of the tree (src/..., tools/...); it
names a tracked file (or folder) when it is one's path, or the end of one's
path (`allocator_impl.hpp`, `include/reservoir/config.hpp`); `*` and a
placeholder such as `<layer>` or X.Y.Z match any part of a name
(`tools/cmd_*.cpp`). PyTorch's files (c10/..., torch/..., aten/...) are
another project's.

Usage: architecture_doc_check.py SOURCE_DIR
"""
import fnmatch
import os
import re
import subprocess
import sys

FILE = re.compile(r"^[\w./-]*\w\.(cpp|hpp|h|c|py|md|txt|cmake|json|sh|map|in)$")
TOP = ("src/", "tools/", "simcuda/", "python/", "tests/", "bench/", "scripts/", "docs/", "cmake/", "examples/")


def main():
    source = sys.argv[1]
    tracked = subprocess.run(["git", "ls-files"], cwd=source, capture_output=True, text=True,
                             check=True).stdout.split()
    folders = {os.path.dirname(p) for p in tracked}
    folders |= {f[:i] for f in list(folders) for i in range(len(f)) if f[i] == "/"}
    with open(os.path.join(source, "docs", "architecture.md"), encoding="utf-8") as f:
        # Code blocks show what a change would write (a new policy's file).
        page = re.sub(r"^```.*?^```", "", f.read(), flags=re.M | re.S)
    words = set(re.findall(r"`([^`\n]+)`", page))
    words |= set(re.findall(r"(?<![\w/.-])((?:src|tools|simcuda|python|tests|bench|scripts|cmake)/[\w./*<>-]*[\w*>])",
                            page))
    named, missing = 0, []
    for word in sorted(words):
        word = word.strip().strip('"').removeprefix("#include ").strip('"')
        if word.startswith(("..", "<", "c10/", "torch/", "aten/")):
            continue
        word = re.sub(r"<[\w-]+>", "*", word).replace("X.Y.Z", "*")
        if word.endswith("/"):
            word = word.rstrip("/")
            if not word.startswith(TOP):
                # A folder named by its own name: any folder ending so.
                if not any(f == word or f.endswith("/" + word) for f in folders):
                    missing.append(word + "/")
                named += 1
                continue
        if FILE.match(word) or word.startswith(TOP):
            named += 1
            exists = any(fnmatch.fnmatchcase(p, word) or fnmatch.fnmatchcase(p, "*/" + word)
                         for p in list(tracked) + sorted(folders))
            if not exists:
                missing.append(word)
    for word in missing:
        print(f"docs/architecture.md names {word}, which is not in the tree")
    print(f"{named - len(missing)} of the {named} files and folders docs/architecture.md names exist")
    return 1 if missing or not named else 0


if __name__ == "__main__":
    sys.exit(main())

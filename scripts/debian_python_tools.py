"""Makes Debian's pure-Python distributions (setuptools, wheel, pytest and
its dependencies) importable by a Python that lacks them and cannot fetch
them (no package index here): a CPython 3.12 from pyenv, say. The folder it
fills goes on PYTHONPATH; nothing is installed into any environment.

Debian's own wheel for virtual environments is unpacked where there is one
(/usr/share/python-wheels); otherwise the installed package and its metadata
are linked from /usr/lib/python3/dist-packages.

    debian_python_tools.py FOLDER DISTRIBUTION...     (or import and call fill())
"""
import glob
import os
import re
import sys
import zipfile

DEBIAN_SITE = "/usr/lib/python3/dist-packages"
DEBIAN_WHEELS = "/usr/share/python-wheels"
BUILD_TOOLS = ["setuptools", "wheel"]
TEST_TOOLS = ["pytest", "pluggy", "iniconfig", "packaging", "attrs"]


class Missing(Exception):
    pass


def fill(folder, distributions):
    os.makedirs(folder, exist_ok=True)
    for name in distributions:
        shipped = sorted(glob.glob(os.path.join(DEBIAN_WHEELS, f"{name}-*.whl")))
        if shipped:
            with zipfile.ZipFile(shipped[-1]) as z:
                z.extractall(folder)
            continue
        metas = [m for m in glob.glob(os.path.join(DEBIAN_SITE, "*-info"))
                 if re.match(re.escape(name) + r"-[0-9]", os.path.basename(m), re.I)]
        if len(metas) != 1:
            raise Missing(f"Debian's {name} is not installed in {DEBIAN_SITE} (found {metas or 'none'})")
        top = os.path.join(metas[0], "top_level.txt")
        names = [name]
        if os.path.exists(top):
            with open(top) as f:
                names = f.read().split() or names
        for entry in [os.path.basename(metas[0])] + names:
            for path in (os.path.join(DEBIAN_SITE, entry), os.path.join(DEBIAN_SITE, entry + ".py")):
                link = os.path.join(folder, os.path.basename(path))
                if os.path.exists(path) and not os.path.lexists(link):
                    os.symlink(path, link)
    return folder


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    try:
        print(fill(sys.argv[1], sys.argv[2:]))
    except Missing as e:
        sys.exit(f"debian_python_tools: {e}")

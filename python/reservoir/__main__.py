"""`python -m reservoir ...` and the `reservoir` command: the command-line tool
the package holds (reservoir.cli_path()), with the same arguments."""
import os
import sys


def main():
    from reservoir import cli_path

    tool = cli_path()
    os.execv(tool, [tool] + sys.argv[1:])


if __name__ == "__main__":
    main()

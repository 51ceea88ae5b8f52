"""``python -m benchmarks.engine``: see :mod:`benchmarks.engine`."""

import sys

from benchmarks.engine.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])

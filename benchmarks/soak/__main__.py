"""``python -m benchmarks.soak``: see :mod:`benchmarks.soak`."""

import os
import sys

from benchmarks.soak.cli import main

if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

"""`jaxseek bench engine`: the benchmark lives in `benchmarks/engine.py` (installed with the package)."""

import sys

from benchmarks.engine import main

if __name__ == "__main__":
    status = main()
    sys.exit(status if isinstance(status, int) else 0)

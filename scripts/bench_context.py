"""`jaxseek bench context`: the benchmark lives in `benchmarks/context.py` (installed with the package)."""

import sys

from benchmarks.context import main

if __name__ == "__main__":
    status = main()
    sys.exit(status if isinstance(status, int) else 0)

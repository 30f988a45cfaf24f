"""`jaxseek bench startup`: the benchmark lives in `benchmarks/startup.py` (installed with the package)."""

import sys

from benchmarks.startup import main

if __name__ == "__main__":
    status = main()
    sys.exit(status if isinstance(status, int) else 0)

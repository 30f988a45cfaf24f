"""`jaxseek bench multiprocess`: the benchmark lives in `benchmarks/multiprocess.py` (installed with the package)."""

import sys

from benchmarks.multiprocess import main

if __name__ == "__main__":
    status = main()
    sys.exit(status if isinstance(status, int) else 0)

"""`jaxseek bench kernels`: the benchmark lives in `benchmarks/kernels.py` (installed with the package)."""

import sys

from benchmarks.kernels import main

if __name__ == "__main__":
    status = main()
    sys.exit(status if isinstance(status, int) else 0)

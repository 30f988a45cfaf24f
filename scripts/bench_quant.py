"""`jaxseek bench quant`: the benchmark lives in `benchmarks/quant.py` (installed with the package)."""

import sys

from benchmarks.quant import main

if __name__ == "__main__":
    status = main()
    sys.exit(status if isinstance(status, int) else 0)

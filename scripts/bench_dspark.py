"""`jaxseek bench dspark`: the benchmark lives in `benchmarks/dspark.py` (installed with the package)."""

import sys

from benchmarks.dspark import main

if __name__ == "__main__":
    status = main()
    sys.exit(status if isinstance(status, int) else 0)

"""`jaxseek bench serving`: the benchmark lives in `benchmarks/serving.py` (installed with the package)."""

import sys

from benchmarks.serving import main

if __name__ == "__main__":
    status = main()
    sys.exit(status if isinstance(status, int) else 0)

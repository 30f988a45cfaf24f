"""`jaxseek bench prefill`: the benchmark lives in `benchmarks/prefill.py` (installed with the package)."""

import sys

from benchmarks.prefill import main

if __name__ == "__main__":
    status = main()
    sys.exit(status if isinstance(status, int) else 0)

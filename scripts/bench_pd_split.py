"""`jaxseek bench pd-split`: the benchmark lives in `benchmarks/pd_split.py` (installed with the package)."""

import sys

from benchmarks.pd_split import main

if __name__ == "__main__":
    status = main()
    sys.exit(status if isinstance(status, int) else 0)

"""`jaxseek bench layer-scan`: the benchmark lives in `benchmarks/layer_scan.py` (installed with the package)."""

import sys

from benchmarks.layer_scan import main

if __name__ == "__main__":
    status = main()
    sys.exit(status if isinstance(status, int) else 0)

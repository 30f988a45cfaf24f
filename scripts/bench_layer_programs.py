"""`jaxseek bench layer-programs`: the benchmark lives in `benchmarks/layer_forms.py` (installed with the package)."""

import sys

from benchmarks.layer_forms import main

if __name__ == "__main__":
    status = main()
    sys.exit(status if isinstance(status, int) else 0)

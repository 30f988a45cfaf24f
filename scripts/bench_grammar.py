"""`jaxseek bench grammar`: the benchmark lives in `benchmarks/grammar.py` (installed with the package)."""

import sys

from benchmarks.grammar import main

if __name__ == "__main__":
    status = main()
    sys.exit(status if isinstance(status, int) else 0)

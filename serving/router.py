"""`python -m serving.router`: the replica router (`serving.api.router`)."""
from serving.api.router import main

if __name__ == "__main__":
    raise SystemExit(main())

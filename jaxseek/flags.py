"""Flags `generate` and `serve` share under vLLM's names (`--max-model-len`, `--max-num-seqs`,
`--enable-prefix-caching`, `--chat-template`, `--dtype auto`, `--kv-cache-memory`, `--max-num-batched-tokens`,
`--log-level`, `--version`): their value types, and the settings they turn into."""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

from serving.openai_api import package_version

CHAT_FORMAT_NAMES = ("auto", "deepseek-v4", "jinja", "plain")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
PROJECT_LOGGERS = ("pallas_kernels", "model", "sharding", "serving", "training", "jaxseek", "uvicorn")
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?", re.IGNORECASE)


def int_at_least(low: int):
    """An argparse type: an integer no smaller than `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def byte_size(text: str) -> int:
    """A memory size: bytes, or a number with a unit (`512M`, `1.5GiB`, `8G`; k/M/G/T are powers of 1024,
    as vLLM's `--kv-cache-memory` reads them)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 2147483648, 512M or 8GiB, got {text!r}")
    number, unit = float(match[1]), match[2].lower()
    size = int(number * 1024 ** " kmgt".index(unit or " "))
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return size


def chat_template(text: str) -> str:
    """A chat format's name, or the path of a Jinja chat-template file (returned resolved)."""
    if text in CHAT_FORMAT_NAMES:
        return text
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is neither a chat format ({', '.join(CHAT_FORMAT_NAMES)}) nor "
                                         "a Jinja template file")
    return str(path.resolve())


def add_chat_template_arg(p: argparse.ArgumentParser) -> None:
    """`--chat-template FILE_OR_NAME` (today's `--chat-format NAME` is its alias)."""
    p.add_argument("--chat-template", "--chat-format", dest="chat_format", default="auto", type=chat_template,
                   metavar="FILE_OR_NAME",
                   help="how chat messages become a prompt: a Jinja template file, or by name DeepSeek-V4's format, "
                        "the checkpoint's Jinja template, or the bundled model's plain one (auto: DeepSeek-V4 when "
                        "the tokenizer has its DSML token, else the checkpoint's template if it ships one, else "
                        f"plain); names: {', '.join(CHAT_FORMAT_NAMES)}")


def add_common_args(p: argparse.ArgumentParser) -> None:
    """`--log-level` and `--version`, on every job that runs the engine."""
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, type=str.lower,
                   help="the jaxseek / uvicorn loggers' level (default info)")
    p.add_argument("--version", action="version", version=f"jaxseek {package_version()}")


def add_engine_limit_args(e) -> None:
    """The engine's token budget and KV pool: by page count or by memory."""
    e.add_argument("--max-num-batched-tokens", "--token-budget", dest="token_budget", type=int_at_least(1), metavar="N",
                   help="tokens one engine step processes at most, decode rows and prefill chunks together "
                        "(default: max-num-seqs + 2 x prefill-chunk)")
    e.add_argument("--num-kv-pages", "--num-pages", "--num-gpu-blocks-override", dest="num_pages", type=int_at_least(1), metavar="N",
                   help="KV-cache pages in the pool (default: enough for every slot at max-model-len)")
    e.add_argument("--kv-cache-memory", type=byte_size, metavar="BYTES",
                   help="size the KV pool by memory instead (bytes, or e.g. 512M, 8GiB)")


def setup_logging(level: str) -> None:
    """Log records of `level` and above from the project's packages (and uvicorn's) to stderr."""
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    for name in PROJECT_LOGGERS:
        logging.getLogger(name).setLevel(level.upper())

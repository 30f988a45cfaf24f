"""Flags `generate` and `serve` share under vLLM's names (`--max-model-len`, `--max-num-seqs`,
`--enable-prefix-caching`, `--chat-template`, `--dtype auto`, `--kv-cache-memory`, `--max-num-batched-tokens`,
`--log-level`, `--version`): their value types, and the settings they turn into. The engine's flags are built
from `serving.base.engine_config.EngineConfig`, where each is declared with its setting."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
from pathlib import Path

from serving.base.engine_config import EngineConfig, Flag
from serving.api.openai_api import package_version

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


def _declared() -> list[tuple[dataclasses.Field, tuple[Flag, ...]]]:
    """Each `EngineConfig` field that declares flags, with them."""
    return [(f, f.metadata["flags"]) for f in dataclasses.fields(EngineConfig) if "flags" in f.metadata]


def _dest(field: dataclasses.Field, flags: tuple[Flag, ...], flag: Flag) -> str:
    """Where argparse keeps a flag's value: its field's name, or (a field of several flags) the flag's own."""
    return field.name if len(flags) == 1 else flag.names[0].removeprefix("--").replace("-", "_")


def add_engine_flags(group) -> None:
    """The engine flags `generate` and `serve` share: one per `EngineConfig` field that declares one
    (`serving.base.engine_config.Flag`), its default the field's (a field of several flags: unset, None)."""
    for field, flags in _declared():
        default = field.default if len(flags) == 1 else None
        for flag in flags:
            how = {"metavar": flag.metavar or ("N" if flag.kind == "int" else None)}
            if flag.kind == "int":
                how["type"] = int_at_least(flag.minimum)
            elif flag.kind == "size":
                how["type"] = byte_size
            elif flag.kind == "choice":
                how["choices"] = flag.choices
            elif flag.kind in ("switch", "negated"):
                how = {"action": "store_true" if flag.kind == "switch" else "store_false"}  # no metavar
            elif flag.kind == "toggle":
                how = {"action": argparse.BooleanOptionalAction}
            elif flag.kind != "text":
                raise ValueError(f"{flag.names[0]}: unknown flag kind {flag.kind!r}")
            group.add_argument(*flag.names, dest=_dest(field, flags, flag), default=default, help=flag.help, **how)


def engine_config(args: argparse.Namespace, **settings) -> EngineConfig:
    """The `EngineConfig` of the engine flags (`add_engine_flags`) and `--seed` (which seeds requests that give
    none), with `settings` (what the command decides itself) over them. Raises ValueError for settings that do
    not go together."""
    values = {"seed": args.seed}
    for field, flags in _declared():
        if len(flags) == 1:
            values[field.name] = getattr(args, field.name)
        elif (value := field.metadata["combine"](*(getattr(args, _dest(field, flags, f)) for f in flags))) is not None:
            values[field.name] = value
    return EngineConfig(**(values | settings))


def setup_logging(level: str) -> None:
    """Log records of `level` and above from the project's packages (and uvicorn's) to stderr."""
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    for name in PROJECT_LOGGERS:
        logging.getLogger(name).setLevel(level.upper())


@dataclasses.dataclass(frozen=True)
class ProcessJob:
    """This process's place in a multi-process job (`jax.distributed`): the coordinator's HOST:PORT, how many
    processes, which one this is (0 leads)."""

    coordinator: str
    num_processes: int
    process_id: int


def add_process_args(p: argparse.ArgumentParser) -> None:
    """The multi-process flags, with vLLM's multi-node names as aliases (`--nnodes`, `--node-rank`,
    `--master-addr` + `--master-port`)."""
    g = p.add_argument_group("multi-process (one process per host, one global --mesh over all their devices)")
    g.add_argument("--num-processes", "--nnodes", dest="num_processes", type=int_at_least(1), default=1,
                   help="processes in the job (default 1: this one alone)")
    g.add_argument("--process-id", "--node-rank", dest="process_id", type=int_at_least(0), default=0,
                   help="this process's index, 0 to N-1; process 0 leads: it schedules, writes --output and "
                        "answers HTTP, the others run its steps on their devices and exit when it does")
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help="where process 0 runs the job's coordination service (every process gives the same)")
    g.add_argument("--master-addr", metavar="HOST", help="vLLM's name: the coordinator's host (with --master-port)")
    g.add_argument("--master-port", type=int_at_least(1), metavar="PORT",
                   help="vLLM's name: the coordinator's port (default 29501 with --master-addr)")


def process_job(args: argparse.Namespace) -> ProcessJob | None:
    """The job the multi-process flags describe (None: one process outside any job; `--num-processes 1` with a
    coordinator is a job of one, with the job's collectives). Raises ValueError for flags that do not make one."""
    if args.coordinator and (args.master_addr or args.master_port):
        raise ValueError("give the coordinator as --coordinator HOST:PORT or as --master-addr / --master-port, "
                         "not both")
    coordinator = args.coordinator
    if args.master_addr or args.master_port:
        coordinator = f"{args.master_addr or '127.0.0.1'}:{args.master_port or 29501}"
    if args.num_processes == 1 and not coordinator:
        if args.process_id:
            raise ValueError("--process-id names a process of a multi-process job: give --num-processes N and "
                             "--coordinator as well")
        return None
    if not coordinator:
        raise ValueError(f"--num-processes {args.num_processes} needs --coordinator HOST:PORT (process 0's address)")
    if not re.fullmatch(r"\[?[\w.:-]+\]?:\d+", coordinator):
        raise ValueError(f"--coordinator must be HOST:PORT, got {coordinator!r}")
    if args.process_id >= args.num_processes:
        raise ValueError(f"--process-id must be in [0, {args.num_processes}), got {args.process_id}")
    return ProcessJob(coordinator, args.num_processes, args.process_id)

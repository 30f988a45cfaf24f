"""Client for the Hugging Face DeepSeek-V4 oracle (`tests/oracle/hf_oracle.py`).

The oracle needs torch + transformers, which live in a separate Python 3.11
interpreter, so commands are collected in an `OracleBatch` and run together in one
subprocess (torch loads once), exchanging data through files: config.json,
safetensors, and .npy for tokens and logits.

The interpreter comes from `$JAXSEEK_ORACLE_PYTHON`, else `<repo>/.venv-oracle/bin/python`.
Without either, tests using the oracle are skipped locally and fail under CI
(`$CI` set), so a missing oracle can never silently turn parity tests green in CI.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
BATCH_SCRIPT = Path(__file__).resolve().parent / "oracle" / "hf_batch.py"
ORACLE_PYTHON_ENV = "JAXSEEK_ORACLE_PYTHON"
DEFAULT_ORACLE_PYTHON = REPO_ROOT / ".venv-oracle" / "bin" / "python"
DEFAULT_TIMEOUT_S = 300.0  # per command of a batch


class OracleError(RuntimeError):
    """The oracle subprocess failed or timed out; the message carries its stderr."""


def oracle_python() -> str:
    """Path of the Python interpreter that can run the oracle.

    An explicitly set `$JAXSEEK_ORACLE_PYTHON` that does not exist is always an
    error. With no interpreter at all: `OracleError` under CI, `pytest.skip` otherwise.
    """
    configured = os.environ.get(ORACLE_PYTHON_ENV)
    if configured:
        if not Path(configured).exists():
            raise OracleError(f"${ORACLE_PYTHON_ENV}={configured} does not exist")
        return configured
    if DEFAULT_ORACLE_PYTHON.exists():
        return str(DEFAULT_ORACLE_PYTHON)
    message = (
        f"no HF oracle interpreter: set ${ORACLE_PYTHON_ENV} or create {DEFAULT_ORACLE_PYTHON} "
        "(Python 3.11 with the project's `oracle` extra)"
    )
    if os.environ.get("CI"):
        raise OracleError(message)
    pytest.skip(message)


def _oracle_env() -> dict[str, str]:
    """Environment for the subprocess: no leakage of this interpreter's paths, no network."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run_oracle(args: Sequence[str], timeout: float) -> None:
    """Run `hf_batch.py *args`; raise `OracleError` with its stderr if it fails."""
    command = [oracle_python(), str(BATCH_SCRIPT), *args]
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=_oracle_env(), check=False
        )
    except subprocess.TimeoutExpired as err:
        stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else err.stderr
        raise OracleError(f"oracle timed out after {timeout:.0f} s: {' '.join(command)}\n{stderr or ''}") from err
    if result.returncode != 0:
        raise OracleError(
            f"oracle exited with status {result.returncode}: {' '.join(command)}\n{result.stderr}"
        )


class OracleBatch:
    """Oracle commands collected first, then run together in one subprocess (`tests/oracle/hf_batch.py`), so
    torch and transformers load once for all of them. Each method returns the path its result will have after
    `run()`; inputs go to files under `workdir`."""

    def __init__(self, workdir: str | os.PathLike):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.commands: list[list[str]] = []
        self._names = itertools.count()

    def _file(self, suffix: str) -> Path:
        return self.workdir / f"{next(self._names)}{suffix}"

    def init(self, config_dict: dict, out_dir: str | os.PathLike, seed: int) -> Path:
        """A random HF model from an HF-style config dict, saved to `out_dir` (config.json and model.safetensors
        in the names `save_pretrained` writes). Tensors the HF initialiser leaves at 0 or 1 (sinks, position
        biases, mHC base/scale, router bias, norms, hash table) are randomised."""
        config_path = self._file("-config.json")
        config_path.write_text(json.dumps(config_dict))
        self.commands.append(["init", "--config", str(config_path), "--out", str(out_dir), "--seed", str(seed)])
        return Path(out_dir)

    def logits(self, model_dir: str | os.PathLike, tokens: np.ndarray, cached_chunks: Sequence[int] | None = None
               ) -> Path:
        """The .npy file that will hold the fp32 logits [B, S, V] of the HF model in `model_dir` for int `tokens`
        [B, S]. Without `cached_chunks`: one uncached forward. With it: prefill in those chunk sizes through the
        HF cache, then the remaining tokens one at a time."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be an integer array [B, S], got {tokens.dtype} {tokens.shape}")
        tokens_path, logits_path = self._file("-tokens.npy"), self._file("-logits.npy")
        np.save(tokens_path, tokens.astype(np.int64))
        command = ["logits", "--model", str(model_dir), "--tokens", str(tokens_path), "--out", str(logits_path)]
        if cached_chunks is not None:
            command += ["--cached-chunks", ",".join(str(int(c)) for c in cached_chunks)]
        self.commands.append(command)
        return logits_path

    def dump_native(self, model_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
        """The HF-saved model in `model_dir` rewritten with DeepSeek-native tensor names to `out_dir`; the oracle
        checks that HF loads it to bit-identical logits."""
        self.commands.append(["dump-native", "--model", str(model_dir), "--out", str(out_dir)])
        return Path(out_dir)

    def run(self, timeout_per_command: float = DEFAULT_TIMEOUT_S) -> None:
        """Run every collected command in order in one oracle process; `OracleError` if any fails."""
        commands_path = self._file("-commands.json")
        commands_path.write_text(json.dumps(self.commands))
        _run_oracle([str(commands_path)], timeout_per_command * len(self.commands))
        self.commands = []

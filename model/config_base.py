"""What the V4 and V4.1 configs share: the error type, YaRN scaling, RoPE key normalisation, reading config.json."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


class ConfigError(ValueError):
    """A config.json or preset that cannot describe a DeepSeek-V4 model."""


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency interpolation used by the compressed layers (no attention mscale, as in V4)."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def read_rope(d: dict[str, Any]) -> None:
    """Normalise the RoPE / YaRN keys of a config dict in place to our `rope_scaling` and `qk_rope_head_dim`."""
    prf = d.pop("partial_rotary_factor", None)
    if prf is not None:
        rope_dim = int(d["head_dim"] * prf)
        if d.setdefault("qk_rope_head_dim", rope_dim) != rope_dim:
            raise ConfigError(f"partial_rotary_factor={prf} disagrees with qk_rope_head_dim={d['qk_rope_head_dim']}")
    params = d.pop("rope_parameters", None)
    scaling = d.pop("rope_scaling", None)
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        main, compress = params["main"], params["compress"]
        d.setdefault("rope_theta", main.get("rope_theta", 10000.0))
        d.setdefault("compress_rope_theta", compress.get("rope_theta", 160000.0))
        if main.get("rope_type", "default") != "default":
            raise ConfigError("rope_parameters.main must be plain RoPE (sliding layers use no YaRN)")
        scaling = scaling or (compress if compress.get("rope_type", compress.get("type")) == "yarn" else None)
    elif isinstance(params, dict) and scaling is None:
        scaling = params if params.get("rope_type", params.get("type")) == "yarn" else None
    if scaling is None:
        d["rope_scaling"] = None
        return
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "yarn":
        raise ConfigError(f"rope_scaling type {kind!r} is not supported (DeepSeek-V4 uses yarn)")
    attention_factor = scaling.get("attention_factor", 1.0)
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor != 1.0 or (mscale and mscale_all and mscale != mscale_all):
        raise ConfigError("YaRN attention scaling (mscale) is not used by DeepSeek-V4; got "
                          f"attention_factor={attention_factor}, mscale={mscale}, mscale_all_dim={mscale_all}")
    factor = scaling.get("factor")
    if factor is None or not math.isfinite(factor) or factor < 1:
        raise ConfigError(f"rope_scaling.factor must be >= 1, got {factor!r}")
    d["rope_scaling"] = YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 65536)),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
    )


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The dict in `config.json` (a file, or the checkpoint directory holding it), with clear errors."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {file}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from None

"""Model configurations: one frozen dataclass drives every size, read from and written to HF `config.json`.

Field names follow DeepSeek's released `config.json` (e.g. deepseek-ai/DeepSeek-V4-Flash). The `transformers`
spelling (`layer_types`, `compress_rates`, `mlp_layer_types`, `rope_parameters`, `partial_rotary_factor`) is
accepted on read and written alongside, so `DeepseekV4Config` reproduces non-standard test schedules exactly.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, no_type_check

from model.config_base import SCORING_FUNCS, ConfigError, YarnScaling, read_config_json, read_rope
from model.config_v41 import V41Config, tiny_v41, v41_flash

SLIDING, CSA, HCA = "sliding", "csa", "hca"
CSA_RATIO = 4  # the ratio whose layers get overlapping windows and an indexer (DeepSeek-V4 `inference/model.py`)


@no_type_check  # built from config.json's raw values, which `__post_init__` coerces and `validate` checks
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Every hyper-parameter that affects the math of a DeepSeek-V4 (Flash / Pro) model."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    # one entry per main layer then per MTP layer: 0 = sliding only, 4 = CSA, any other ratio = HCA
    compress_ratios: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_hash_layers: int
    routed_scaling_factor: float = 1.5
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = YarnScaling()
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        self.validate()

    # ---- derived facts -------------------------------------------------------------------------------------
    def layer_kind(self, layer: int) -> str:
        """`sliding`, `csa` or `hca` for a main layer (0..L-1) or an MTP layer (L..L+n_mtp-1)."""
        ratio = self.compress_ratios[layer]
        return SLIDING if ratio == 0 else CSA if ratio == CSA_RATIO else HCA

    def is_hash_layer(self, layer: int) -> bool:
        """Whether a main layer routes experts through the fixed `tid2eid` table."""
        return layer < self.num_hash_layers

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def hca_ratios(self) -> tuple[int, ...]:
        return tuple(sorted({r for r in self.compress_ratios if r not in (0, CSA_RATIO)}))

    # ---- validation ----------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ConfigError naming the first inconsistent field."""
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                    "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
                    "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok",
                    "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings")
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        n_all = self.num_hidden_layers + self.num_nextn_predict_layers
        if len(self.compress_ratios) != n_all:
            raise ConfigError(f"compress_ratios has {len(self.compress_ratios)} entries; expected "
                              f"num_hidden_layers + num_nextn_predict_layers = {n_all}")
        if any(r < 0 for r in self.compress_ratios):
            raise ConfigError(f"compress_ratios must be >= 0, got {list(self.compress_ratios)}")
        if not 0 < self.qk_rope_head_dim <= self.head_dim or self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and in (0, head_dim]")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} exceeds index_head_dim="
                              f"{self.index_head_dim} (the indexer ropes its trailing dims too)")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                              f"o_groups={self.o_groups}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts="
                              f"{self.n_routed_experts}")
        if not 0 <= self.num_hash_layers <= self.num_hidden_layers:
            raise ConfigError(f"num_hash_layers={self.num_hash_layers} must be in [0, num_hidden_layers]")
        if self.n_shared_experts not in (0, 1):
            raise ConfigError(f"n_shared_experts={self.n_shared_experts}: DeepSeek-V4 has at most one")
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(f"scoring_func={self.scoring_func!r} is not one of {SCORING_FUNCS}")
        if self.num_nextn_predict_layers < 0:
            raise ConfigError("num_nextn_predict_layers must be >= 0")
        for name in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor"):
            if not float(getattr(self, name)) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")

    # ---- HF config.json ------------------------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` of a DeepSeek-V4 checkpoint, readable by DeepSeek's code and `transformers`."""
        d: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "rope_scaling":
                value = None if value is None else {"type": "yarn", **dataclasses.asdict(value)}
            elif f.name == "compress_ratios":
                value = list(value)
            d[f.name] = value
        d["num_key_value_heads"] = 1
        d["tie_word_embeddings"] = False
        d["hidden_act"] = "silu"
        d["topk_method"] = "noaux_tc"
        n = self.num_hidden_layers
        hf_names = {SLIDING: "sliding_attention", CSA: "compressed_sparse_attention",
                    HCA: "heavily_compressed_attention"}
        d["layer_types"] = [hf_names[self.layer_kind(i)] for i in range(n)]
        d["mlp_layer_types"] = ["hash_moe" if self.is_hash_layer(i) else "moe" for i in range(n)]
        hca = {r for r in self.compress_ratios[:n] if r not in (0, CSA_RATIO)}
        if len(hca) > 1:
            raise ConfigError(f"transformers supports one HCA ratio per model; this config has {sorted(hca)}")
        d["compress_rates"] = {"compressed_sparse_attention": CSA_RATIO,
                               "heavily_compressed_attention": hca.pop() if hca else 128}
        return d

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse a DeepSeek-V4 `config.json` dict; unknown or inconsistent fields raise ConfigError."""
        d = dict(raw)
        if "text_config" in d:
            raise ConfigError("this is a multimodal (V4.1) config; DeepSeek-V4 text configs are flat")
        for key, expected in _FIXED_VALUES.items():
            if key in d and d.pop(key) not in expected:
                raise ConfigError(f"{key}={raw[key]!r} is not supported (expected one of {expected})")
        for key in _IGNORED_KEYS:
            d.pop(key, None)
        n = d.get("num_hidden_layers")
        n_mtp = d.get("num_nextn_predict_layers", 1)
        ratios = d.pop("compress_ratios", None)
        rates = d.pop("compress_rates", None) or {}
        if "compress_rate_csa" in d or "compress_rate_hca" in d:
            rates = {"compressed_sparse_attention": d.pop("compress_rate_csa", CSA_RATIO),
                     "heavily_compressed_attention": d.pop("compress_rate_hca", 128), **rates}
        if rates.get("compressed_sparse_attention", CSA_RATIO) != CSA_RATIO:
            raise ConfigError(f"compress_rates.compressed_sparse_attention must be {CSA_RATIO}, got "
                              f"{rates['compressed_sparse_attention']}")
        layer_types = d.pop("layer_types", None)
        if layer_types is not None:
            to_ratio = {"sliding_attention": 0, "compressed_sparse_attention": CSA_RATIO,
                        "heavily_compressed_attention": rates.get("heavily_compressed_attention", 128)}
            bad = [t for t in layer_types if t not in to_ratio]
            if bad:
                raise ConfigError(f"unknown layer_types entries {bad}")
            from_types = [to_ratio[t] for t in layer_types]
            if ratios is not None and list(ratios[: len(from_types)]) != from_types:
                raise ConfigError(f"layer_types {layer_types} disagree with compress_ratios {ratios}")
            ratios = ratios if ratios is not None else from_types
        if ratios is None:
            raise ConfigError("config has neither compress_ratios nor layer_types; the layer schedule is "
                              "ambiguous (transformers' default matches neither V4-Flash nor V4-Pro)")
        if n is not None and len(ratios) < n + n_mtp:
            ratios = list(ratios) + [0] * (n + n_mtp - len(ratios))  # MTP layers are sliding-only
        if n is not None:
            ratios = list(ratios)[: n + n_mtp]
        d["compress_ratios"] = tuple(ratios)
        mlp_types = d.pop("mlp_layer_types", None)
        if mlp_types is not None:
            n_hash = sum(1 for t in mlp_types if t == "hash_moe")
            if list(mlp_types) != ["hash_moe"] * n_hash + ["moe"] * (len(mlp_types) - n_hash):
                raise ConfigError(f"mlp_layer_types {mlp_types}: hash_moe layers must come first")
            if d.get("num_hash_layers", n_hash) != n_hash:
                raise ConfigError(f"num_hash_layers={d['num_hash_layers']} disagrees with mlp_layer_types")
            d["num_hash_layers"] = n_hash
        d.setdefault("num_hash_layers", 3)
        read_rope(d)
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"unknown config fields {unknown}")
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"incomplete config: {e}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (a file or the checkpoint directory holding it)."""
        return cls.from_hf_dict(read_config_json(path))

    def save_json(self, path: str | Path) -> None:
        """Write `config.json` (into a directory, or to the given file path)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        path.write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")


# Keys of released / transformers configs that do not change the math (or are fixed below).
_IGNORED_KEYS = (
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "initializer_range", "quantization_config", "expert_dtype", "moe_quant_algo", "auto_map",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "attention_dropout", "pad_token_id",
    "generation_config", "qk_nope_head_dim", "kv_lora_rank", "rope_interleave", "ep_size", "aux_loss_alpha",
    "seq_aux", "num_key_value_heads_per_layer", "moe_layer_freq",
    # V4-Flash-0731's DSpark drafter (`mtp.{0,1,2}.*`), read apart by DSparkConfig.from_v4 (model/dspark.py)
    "dspark_block_size", "dspark_markov_rank", "dspark_noise_token_id", "dspark_target_layer_ids",
    "dspark_n_routed_experts", "dspark_num_experts_per_tok", "dspark_window_size",
)
_FIXED_VALUES: dict[str, tuple[Any, ...]] = {
    "num_key_value_heads": (1,),
    "tie_word_embeddings": (False,),
    "hidden_act": ("silu",),
    "topk_method": ("noaux_tc",),
    "first_k_dense_replace": (0,),
    "n_group": (1, None),
    "topk_group": (1, None),
    "attention_bias": (False,),
    "mlp_bias": (False,),
}


def _v4_flash() -> ModelConfig:
    return ModelConfig(
        vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, head_dim=512,
        qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
        compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0), index_n_heads=64, index_head_dim=128, index_topk=512,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=6, moe_intermediate_size=2048,
        num_hash_layers=3, routed_scaling_factor=1.5,
    )


def _v4_pro() -> ModelConfig:
    return dataclasses.replace(
        _v4_flash(), hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
        o_groups=16, compress_ratios=(128, 128) + (4, 128) * 29 + (4, 0), index_topk=1024,
        n_routed_experts=384, moe_intermediate_size=3072, routed_scaling_factor=2.5,
    )


def _tiny() -> ModelConfig:
    """Seconds on CPU: one layer of each kind, short windows, HCA ratio 16 so several entries appear early."""
    return ModelConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
        compress_ratios=(0, 4, 16, 4, 0), index_n_heads=16, index_head_dim=16, index_topk=4,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
        num_hash_layers=1, max_position_embeddings=4096,
        rope_scaling=YarnScaling(factor=16.0, original_max_position_embeddings=256),
    )


def _small() -> ModelConfig:
    """A few tens of millions of parameters for CPU benchmarks, with the V4-Flash layer pattern."""
    return ModelConfig(
        vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, head_dim=128,
        qk_rope_head_dim=32, q_lora_rank=256, o_groups=4, o_lora_rank=256, sliding_window=64,
        compress_ratios=(0, 0, 4, 32, 4, 32, 4, 32, 0), index_n_heads=16, index_head_dim=64, index_topk=64,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=512,
        num_hash_layers=2, max_position_embeddings=65536,
        rope_scaling=YarnScaling(factor=16.0, original_max_position_embeddings=4096),
    )


PRESETS = {"tiny": _tiny, "small": _small, "v4-flash": _v4_flash, "v4-pro": _v4_pro}
V41_PRESETS = ("tiny-v41", "v41-flash")


def preset(name: str):
    """A named configuration: `tiny`, `small`, `v4-flash`, `v4-pro` (ModelConfig) or `tiny-v41`, `v41-flash`."""
    if name in V41_PRESETS:
        return {"tiny-v41": tiny_v41, "v41-flash": v41_flash}[name]()
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS) + list(V41_PRESETS)}") from None


def load_config(path: str | Path):
    """The config of a checkpoint directory (or config.json): ModelConfig for V4, V41Config for V4.1."""
    return config_from_dict(read_config_json(path))


def config_from_dict(raw: dict[str, Any]):
    """ModelConfig (V4) or V41Config (V4.1, composite or text config) from a config.json dict."""
    if raw.get("model_type", "").startswith("deepseek_v41") or "text_config" in raw:
        return V41Config.from_hf_dict(raw)
    return ModelConfig.from_hf_dict(raw)

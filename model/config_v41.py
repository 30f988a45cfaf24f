"""DeepSeek-V4.1 text configuration: causal encoder-decoder (CED) schedule, shared KV sources, two-level
index selection, Engram memory. Field names follow the `text_config` of deepseek-ai/DeepSeek-V4.1-Flash
(and transformers' `DeepseekV41TextConfig`); the composite config.json (text + vision) is read and written.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, no_type_check

from model.config_base import SCORING_FUNCS, ConfigError, YarnScaling, read_config_json, read_rope


@no_type_check  # built from config.json's raw values, which `__post_init__` coerces and `validate` checks
@dataclasses.dataclass(frozen=True)
class V41Config:
    """Every hyper-parameter that affects the math of a DeepSeek-V4.1 text model."""

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
    # per layer (then per DSpark layer, always 0): 0 = sliding only, 1 = per-token shared KV (decoder),
    # r > 1 = r tokens pooled into one shared latent (encoder)
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int  # < 0 disables the two-level selection
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = YarnScaling()
    max_position_embeddings: int = 1048576
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_vocab_size: int = 16000000
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    bos_token_id: int | None = None
    eos_token_id: int = 1
    # Simulate the storage formats the reference trains with (FP8 window KV, FP4 latents and indexer
    # q / k); transformers' V4.1 always applies them. Off in the tiny test preset.
    qat_fake_quant: bool = True

    def __post_init__(self) -> None:
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
                     "engram_num_embeddings", "dspark_target_layer_ids"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        self.validate()

    # ---- derived facts -------------------------------------------------------------------------------------
    def kv_source_of(self, layer: int) -> int | None:
        """The KV-source layer whose shared compressed KV this layer reads (latest source at or below it)."""
        if self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    @property
    def engram_lookups(self) -> int:
        """Engram rows gathered per token and Engram layer: (N - 1) n-gram orders x heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def n_prefill_layer(self) -> int:
        """Layers a prefill must run to produce every shared KV source (through the decoder's source)."""
        return max(self.kv_source_layer_ids) + 1 if self.kv_source_layer_ids else self.num_hidden_layers

    @property
    def decoder_start(self) -> int:
        """First decoder layer (ratio 1): the encoder / decoder boundary of the CED split."""
        ones = [i for i in range(self.num_hidden_layers) if self.compress_ratios[i] == 1]
        return ones[0] if ones else self.num_hidden_layers

    def prefill_part(self) -> V41Config:
        """The model of the first `n_prefill_layer` layers (every KV source, no replay layer, no DSpark layers):
        what the prefill side of an asymmetric P/D split holds (`serving.api.disagg`). Raises ConfigError for a
        model without replay layers."""
        n = self.n_prefill_layer
        if n >= self.num_hidden_layers:
            raise ConfigError("this model has no layers after its last KV source: its prefill part is the whole "
                              "model, so an asymmetric P/D split saves nothing")
        engram = [(i, rows) for i, rows in zip(self.engram_layer_ids, self.engram_num_embeddings) if i < n]
        return dataclasses.replace(
            self, num_hidden_layers=n, compress_ratios=self.compress_ratios[:n], num_nextn_predict_layers=0,
            index_source_layer_ids=tuple(i for i in self.index_source_layer_ids if i < n),
            engram_layer_ids=tuple(i for i, _ in engram), engram_num_embeddings=tuple(r for _, r in engram),
            dspark_target_layer_ids=())

    # ---- validation ----------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ConfigError naming the first inconsistent field (the rules of the upstream config)."""
        n, ratios = self.num_hidden_layers, self.compress_ratios
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim",
                     "index_topk", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "hc_mult",
                     "hc_sinkhorn_iters", "candidate_topk_blocks", "candidate_block_size"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if len(ratios) != n + self.num_nextn_predict_layers:
            raise ConfigError(f"compress_ratios has {len(ratios)} entries; expected num_hidden_layers + "
                              f"num_nextn_predict_layers = {n + self.num_nextn_predict_layers}")
        if any(r < 0 for r in ratios) or any(ratios[n:]):
            raise ConfigError(f"compress_ratios must be >= 0 and 0 for the DSpark layers, got {list(ratios)}")
        for name, ids in (("kv_source_layer_ids", self.kv_source_layer_ids),
                          ("index_source_layer_ids", self.index_source_layer_ids)):
            if any(not 0 <= i < n for i in ids) or list(ids) != sorted(set(ids)):
                raise ConfigError(f"{name} {list(ids)} must be increasing layer ids in [0, {n})")
            if any(ratios[i] == 0 for i in ids):
                raise ConfigError(f"{name} {list(ids)} must all have compress_ratios[i] > 0")
        for i in range(n):
            if ratios[i] and not any(s <= i for s in self.kv_source_layer_ids):
                raise ConfigError(f"layer {i} has compress ratio {ratios[i]} but no kv_source_layer_ids entry "
                                  "at or before it")
            source = self.kv_source_of(i)
            if source is not None and ratios[i] != ratios[source]:
                raise ConfigError(f"layer {i} (ratio {ratios[i]}) reads KV source {source} of ratio "
                                  f"{ratios[source]}; a group shares one ratio")
        if self.candidate_source_layer_id >= 0 and self.candidate_source_layer_id not in self.index_source_layer_ids:
            raise ConfigError(f"candidate_source_layer_id={self.candidate_source_layer_id} must be one of "
                              f"index_source_layer_ids {list(self.index_source_layer_ids)}")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ConfigError(f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries for "
                              f"{len(self.engram_layer_ids)} engram_layer_ids")
        if any(not 0 <= i < n for i in self.engram_layer_ids):
            raise ConfigError(f"engram_layer_ids {list(self.engram_layer_ids)} out of range [0, {n})")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                              f"o_groups={self.o_groups}")
        if not 0 < self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim) or self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and fit head_dim and "
                              "index_head_dim")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts")
        if self.n_shared_experts not in (0, 1):
            raise ConfigError(f"n_shared_experts={self.n_shared_experts}: DeepSeek-V4.1 has at most one")
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(f"scoring_func={self.scoring_func!r} is not one of {SCORING_FUNCS}")
        if self.engram_layer_ids and self.engram_head_dim % 32:
            raise ConfigError(f"engram_head_dim={self.engram_head_dim} must be a multiple of 32 (FP8 row scales)")
        for name in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "gate_temp"):
            if not float(getattr(self, name)) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")

    # ---- HF config.json ------------------------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """The composite `config.json` of a DeepSeek-V4.1 checkpoint (text_config; no vision tower)."""
        text: dict[str, Any] = {"model_type": "deepseek_v41_text"}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "rope_scaling":
                value = None if value is None else {"rope_type": "yarn", **dataclasses.asdict(value)}
            elif isinstance(value, tuple):
                value = list(value)
            text[f.name] = value
        text.update(num_key_value_heads=1, tie_word_embeddings=False, hidden_act="silu", topk_method="noaux_tc",
                    n_prefill_layer=self.n_prefill_layer)
        return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text}

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> V41Config:
        """Parse a V4.1 config.json dict (composite or bare text config); unknown fields raise ConfigError."""
        d = dict(raw.get("text_config", raw))
        for key, expected in _FIXED.items():
            if key in d and d.pop(key) not in expected:
                raise ConfigError(f"{key}={raw.get('text_config', raw)[key]!r} is not supported "
                                  f"(expected one of {expected})")
        for key in _IGNORED:
            d.pop(key, None)
        n = d.get("num_hidden_layers")
        n_mtp = d.get("num_nextn_predict_layers", 3)
        if "compress_ratios" not in d:
            raise ConfigError("config has no compress_ratios (the CED layer schedule)")
        ratios = list(d["compress_ratios"])
        if n is not None:
            if len(ratios) < n or len(ratios) > n + n_mtp:
                raise ConfigError(f"compress_ratios has {len(ratios)} entries for {n} layers + {n_mtp} DSpark layers")
            d["compress_ratios"] = ratios + [0] * (n + n_mtp - len(ratios))
        d.setdefault("candidate_source_layer_id", max(d.get("kv_source_layer_ids") or [-1]))
        n_prefill = d.pop("n_prefill_layer", None)
        layer_types = d.pop("layer_types", None)
        read_rope(d)
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"unknown config fields {unknown}")
        try:
            config = cls(**d)
        except TypeError as e:
            raise ConfigError(f"incomplete config: {e}") from None
        if n_prefill is not None and n_prefill != config.n_prefill_layer:
            raise ConfigError(f"n_prefill_layer={n_prefill} disagrees with kv_source_layer_ids "
                              f"{list(config.kv_source_layer_ids)} (expected {config.n_prefill_layer})")
        if layer_types is not None:
            expected = ["shared_compressed_attention" if i in config.kv_source_layer_ids else "sliding_attention"
                        for i in range(config.num_hidden_layers)]
            if list(layer_types) != expected:
                raise ConfigError(f"layer_types {layer_types} disagree with kv_source_layer_ids")
        return config

    @classmethod
    def from_json(cls, path: str | Path) -> V41Config:
        """Read `config.json` (a file or the checkpoint directory holding it)."""
        return cls.from_hf_dict(read_config_json(path))

    def save_json(self, path: str | Path) -> None:
        """Write `config.json` (into a directory, or to the given file path)."""
        path = Path(path)
        (path / "config.json" if path.is_dir() else path).write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")


_IGNORED = ("model_type", "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache",
            "initializer_range", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
            "attention_dropout", "pad_token_id", "quantization_config", "expert_dtype", "vision_config",
            "image_token_id", "rope_interleave", "engram_pad_token_id_note")
_FIXED: dict[str, tuple[Any, ...]] = {
    "num_key_value_heads": (1,), "tie_word_embeddings": (False,), "hidden_act": ("silu",),
    "topk_method": ("noaux_tc",), "attention_bias": (False,),
}


def v41_flash() -> V41Config:
    """deepseek-ai/DeepSeek-V4.1-Flash (text backbone), from its released config."""
    return V41Config(
        vocab_size=129280, hidden_size=5120, num_hidden_layers=40, num_attention_heads=64, head_dim=512,
        qk_rope_head_dim=64, q_lora_rank=1280, o_groups=8, o_lora_rank=1024, sliding_window=128,
        compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20 + (0,) * 3, kv_source_layer_ids=(2, 8, 14, 20),
        index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36), candidate_source_layer_id=20,
        index_n_heads=32, index_head_dim=128, index_topk=512, n_routed_experts=384, n_shared_experts=1,
        num_experts_per_tok=6, moe_intermediate_size=2304, engram_layer_ids=(1, 14),
        engram_num_embeddings=(384006168, 384016682), dspark_target_layer_ids=(37, 38, 39),
        rope_scaling=YarnScaling(factor=16.0, original_max_position_embeddings=65536),
    )


def tiny_v41() -> V41Config:
    """Seconds on CPU: 2 sliding layers, a ratio-2 encoder (2 sources, a consumer), a ratio-1 decoder with a
    re-index layer, the candidate pool, one Engram layer, 8-token windows."""
    return V41Config(
        vocab_size=256, hidden_size=64, num_hidden_layers=9, num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
        compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1, 1), kv_source_layer_ids=(2, 4, 5),
        index_source_layer_ids=(2, 4, 5, 7), candidate_source_layer_id=5, candidate_topk_blocks=3,
        candidate_block_size=4, index_n_heads=16, index_head_dim=16, index_topk=6, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32, hc_sinkhorn_iters=20,
        rms_norm_eps=1e-6, max_position_embeddings=4096, engram_layer_ids=(1,), engram_num_embeddings=(4062,),
        engram_vocab_size=1000, engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=32,
        engram_compressed_vocab_size=256, num_nextn_predict_layers=0, gate_temp=0.9, qat_fake_quant=False,
        rope_scaling=YarnScaling(factor=16.0, original_max_position_embeddings=256),
    )

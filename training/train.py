"""Training a DeepSeek-V4.1 model with the project's own model code: next-token cross-entropy, AdamW with
linear warm-up and cosine decay, DeepSeek's auxiliary-loss-free expert balancing (each router's selection
bias moves towards equal expert loads), Engram tables trained as embeddings, resumable orbax checkpoints, a
tqdm bar and a loss-curve plot, and export in the native checkpoint layout.

A run is a function of its settings: batches depend only on (seed, step), initial weights only on the seed,
so a resumed run continues exactly like an uninterrupted one.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jaxtyping import Array, Float, Int

from model.api import Model
from model.initialize import init_model
from model.checkpoint import BUNDLED, load_model, save_checkpoint
from model.config_v41 import V41Config
from model.engram import DeviceEngramTable, EngramMemory, canonical_vocab
from model.tokenizer import TextTokenizer
from training.corpus import load_corpus
from training.data import bigram_loss, held_out_windows, model_loss, token_stream, train_batch


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Everything besides the model config and the data that decides a run."""

    steps: int = 2000
    batch: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    balance_rate: float = 1e-3  # per-step move of a router's selection bias (aux-loss-free balancing)
    seed: int = 0
    eval_every: int = 200
    eval_windows: int = 32  # held-out windows scored at each evaluation during training
    checkpoint_every: int = 200


def bundled_config(vocab_size: int, canonical_vocab_size: int) -> V41Config:
    """The architecture of the bundled default model: every V4.1 piece at toy size, sized for CPU training.

    Four layers: a ratio-2 encoder (a KV + index source, then a consumer with Engram) and a ratio-1 decoder
    (a KV, index and candidate source, then a re-index layer choosing inside the candidate pool); mHC with 4
    streams, 4 routed experts (top 2) plus a shared one, a 32-token window. The Engram table (2- and
    3-grams, 4 hash heads each) has 33,048 rows: the sum of its eight hash primes, scanned from 4096.
    """
    return V41Config(
        vocab_size=vocab_size, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32, sliding_window=32,
        compress_ratios=(2, 2, 1, 1), kv_source_layer_ids=(0, 2), index_source_layer_ids=(0, 2, 3),
        candidate_source_layer_id=2, candidate_topk_blocks=8, candidate_block_size=8, index_n_heads=4,
        index_head_dim=32, index_topk=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=128, rms_norm_eps=1e-6, rope_scaling=None, max_position_embeddings=4096,
        engram_layer_ids=(1,), engram_num_embeddings=(33048,), engram_vocab_size=4096, engram_max_ngram_size=3,
        engram_n_heads=4, engram_head_dim=32, engram_compressed_vocab_size=canonical_vocab_size,
        num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1, qat_fake_quant=False,
    )


def make_optimizer(settings: TrainSettings) -> optax.GradientTransformation:
    """Clipped AdamW (decay on matrices and tables only) with linear warm-up then cosine decay."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, settings.lr, settings.warmup, settings.steps,
                                                  settings.lr * settings.min_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(settings.clip_norm),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=settings.weight_decay,
                                   mask=lambda tree: jax.tree.map(lambda x: x.ndim >= 2, tree)))


# ---- the step ------------------------------------------------------------------------------------------------
def _logits(module, tokens: Int[Array, "b s"], rows) -> Float[Array, "b s v"]:
    """The full-sequence forward from position 0 with a fresh cache, as `Model.logits` runs it."""
    return module(tokens, module.init_cache(*tokens.shape), rows)[0]


def expert_loads(captured: dict, n_experts: int) -> Float[Array, "layers experts"]:
    """Tokens routed to each expert, per layer, from the router outputs that `nnx.capture` recorded."""
    layers = captured["layers"]
    return jnp.stack([jnp.sum(jax.nn.one_hot(layers[i]["ffn"]["gate"]["__call__"][0][0], n_experts), axis=(0, 1))
                      for i in sorted(layers)])


def rebalance(params: dict, loads: Float[Array, "layers experts"], rate: float) -> None:
    """Auxiliary-loss-free balancing: raise the selection bias of experts below the mean load, lower the others."""
    for i, load in enumerate(loads):
        gate = params["layers"][i]["ffn"]["gate"]
        gate["bias"] = gate["bias"] + rate * jnp.sign(jnp.mean(load) - load)


class Trainer:
    """One run's model graph, Engram hashing, optimizer and jitted train / evaluation steps.

    The state is a pytree {"trainable": {"params": pure parameter dict, "tables": [Engram tables]}, "opt"}.
    """

    def __init__(self, config: V41Config, token_map: Int[np.ndarray, " vocab"], settings: TrainSettings):
        model = init_model(config, seed=settings.seed, token_map=token_map)
        self.config, self.settings, self.memory, self.graphdef = config, settings, model.engram, model.graphdef
        self.optimizer = make_optimizer(settings)
        trainable = {"params": nnx.to_pure_dict(model.params),
                     "tables": [table.weight for table in model.engram.tables] if model.engram else []}
        self.initial = {"trainable": trainable, "opt": self.optimizer.init(trainable)}
        self._train = jax.jit(self._train_step, donate_argnums=0)
        self._eval = jax.jit(self._loss)

    def indices(self, tokens: Int[np.ndarray, "b s"]) -> tuple:
        """Engram table rows [b, s, lookups] of every Engram layer, hashed on the host."""
        return () if self.memory is None else tuple(self.memory.hasher(self.memory.token_map[tokens]))

    def _loss(self, trainable: dict, windows: Int[Array, "b s1"], indices: tuple, capture: bool = False):
        """Mean cross-entropy of predicting windows[:, 1:]; with `capture`, also the expert loads."""
        module = nnx.merge(self.graphdef, trainable["params"])
        rows = tuple(jnp.take(table, idx, axis=0) for table, idx in zip(trainable["tables"], indices))
        if capture:
            logits, captured = nnx.capture(_logits, nnx.Intermediate, method_outputs=nnx.Intermediate)(
                module, windows[:, :-1], rows)
        else:
            logits = _logits(module, windows[:, :-1], rows)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()
        return (loss, expert_loads(nnx.to_pure_dict(captured), self.config.n_routed_experts)) if capture else loss

    def _train_step(self, state: dict, windows, indices):
        (loss, loads), grads = jax.value_and_grad(self._loss, has_aux=True)(
            state["trainable"], windows, indices, capture=True)
        updates, opt = self.optimizer.update(grads, state["opt"], state["trainable"])
        trainable = optax.apply_updates(state["trainable"], updates)
        rebalance(trainable["params"], loads, self.settings.balance_rate)
        return {"trainable": trainable, "opt": opt}, loss

    def step(self, state: dict, windows: Int[np.ndarray, "b s1"]):
        """(new state, loss) after one optimizer step on `windows`; the state is donated."""
        return self._train(state, jnp.asarray(windows), self.indices(windows[:, :-1]))

    def evaluate(self, state: dict, windows: Int[np.ndarray, "w s1"]) -> float:
        """Mean next-token cross-entropy on held-out windows (batches of `settings.batch`)."""
        chunks = [windows[i:i + self.settings.batch] for i in range(0, len(windows), self.settings.batch)]
        return sum(float(self._eval(state["trainable"], jnp.asarray(c), self.indices(c[:, :-1]))) * len(c)
                   for c in chunks) / len(windows)

    def model(self, state: dict) -> Model:
        """The trained model as a `Model` (Engram tables on the device, float32)."""
        tables = [DeviceEngramTable(np.asarray(t), None) for t in state["trainable"]["tables"]]
        engram = EngramMemory(self.config, self.memory.token_map, tables) if tables else None
        return Model(nnx.merge(self.graphdef, state["trainable"]["params"]), engram=engram)


# ---- the run -------------------------------------------------------------------------------------------------
LOG_EVERY = 10  # steps between reading losses back (each read waits for the device)


def _run_record(trainer: Trainer) -> dict:
    """What a resumed run must share with the checkpoint it resumes (as JSON would return it)."""
    return json.loads(json.dumps({"settings": dataclasses.asdict(trainer.settings),
                                  "config": trainer.config.to_hf_dict()}))


def train(trainer: Trainer, train_stream: Int[np.ndarray, " n"], held_out_stream: Int[np.ndarray, " m"],
          out_dir: str | Path, until: int | None = None, progress: bool = True) -> tuple[dict, dict]:
    """Train (resuming from the latest checkpoint in `out_dir/checkpoints`) up to step `settings.steps`, or
    stop after step `until`; returns (state, history).

    The history holds every step's training loss, held-out losses [[step, loss]], tokens/s [[step, rate]]
    and the wall seconds spent; it is checkpointed with the state, so a resumed run's history is whole.
    """
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    s = trainer.settings
    manager = ocp.CheckpointManager(Path(out_dir).absolute() / "checkpoints",
                                    options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
    state = jax.tree.map(jnp.copy, trainer.initial)  # steps donate their state; the trainer stays reusable
    history = {"run": _run_record(trainer), "loss": [], "held_out": [], "tokens_per_s": [], "seconds": 0.0}
    if (latest := manager.latest_step()) is not None:
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = manager.restore(latest, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                  history=ocp.args.JsonRestore()))
        if restored.history["run"] != history["run"]:
            raise ValueError(f"{out_dir} holds a run with other settings or another config; train into a new "
                             "directory (or pass the same settings to resume it)")
        # as host arrays, placed by the next step like the initial state (committed ones would compile it anew)
        state, history = jax.tree.map(np.asarray, restored.state), restored.history
    held_out = held_out_windows(held_out_stream, s.seq_len + 1)[:s.eval_windows]
    step, stop = len(history["loss"]), s.steps if until is None else min(until, s.steps)
    pending, postfix = [], {}
    with tqdm(total=s.steps, initial=step, unit="step", desc="train", file=sys.stderr, disable=not progress) as bar:
        wall = clock = time.perf_counter()
        while step < stop:
            windows = train_batch(train_stream, s.batch, s.seq_len + 1, s.seed, step)
            state, loss = trainer.step(state, windows)
            pending.append(loss)
            step += 1
            evaluate, save = step % s.eval_every == 0 or step == s.steps, step % s.checkpoint_every == 0 or step == stop
            if len(pending) == LOG_EVERY or evaluate or save:
                history["loss"] += [float(x) for x in pending]
                rate = len(pending) * s.batch * s.seq_len / (time.perf_counter() - clock)
                history["tokens_per_s"].append([step, rate])
                postfix.update(loss=f"{np.mean(history['loss'][-len(pending):]):.3f}", tok_s=f"{rate:.0f}")
                bar.update(len(pending))
                pending = []
            if evaluate:
                history["held_out"].append([step, trainer.evaluate(state, held_out)])
                postfix["held_out"] = f"{history['held_out'][-1][1]:.3f}"
            bar.set_postfix(postfix, refresh=False)
            if save:
                history["seconds"] += time.perf_counter() - wall
                wall = time.perf_counter()
                manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                           history=ocp.args.JsonSave(history)))
                manager.wait_until_finished()  # the next step donates the state's buffers
            clock = time.perf_counter() if evaluate or save or not pending else clock
    manager.close()
    return state, history


def export(trainer: Trainer, state: dict, tokenizer_json: str | Path, out: str | Path) -> Model:
    """Write the trained model in the native checkpoint layout (config.json, model.safetensors, tokenizer.json)
    and read it back through `load_model`, as any checkpoint is read."""
    out = Path(out)
    save_checkpoint(trainer.model(state), out)
    shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    return load_model(out)


def plot_losses(history: dict, tokens_per_step: int, path: str | Path, baseline: float | None = None) -> None:
    """The loss curve: training loss (raw and a 25-step mean), held-out losses, the bigram baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss = np.asarray(history["loss"])
    millions = (np.arange(len(loss)) + 1) * tokens_per_step / 1e6
    smooth = np.convolve(loss, np.ones(25) / 25, mode="valid") if len(loss) >= 25 else loss
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(millions, loss, color="tab:blue", alpha=0.25, lw=0.8)
    ax.plot(millions[len(loss) - len(smooth):], smooth, color="tab:blue", label="training (25-step mean)")
    if history["held_out"]:
        steps, held = zip(*history["held_out"])
        ax.plot(np.asarray(steps) * tokens_per_step / 1e6, held, "o-", color="tab:orange", label="held-out")
    if baseline is not None:
        ax.axhline(baseline, color="tab:gray", ls="--", label=f"bigram baseline ({baseline:.2f})")
    ax.set(xlabel="training tokens (millions)", ylabel="cross-entropy (nats / token)",
           ylim=(min(loss.min(), baseline or np.inf) - 0.3, min(loss.max(), 9.0) + 0.2))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---- command line (`jaxseek train`, scripts/train.py) ------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True,
                   help="run directory: orbax checkpoints (running again resumes) and, by default, the exported model")
    p.add_argument("--tokenizer", type=Path, default=BUNDLED / "tokenizer.json",
                   help="tokenizer.json (default: the bundled one; scripts/train_tokenizer.py makes it)")
    p.add_argument("--export", type=Path, help="where the trained checkpoint goes (default: OUT/model)")
    p.add_argument("--until", type=int, metavar="STEP", help="stop after this step (running again resumes)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("settings (a resumed run must repeat them)")
    for f in dataclasses.fields(TrainSettings):
        g.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                       help=f"(default {f.default})")


def run(args: argparse.Namespace) -> int:
    """Train the bundled recipe on the corpus; at the last step export the model, score it and the bigram
    baseline on the held-out works, write training.json and loss_curve.png beside the checkpoint."""
    if importlib.util.find_spec("matplotlib") is None:
        raise FileNotFoundError("matplotlib (for the loss curve) is not installed: pip install -e '.[train]'")
    corpus = load_corpus()
    tokenizer = TextTokenizer.from_file(args.tokenizer)
    token_map = canonical_vocab(args.tokenizer)
    config = bundled_config(tokenizer.vocab_size, int(token_map.max()) + 1)
    settings = TrainSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainSettings)})
    train_stream = token_stream(list(corpus.train.values()), tokenizer, config.eos_token_id)
    held_out_stream = token_stream(list(corpus.held_out.values()), tokenizer, config.eos_token_id)
    trainer = Trainer(config, token_map, settings)
    state, history = train(trainer, train_stream, held_out_stream, args.out, args.until, not args.no_progress)
    if len(history["loss"]) < settings.steps:
        print(f"stopped after step {len(history['loss'])} of {settings.steps}; run again to resume", file=sys.stderr)
        return 0
    export_dir = args.export or args.out / "model"
    model = export(trainer, state, args.tokenizer, export_dir)
    windows = held_out_windows(held_out_stream, settings.seq_len + 1)
    report = {"held_out_loss": model_loss(model, windows),
              "bigram_loss": bigram_loss(train_stream, windows, config.vocab_size),
              "held_out_tokens": int(windows[:, 1:].size), "train_tokens": int(train_stream.size),
              "tokens_seen": settings.steps * settings.batch * settings.seq_len,
              "train_seconds": round(history["seconds"], 1),
              "params": int(sum(np.size(x) for x in jax.tree.leaves(state["trainable"]))),
              "held_out_during_training": history["held_out"], "settings": dataclasses.asdict(settings),
              "corpus": corpus.record()}
    report["held_out_perplexity"] = float(np.exp(report["held_out_loss"]))
    report["bigram_perplexity"] = float(np.exp(report["bigram_loss"]))
    (export_dir / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    plot_losses(history, settings.batch * settings.seq_len, export_dir / "loss_curve.png", report["bigram_loss"])
    print(json.dumps({k: v for k, v in report.items() if k != "held_out_during_training"}, indent=2))
    return 0

"""Train the bundled model's DSpark drafter on the model's own generations, calibrate its confidences (STS) and
measure acceptance the way the verifier computes it.

    python scripts/train_drafter.py --out runs/drafter --export model/bundled

1. The bundled model continues prompts cut from its training works (sampled at temperature 1) and from its
   held-out works (at temperature 1 and greedily, for evaluation).
2. The drafter trains on the training continuations (`training.drafter`).
3. On the held-out continuations each anchor's block is drafted as serving drafts it and scored by the target:
   accept_prob = sum_v min(p_target, q_draft) per draft, at temperature 1 and 0.
4. STS: one confidence temperature per block position, fitted on half of the temperature-1 held-out blocks
   (DSpark's prefix-ECE objective, and the mean-absolute-error one); mean |accept_prob - confidence| and the
   prefix ECE are reported on the other half, before and after.
5. `--export DIR` writes the calibrated drafter beside the checkpoint in DIR (dspark.json, dspark.safetensors).
A JSON report with the settings, losses and figures goes to OUT/report.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from model.calibration import calibration_error, fit_sts, prefix_ece, sts_confidence
from model.checkpoint import load_model, save_drafter
from model.dspark import DSparkConfig
from training.corpus import load_corpus
from training.data import token_stream, train_batch
from training.drafter import (DrafterSettings, DrafterTrainer, expected_accepted, generate, sample_anchors,
                              train_drafter, verify_offline)

# The bundled drafter: the target's last three layers feed two draft layers; blocks of 5 (DeepSeek's gamma).
BUNDLED_DRAFTER = DSparkConfig(target_layer_ids=(1, 2, 3), num_layers=2, block_size=5, noise_token_id=2,
                               markov_rank=64, n_routed_experts=4, num_experts_per_tok=2, window=32)

EVAL_ANCHORS = 2**31 - 1  # the anchor stream of the held-out blocks (no training step draws from it)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def acceptance(result: dict) -> dict:
    """Per-position mean accept_prob and the expected accepted drafts per block."""
    return {"mean_accept_prob": np.round(result["accept_prob"].mean(0), 4).tolist(),
            "expected_accepted_per_block": round(expected_accepted(result["accept_prob"]), 4)}


def calibration(result: dict, temperatures) -> dict:
    conf = sts_confidence(result["conf_logits"], temperatures)
    return {"mean_abs_error": round(calibration_error(result["accept_prob"], conf), 4),
            "mean_abs_error_per_position": np.round(np.abs(result["accept_prob"] - conf).mean(0), 4).tolist(),
            "prefix_ece": np.round(prefix_ece(result["accept_prob"], conf), 4).tolist()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/drafter", help="directory for report.json")
    parser.add_argument("--export", default=None, help="checkpoint directory to write the drafter beside")
    parser.add_argument("--model", default=None, help="target checkpoint (default: the bundled model)")
    parser.add_argument("--train-sequences", type=int, default=1024)
    parser.add_argument("--eval-sequences", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--eval-anchors", type=int, default=8)
    parser.add_argument("--steps", type=int, default=DrafterSettings.steps)
    parser.add_argument("--batch", type=int, default=DrafterSettings.batch)
    parser.add_argument("--anchors", type=int, default=DrafterSettings.anchors)
    parser.add_argument("--lr", type=float, default=DrafterSettings.lr)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sts-objective", choices=("prefix_ece", "abs_error"), default="abs_error",
                        help="the STS fit shipped with the drafter (both are reported)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    target = load_model(args.model, engram_placement="device")
    corpus = load_corpus()
    eos = target.config.eos_token_id
    train_stream = token_stream(list(corpus.train.values()), target.tokenizer, eos)
    held_stream = token_stream(list(corpus.held_out.values()), target.tokenizer, eos)
    p, n = args.prompt_len, args.new_tokens
    prompts = train_batch(train_stream, args.train_sequences, p, args.seed, 0)
    eval_prompts = train_batch(held_stream, args.eval_sequences, p, args.seed, 1)
    log(f"generating {len(prompts)} training and 2 x {len(eval_prompts)} held-out continuations of {n} tokens")
    sequences = generate(target, prompts, n, 1.0, args.seed, batch=128)
    held = {1.0: generate(target, eval_prompts, n, 1.0, args.seed + 1, batch=128),
            0.0: generate(target, eval_prompts, n, 0.0, args.seed + 1, batch=128)}
    generated = time.perf_counter()
    log(f"generated in {generated - started:.0f} s")

    settings = DrafterSettings(steps=args.steps, batch=args.batch, anchors=args.anchors, lr=args.lr, seed=args.seed)
    trainer = DrafterTrainer(target, BUNDLED_DRAFTER, settings)
    eval_anchors = sample_anchors((p, p + n), args.eval_sequences, args.eval_anchors, BUNDLED_DRAFTER.block_size,
                                  args.seed, EVAL_ANCHORS)
    before = trainer.evaluate(trainer.initial, held[1.0], eval_anchors)
    state, losses = train_drafter(trainer, sequences, p, log=lambda step, loss: log(f"step {step}: loss {loss:.4f}"))
    after = trainer.evaluate(state, held[1.0], eval_anchors)
    trained = time.perf_counter()
    log(f"trained {settings.steps} steps in {trained - generated:.0f} s; held-out loss {before['loss']:.3f} -> "
        f"{after['loss']:.3f}")

    drafter = trainer.drafter(state)
    results = {t: verify_offline(trainer.target, drafter, held[t], eval_anchors, t, args.seed) for t in held}
    half = len(results[1.0]["accept_prob"]) // 2
    fit = {k: v[:half] for k, v in results[1.0].items()}
    test = {k: v[half:] for k, v in results[1.0].items()}
    fitted = {objective: fit_sts(fit["conf_logits"], fit["accept_prob"], objective)
              for objective in ("prefix_ece", "abs_error")}
    temperatures = fitted[args.sts_objective]
    calibrated = dataclasses.replace(BUNDLED_DRAFTER, confidence_temperatures=temperatures)
    report = {
        "drafter": dataclasses.asdict(calibrated),
        "settings": dataclasses.asdict(settings) | {"train_sequences": args.train_sequences, "prompt_len": p,
                                                    "new_tokens": n, "eval_sequences": args.eval_sequences,
                                                    "eval_anchors": args.eval_anchors},
        "parameters": int(sum(np.size(x) for x in jax.tree.leaves(state["params"]))),
        "seconds": {"generate": round(generated - started), "train": round(trained - generated)},
        "loss": {"first_25": round(float(np.mean(losses[:25])), 4), "last_25": round(float(np.mean(losses[-25:])), 4),
                 "held_out_before": before, "held_out_after": after, "every_step": [round(x, 4) for x in losses]},
        "acceptance": {"temperature_1": acceptance(results[1.0]), "temperature_0": acceptance(results[0.0])},
        "calibration_temperature_1": {"fit_blocks": half, "test_blocks": len(test["accept_prob"]),
                                      "shipped_sts_objective": args.sts_objective,
                                      "before_sts": calibration(test, np.ones(len(temperatures)))} | {
            f"after_sts_{objective}": {"sts_temperatures": [round(t, 4) for t in temps]} | calibration(test, temps)
            for objective, temps in fitted.items()},
        "calibration_temperature_0": {"before_sts": calibration(results[0.0], np.ones(len(temperatures))),
                                      "after_sts": calibration(results[0.0], temperatures)},
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    summary = {k: v for k, v in report.items() if k not in ("loss", "settings")}
    print(json.dumps(summary | {"loss": {k: v for k, v in report["loss"].items() if k != "every_step"}}, indent=2))
    if args.export:
        save_drafter(trainer.drafter(state, calibrated), args.export)
        log(f"wrote the drafter beside {args.export}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

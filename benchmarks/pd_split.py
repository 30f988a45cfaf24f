"""P/D split benchmark: what the prefill side holds and hands over, symmetric against V4.1's asymmetric split.

    jaxseek bench pd-split                          # prompts of 160, 320 and 640 tokens, 4 of each (~4 min on 2 cores)
    jaxseek bench pd-split --lengths 200 --requests 2

Prints ONE JSON line on stdout (progress on stderr). Never run by the test suite.

A `serving.api.disagg.DisaggregatedEngine` on the bundled model (decode engine on `dp=2,ep=2`, prefill process on
`dp=2`), once per split: `symmetric` (the prefill process runs the whole model on the whole prompt and hands over
the request's whole slot state after its first token) and `asymmetric` (it holds the layers through the last KV
source alone, runs them on all but the prompt's last replay-keep tokens and hands over those layers' state; the
decode engine prefills the tail through every layer). Per split:
- `prefill_weight_bytes_<split>`: the prefill process's resident weights, as it reports them (bundled model);
- `handoff_bytes_per_request_<split>_<length>`: the bytes of one request's hand-off for a prompt of that length
  (`SlotState.nbytes`: pages and per-slot leaves; a deterministic size, so one run);
- `tokens_equal_<split>`: whether every request's tokens equal a single engine's on one device.
`v41_flash_weight_bytes_{whole,prefill_part}` are DeepSeek-V4.1-Flash's stored (FP8 / FP4) weights, read off the
real parameter shapes of the whole model and of its prefill part (`V41Config.prefill_part`).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np

from benchmarks.bench_json import json_line

ENGINE = dict(max_slots=4, prefill_chunk=64, num_top_logprobs=5)


def log(message: str) -> None:
    print(f"bench pd-split: {message}", file=sys.stderr, flush=True)


def prompts_of(tokenizer, lengths: list[int], requests: int) -> list[list[int]]:
    """`requests` prompts of each length: Shakespeare-like text from the bundled tokenizer, cut to length."""
    text = ("KING HENRY:\nOnce more unto the breach, dear friends, once more; Or close the wall up with our English "
            "dead. In peace there's nothing so becomes a man As modest stillness and humility. ")
    ids = tokenizer.encode(text * 40)
    return [ids[i * 7:i * 7 + n] for n in lengths for i in range(requests)]


def run_split(model, split: str, prompts: list[list[int]], params, max_len: int) -> tuple[list[int], int, list]:
    """(hand-off bytes of each request, the prefill process's weight bytes, the outputs) of one split."""
    from serving.api.disagg import DisaggregatedEngine
    from serving.core.engine import Engine

    decode = Engine(model, mesh="dp=2,ep=2", max_len=max_len, **ENGINE)
    pd = DisaggregatedEngine(decode, prefill_mesh="dp=2", split=split,
                             compile_cache=jax.config.jax_compilation_cache_dir)
    try:
        sizes, outputs = [], []
        for prompt in prompts:  # one at a time: each request's hand-off is measured alone
            before = pd.handoff_bytes
            rid = pd.add_request(prompt, params)
            outputs.append(pd.run()[rid].token_ids)
            sizes.append(pd.handoff_bytes - before)
        return sizes, pd.prefill_weight_bytes, outputs
    finally:
        pd.close()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[160, 320, 640], help="prompt lengths (tokens)")
    parser.add_argument("--requests", type=int, default=4, help="requests of each length (default 4)")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 8)
    os.environ["JAX_NUM_CPU_DEVICES"] = "8"  # the spawned prefill process's devices
    from model import load_model
    from model.config_v41 import v41_flash
    from model.stats import param_bytes_by_format
    from serving.base.sampling import SamplingParams
    from serving.core.engine import Engine

    model = load_model()
    prompts = prompts_of(model.tokenizer, args.lengths, args.requests)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=7)
    max_len = max(args.lengths) + 32
    log("a single engine on one device (the reference)")
    reference = [out.token_ids for out in Engine(model, max_len=max_len, **ENGINE).generate(prompts, params)]
    flash = v41_flash()
    result: dict = {"load_avg_1m_start": round(os.getloadavg()[0], 2), "lengths": args.lengths,
                    "requests_per_length": args.requests, "decode_mesh": "dp=2,ep=2", "prefill_mesh": "dp=2",
                    "v41_flash_weight_bytes_whole": param_bytes_by_format(flash)["param_bytes_checkpoint"],
                    "v41_flash_weight_bytes_prefill_part":
                        param_bytes_by_format(flash.prefill_part())["param_bytes_checkpoint"]}
    for split in ("symmetric", "asymmetric"):
        log(f"the {split} split")
        sizes, weights, outputs = run_split(model, split, prompts, params, max_len)
        result[f"prefill_weight_bytes_{split}"] = weights
        for i, n in enumerate(args.lengths):
            per_length = sizes[i * args.requests:(i + 1) * args.requests]
            result[f"handoff_bytes_per_request_{split}_{n}"] = int(np.median(per_length))
        result[f"tokens_equal_{split}"] = outputs == reference
    result["prefill_weights_asymmetric_over_symmetric"] = round(
        result["prefill_weight_bytes_asymmetric"] / result["prefill_weight_bytes_symmetric"], 3)
    result["v41_flash_prefill_part_over_whole"] = round(
        result["v41_flash_weight_bytes_prefill_part"] / result["v41_flash_weight_bytes_whole"], 3)
    for n in args.lengths:
        result[f"handoff_asymmetric_over_symmetric_{n}"] = round(
            result[f"handoff_bytes_per_request_asymmetric_{n}"] / result[f"handoff_bytes_per_request_symmetric_{n}"], 3)
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    print(json_line(result))
    return result


if __name__ == "__main__":
    main()

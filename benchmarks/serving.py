"""Load test of the OpenAI-compatible server: Poisson arrivals, a concurrency cap, streaming chat clients (some
hanging up mid-stream, some sending bad requests); prints one JSON line of vLLM bench-serve figures (TTFT, TPOT,
ITL, E2E latency, throughput) and the checks (bad requests refused with a 4xx, no leaked KV pages, server up).

    jaxseek bench serving                       # starts the bundled model's server on a free port
    jaxseek bench serving --base-url http://127.0.0.1:8000 --model jaxseek-bundled

Exit status 1 if a good request failed, a bad request was not refused with a 4xx, pages leaked or the server
went down.
"""

from __future__ import annotations

import argparse
import asyncio
import sys


from benchmarks.bench_json import json_line
from serving.loadgen import run_load

PROMPTS = ["Who goes there?", "Speak, what news from Venice?", "What light through yonder window breaks?",
           "Tell me of the king.", "Is this a dagger which I see before me?", "Where is the duke?"]


def start_server(args):
    """The bundled model's server on a free localhost port, in this process; returns (base url, stop)."""
    from model import load_model
    from serving.server import Server, ServerConfig, serve_in_thread

    server = Server(load_model(), ServerConfig(model_name=args.model), max_slots=args.max_slots,
                    max_len=args.max_len, prefill_chunk=args.prefill_chunk)
    server.engine.warmup()
    return serve_in_thread(server.app)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="a running server on this machine (default: start the bundled model's)")
    p.add_argument("--model", default="jaxseek-bundled", help="the served model name")
    p.add_argument("--api-key")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: all "
                                                                           "at once)")
    p.add_argument("--disconnect-fraction", type=float, default=0.125)
    p.add_argument("--bad-fraction", type=float, default=0.125)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("the started server (without --base-url)")
    g.add_argument("--max-slots", type=int, default=8)
    g.add_argument("--max-len", type=int, default=256)
    g.add_argument("--prefill-chunk", type=int, default=32)
    args = p.parse_args(argv)
    stop = None
    base_url = args.base_url
    if base_url is None:
        base_url, stop = start_server(args)
    try:
        summary, _ = asyncio.run(run_load(
            base_url, args.model, PROMPTS, num_requests=args.num_requests, max_concurrency=args.max_concurrency,
            request_rate=args.request_rate, disconnect_fraction=args.disconnect_fraction,
            bad_fraction=args.bad_fraction, max_tokens=args.max_tokens, max_len=args.max_len, api_key=args.api_key,
            seed=args.seed))
    except ValueError as e:
        print(f"bench_serving: error: {e}", file=sys.stderr)
        return 2
    finally:
        if stop is not None:
            stop()
    print(json_line(summary))
    ok = (summary["failed"] == 0 and summary["bad_requests_refused_4xx"] == summary["bad_requests"]
          and summary["leaked_pages"] == 0 and summary["server_up"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Real third-party clients, run unchanged against a live `jaxseek serve` over the bundled model (a subprocess on a
free 127.0.0.1 port, one for the module): lm-evaluation-harness (`local-completions`, which finds the server's
remote tokenizer itself) on the task files in tests/data/lm_eval/, its log-likelihoods, accuracy and rolling
log-likelihoods against the model's own full forward (`Model.logits`) on the same token ids, two documents sharing
a long passage so that the prefix cache serves part of the pass; its generations against greedy decoding by that
forward; the openai SDK's `parse` with a pydantic response_format and pydantic-ai's Agent with an output type
(a forced tool call), each giving a validated object. The clients come from the `clients` extra."""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from pydantic import BaseModel, Field

from model import load_model
from model.api import Model
from benchmarks.serving import free_port, stop_server, wait_healthy
from tests.helpers import greedy_full_forward, prompt_logprobs_by_forward

DATA = Path(__file__).parent / "data"
TASKS = DATA / "lm_eval"
MODEL = "jaxseek-bundled"
WIDTH = 384  # every reference log-likelihood is one forward padded to this length: one compile
TOL = 1e-4


class Speaker(BaseModel):
    name: str = Field(max_length=12)
    act: int = Field(ge=1, le=5)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """`jaxseek serve` on the bundled model (a Jinja chat template, so that pydantic-ai's output tool can be
    forced); yields its base URL once /health answers."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    port = free_port()
    cmd = [sys.executable, "-m", "jaxseek.cli", "serve", "--port", str(port), "--max-num-seqs", "2",
           "--max-model-len", "512", "--chat-template", str(DATA / "real_clients_chat.jinja"),
           "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, [proc], 300, lambda: log.read_text()[-3000:])
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def model() -> Model:
    return load_model()


@pytest.fixture(scope="module")
def lm_eval_run(live, tmp_path_factory) -> dict:
    """One lm-eval run of the three tasks; returns {"results": its results, task: [samples by doc_id]}. The data
    files resolve from the tasks' folder (the run's working directory)."""
    out = tmp_path_factory.mktemp("lm_eval")
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
           "--tasks", "shakespeare_mc,shakespeare_gen,shakespeare_ppl", "--include_path", str(TASKS),
           "--output_path", str(out), "--log_samples",
           "--model_args", f"model={MODEL},base_url={live}/v1/completions,num_concurrent=1,max_retries=1,"
                           "max_length=512"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(out / "hf")}
    run = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    [results] = glob.glob(str(out / "*" / "results_*.json"))
    runs = {"results": json.loads(Path(results).read_text())["results"]}
    for task in ("shakespeare_mc", "shakespeare_gen", "shakespeare_ppl"):
        [samples] = glob.glob(str(out / "*" / f"samples_{task}_*.jsonl"))
        runs[task] = sorted((json.loads(line) for line in Path(samples).read_text().splitlines()),
                            key=lambda s: s["doc_id"])
    return runs


def scored(model: Model, seq: list[int], start: int) -> tuple[float, bool]:
    """The full forward's log-likelihood of seq[start:] given what precedes it, and whether each of those tokens
    is the most likely one (lm-eval's is_greedy)."""
    logprobs, argmax = prompt_logprobs_by_forward(model, seq, WIDTH)
    return float(logprobs[start - 1:].sum()), bool((argmax[start - 1:] == seq[start:]).all())


def encode_pair(model: Model, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) request into token ids: the context's trailing spaces move to
    the continuation, and the continuation's ids are the whole text's after the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = model.tokenizer.encode(context + continuation)
    ctx = model.tokenizer.encode(context)
    return ctx, whole[len(ctx):]


def mc_requests(model: Model, samples: list[dict]) -> list[list[tuple[list[int], list[int]]]]:
    """Per document, per choice, the (context, continuation) ids lm-eval sent."""
    return [[encode_pair(model, a["arg_0"], a["arg_1"]) for a in s["arguments"].values()] for s in samples]


def test_lm_eval_multiple_choice_log_likelihoods_and_accuracy(lm_eval_run, model, live):
    """Every choice's log-likelihood (and is-greedy flag) lm-eval read from the server's echoed prompt logprobs
    equals the full forward's within 1e-4, for the documents whose shared passage came from the prefix cache
    too; its accuracy is the choice picked by hand from those. A repeat of one of its requests is served from the
    prefix cache (usage.prompt_tokens_details.cached_tokens) with the same logprobs."""
    samples = lm_eval_run["shakespeare_mc"]
    requests = mc_requests(model, samples)
    picked = []
    for sample, doc in zip(samples, requests, strict=True):
        ours = [scored(model, ctx + cont, len(ctx)) for ctx, cont in doc]
        theirs = [(float(ll), greedy == "True") for [[ll, greedy]] in sample["resps"]]
        assert [g for _, g in theirs] == [g for _, g in ours]
        np.testing.assert_allclose([ll for ll, _ in theirs], [ll for ll, _ in ours], atol=TOL, rtol=0)
        picked.append(int(np.argmax([ll for ll, _ in ours])) == sample["doc"]["label"])
    assert lm_eval_run["results"]["shakespeare_mc"]["acc,none"] == pytest.approx(np.mean(picked))
    assert len(os.path.commonprefix([requests[0][0][0], requests[1][0][0]])) > 300  # the shared passage

    def series(name: str) -> float:
        return float(next(line.split()[-1] for line in httpx.get(live + "/metrics").text.splitlines()
                          if line.startswith(name + "{")))

    assert series("jaxseek:prefix_cache_hit_rate") > 0
    queried, hit = series("jaxseek:prefix_cache_queries_total"), series("jaxseek:prefix_cache_hits_total")
    ctx, cont = requests[0][0]
    body = {"model": MODEL, "prompt": [ctx + cont], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    r = httpx.post(live + "/v1/completions", json=body, timeout=60).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert series("jaxseek:prefix_cache_queries_total") - queried == len(ctx + cont)
    assert series("jaxseek:prefix_cache_hits_total") - hit >= r["usage"]["prompt_tokens_details"]["cached_tokens"]
    served = r["choices"][0]["logprobs"]["token_logprobs"]
    assert served[0] is None and len(served) == len(ctx + cont) + 1
    np.testing.assert_allclose(served[1:-1], prompt_logprobs_by_forward(model, ctx + cont, WIDTH)[0], atol=TOL,
                               rtol=0)


def test_lm_eval_rolling_log_likelihood(lm_eval_run, model, live):
    """A document shorter than max_length is one window: lm-eval's prefix token (the remote tokenizer's BOS id,
    or its EOS id when that is 0, as the bundled BOS is) then the text's tokens, all of them scored."""
    info = httpx.get(live + "/tokenizer_info").json()
    prefix = info["bos_token_id"] or info["eos_token_id"]
    samples = lm_eval_run["shakespeare_ppl"]
    for sample in samples:
        seq = [prefix] + model.tokenizer.encode(sample["arguments"]["gen_args_0"]["arg_0"])
        assert abs(float(sample["resps"][0][0]) - scored(model, seq, 1)[0]) <= TOL


def test_lm_eval_generation_is_greedy(lm_eval_run, model, live):
    """Each generation is the full forward's greedy text up to the task's stop string (or EOS)."""
    eos = httpx.get(live + "/tokenizer_info").json()["eos_token_id"]
    samples = lm_eval_run["shakespeare_gen"]
    prompts = [model.tokenizer.encode(s["arguments"]["gen_args_0"]["arg_0"]) for s in samples]
    steps = samples[0]["arguments"]["gen_args_0"]["arg_1"]["max_gen_toks"]
    for sample, prompt in zip(samples, prompts, strict=True):
        [(tokens, _)] = greedy_full_forward(model, [prompt], steps, rows=1, width=96)  # test_server's shape
        text = model.tokenizer.decode(tokens[:tokens.index(eos)] if eos in tokens else tokens)
        assert sample["resps"][0][0] == text.split("\n")[0]


def test_openai_parse_with_a_pydantic_response_format(live):
    client = openai.OpenAI(base_url=live + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Who speaks first?"}],
                                      response_format=Speaker, max_tokens=60, temperature=0)
    assert isinstance(r.choices[0].message.parsed, Speaker)


def test_pydantic_ai_agent_output_type(live):
    """pydantic-ai answers an output type through its `final_result` tool, forced by tool_choice."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    agent = Agent(OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=live + "/v1", api_key="x")),
                  output_type=Speaker)
    result = agent.run_sync("Who speaks first, and in which act?",
                            model_settings={"max_tokens": 80, "temperature": 0, "parallel_tool_calls": False})
    assert isinstance(result.output, Speaker)

"""The serving engine, in layers (each imports only those before it; tests/test_layering.py):

- `serving.base`: what every part shares: a request and its output, sampling parameters and the sampler, the
  engine's settings, the cache layout and page allocator, the tokenizer and detokenizer;
- `serving.structured`: structured outputs (constraints, grammar masks and their budget, jump-forward);
- `serving.speculation`: draft verification and the choice of how many drafts to verify;
- `serving.prefix`: the prefix cache, its host tier, window-state snapshots and stored prompt logprobs;
- `serving.core`: the engine: scheduler, step programs (one program or layer programs), placements on one device
  or a mesh, slot state and the executable cache;
- `serving.api`: what stands on the engine: the OpenAI-compatible server and its bodies, the batch job, the
  replica router, P/D disaggregation, metrics and the load generator.

`serving.engine.Engine` and `serving.sampling.SamplingParams` keep their short import paths.
"""

"""What stands on the engine: the OpenAI-compatible server, the batch job, the replica router, P/D
disaggregation, metrics and the load generator."""

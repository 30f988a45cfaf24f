"""What every part of the engine shares: requests, sampling, settings, the cache layout, tokenizers."""

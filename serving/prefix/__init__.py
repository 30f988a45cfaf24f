"""The prefix cache: the radix tree of cached pages, its host tier, window-state snapshots, stored prompt
logprobs, admission of a request against it, one per attention rank on a mesh."""

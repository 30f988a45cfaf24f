"""Training the bundled default model: the corpus, token batches and the training loop."""

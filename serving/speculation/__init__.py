"""Speculative decoding: draft verification, and how many drafts each step verifies (fixed or DSpark)."""

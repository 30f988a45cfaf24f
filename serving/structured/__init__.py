"""Structured outputs: constraints (regex, JSON Schema, EBNF), token masks, their budget, jump-forward."""

"""Frozen dataclasses as pytree nodes whose leaves may be whatever a tree map makes.

`pytree_dataclass` registers a frozen dataclass as a node of its fields, in order (a None field is an empty
subtree). Unflattening and `replace` skip `__init__`, and with it the annotation checks of its fields, so a tree
map may turn the arrays into shapes, shardings, logical axes or host copies and keep the type.
"""

from __future__ import annotations

import dataclasses

import jax


def pytree_dataclass(cls: type) -> type:
    """Register the frozen dataclass `cls` as a pytree node of its fields (key paths by field name)."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    keys = tuple(jax.tree_util.GetAttrKey(name) for name in names)
    jax.tree_util.register_pytree_with_keys(
        cls, lambda node: (tuple(zip(keys, (getattr(node, n) for n in names))), None),
        lambda _, children: _build(cls, dict(zip(names, children))),
        lambda node: (tuple(getattr(node, n) for n in names), None))
    return cls


def replace(node, **fields):
    """A copy of the `pytree_dataclass` instance `node` with `fields` changed."""
    return _build(type(node), {f.name: getattr(node, f.name) for f in dataclasses.fields(node)} | fields)


def _build(cls: type, fields: dict):
    node = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(node, name, value)
    return node

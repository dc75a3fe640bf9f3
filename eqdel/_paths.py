"""Attribute paths through nested Equinox modules."""

import dataclasses
from collections.abc import Callable

import equinox as eqx


def get_path(tree, where: tuple[str, ...]):
    """Follow an attribute path."""
    for name in where:
        tree = getattr(tree, name)
    return tree


def module_paths(model: eqx.Module, match: Callable[[str, object], bool]):
    """Attribute paths of the sub-modules for which `match(field_name, module)` holds,
    searched depth-first through module fields (matches are not searched inside)."""
    found = []

    def visit(module, where):
        for f in dataclasses.fields(module):
            if f.metadata.get("static", False):
                continue
            value = getattr(module, f.name)
            if not isinstance(value, eqx.Module):
                continue
            if match(f.name, value):
                found.append((*where, f.name))
            else:
                visit(value, (*where, f.name))

    visit(model, ())
    return found

"""Attribute paths through nested Equinox modules."""

import dataclasses
from collections.abc import Callable

import equinox as eqx


def get_path(tree, where: tuple[str | int, ...]):
    """Follow a path of attribute names and tuple indices."""
    for step in where:
        tree = tree[step] if isinstance(step, int) else getattr(tree, step)
    return tree


def module_paths(model: eqx.Module, match: Callable[[str, object], bool]):
    """Paths of the sub-modules for which `match(field_name, module)` holds, searched
    depth-first through module fields and the tuples and lists they hold (a module in a
    tuple goes by its field's name and is reached by its index; matches are not searched
    inside)."""
    found = []

    def consider(name, value, where):
        if isinstance(value, tuple | list):
            for index, item in enumerate(value):
                consider(name, item, (*where, index))
        elif isinstance(value, eqx.Module):
            if match(name, value):
                found.append(where)
            else:
                visit(value, where)

    def visit(module, where):
        for f in dataclasses.fields(module):
            if not f.metadata.get("static", False):
                consider(f.name, getattr(module, f.name), (*where, f.name))

    visit(model, ())
    return found

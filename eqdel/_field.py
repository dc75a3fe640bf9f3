"""`eqdel.field`: declare the semantic axes of an array field."""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx

AXES_METADATA_KEY = "eqdel_axes"


def field(*, axes: Sequence | Callable[[Any], Sequence], **kwargs) -> Any:
    """An `equinox.field` whose array carries semantic axes.

    **Arguments:**

    - `axes`: one semantic axis (or parallelism token, or list of them) per dimension of
        the array, e.g. `(axes.EMBED, axes.HEAD)`; or a `DynamicShardingAxes` preset; or a
        function of the module returning them, for layers whose role decides their axes
        (a `Linear` used as `q_proj` or as `o_proj`).
    - `**kwargs`: passed on to `equinox.field` (`converter`, `default`, ...).

    **Returns:**

    A dataclass field. Arrays stacked along new leading dimensions (for scan over layers)
    gain `axes.LAYERS` for each extra dimension when they are placed.

    !!! example

        ```python
        class Scale(eqx.Module):
            weight: Float[Array, " embed"] = eqdel.field(axes=(axes.EMBED,))
        ```
    """
    metadata = dict(kwargs.pop("metadata", {}))
    metadata[AXES_METADATA_KEY] = axes
    return eqx.field(metadata=metadata, **kwargs)

"""A class subset of a labelled split, optionally with a few images per class (transfer experiments).

``data.classes=[5,6,7,8,9]`` keeps those classes, relabelled 0..4 in the order given;
``data.train_per_class=50`` keeps 50 training images of each (a seeded draw, the same for every
training seed). Validation and test keep all images of the kept classes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from vitpipe.errors import ConfigError


def check_classes(classes: Sequence[int] | None, per_class: int | None, num_source_classes: int | None) -> None:
    if classes is not None:
        ok = len(classes) > 0 and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in classes)
        if not ok or len(set(classes)) != len(classes):
            raise ConfigError(f"data.classes={list(classes)!r}: expected distinct class indices >= 0, or null for all")
        if num_source_classes is not None and max(classes) >= num_source_classes:
            raise ConfigError(f"data.classes={list(classes)!r}: this data set has classes 0..{num_source_classes - 1}")
    if per_class is not None and (not isinstance(per_class, int) or isinstance(per_class, bool) or per_class < 1):
        raise ConfigError(f"data.train_per_class={per_class!r}: expected an int >= 1, or null for all images")


def select(labels: Tensor, classes: Sequence[int] | None, per_class: int | None = None, seed: int = 0
           ) -> tuple[Tensor, Tensor]:
    """(indices into ``labels`` to keep (sorted), their new labels). ``classes`` None keeps every
    class with its label; ``per_class`` keeps that many of each class (fewer if it has fewer)."""
    labels = labels.to(torch.int64)
    if classes is None:
        keep, new = torch.arange(len(labels)), labels
    else:
        lookup = torch.full((int(labels.max()) + 1 if len(labels) else 1,), -1, dtype=torch.int64)
        known = torch.as_tensor([c for c in classes if c < len(lookup)], dtype=torch.int64)
        lookup[known] = torch.as_tensor([i for i, c in enumerate(classes) if c < len(lookup)], dtype=torch.int64)
        mapped = lookup[labels]
        keep = torch.nonzero(mapped >= 0).flatten()
        new = mapped[keep]
    if per_class is not None:
        order = torch.randperm(len(keep), generator=torch.Generator().manual_seed(seed))
        chosen = torch.cat([order[new[order] == c][:per_class] for c in new.unique()]) if len(keep) else order
        chosen = chosen.sort().values
        keep, new = keep[chosen], new[chosen]
    return keep, new

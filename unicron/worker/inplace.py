"""Restoring a ``unicron.State``'s ``extra`` into the objects the script holds (pure)."""

from __future__ import annotations

from typing import Any

import torch


def restore_into(live: Any, saved: Any) -> Any:
    """``saved`` put into ``live`` where it can be, in place: a dict's entries (a key no longer
    saved is removed), a list's elements (element by element where both have one, then the
    saved tail appended or the live tail dropped: a history the script appends to is usually
    shorter, often empty, when it restores), a tensor of the same shape and dtype copied into;
    anything else (a number, a string, a changed shape) is ``saved`` itself. Returns what now
    stands in ``live``'s place."""
    if isinstance(live, dict) and type(saved) is type(live) and live is not saved:
        for key in [k for k in live if k not in saved]:
            del live[key]
        for key, value in saved.items():
            live[key] = restore_into(live[key], value) if key in live else value
        return live
    if isinstance(live, list) and type(saved) is list and live is not saved:
        live[:] = [restore_into(a, b) for a, b in zip(live, saved, strict=False)] + saved[len(live):]
        return live
    if isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor) and live.shape == saved.shape \
            and live.dtype == saved.dtype and live.layout == saved.layout == torch.strided:
        with torch.no_grad():
            live.copy_(saved)
        return live
    return saved

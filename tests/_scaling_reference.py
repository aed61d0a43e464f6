"""GradScaler's scale rule written out, shared by the fp16 tests of the strategies that provide their own plugin."""

from __future__ import annotations


def reference_scales(init, steps, interval, overflow_steps=(), growth=2.0, backoff=0.5):
    """The scale after each 1-based step: back off on an overflow, grow after ``interval`` good steps in a row."""
    scale, tracker, scales = init, 0, []
    for t in range(1, steps + 1):
        if t in overflow_steps:
            scale, tracker = scale * backoff, 0
        else:
            tracker += 1
            if tracker == interval:
                scale, tracker = scale * growth, 0
        scales.append(scale)
    return scales

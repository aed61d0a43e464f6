"""Worker side of compressed pushes: one compressed tensor per present parameter slice, error feedback on the worker.

``ParameterServerStrategy(compression=TopK(0.01))`` pushes, to each server ``s`` and for the optimizer ``k`` that
stepped, every slice of ``k``'s parameters on ``s`` that has a gradient, each compressed on its own by the
compressor (:meth:`~lightning_pdist.core.compression.Compressor.compress_push`: ``x = g + e``, ``x̂ = C(x)``,
``e ← x − x̂``), concatenated in shard order and sent as ``PUSH_CODED`` (:mod:`.wire`). The server decodes each
slice knowing only its size from the shard layout (:func:`~lightning_pdist.core.push_codec.decode_push`) and runs
its rule on ``x̂`` exactly as on a plain push. Per slice, because a slice is a parameter (or the part of one a server
holds): top-k keeps ``k = ceil(ratio·d)`` entries of each, as the DDP hook does per parameter tensor.

The residual ``e`` of each slice is keyed ``"{optimizer}/{server}/{parameter name}"``: it lives in this worker's
:class:`~lightning_pdist.core.compression.CompressionState` (checkpointed in the worker's own rank file), never on a
server. A slice without a gradient this step sends nothing and keeps its residual for the next step that has one.

Never imports Lightning, nor the ``compression/`` family (the compressor arrives as a core ``Compressor``).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from lightning_pdist.core.compression import CompressionState, Compressor
from lightning_pdist.parameter_server.layout import OptimizerLayout

__all__ = ["PushCompressor"]


class PushCompressor:
    """One worker's compressed pushes: the compressor, its state, and the bytes of coded payloads it produced."""

    def __init__(self, compressor: Compressor, layout: OptimizerLayout, rank: int, world_size: int) -> None:
        self.compressor, self.layout = compressor, layout
        self.rank, self.world_size = rank, world_size
        self.state = compressor.new_state()
        self.payload_bytes = 0  # every coded payload this worker pushed (the frames' headers and metadata not included)

    def pack(self, server: int, optimizer: int, grads: Mapping[str, Tensor | None]) -> tuple[bytes, str]:
        """``(coded payload, present)`` of ``optimizer``'s slices on ``server`` (the plain push's ``present``)."""
        parts, present = [], []
        for name, start, stop in self.layout.slices(server, optimizer):
            grad = grads.get(name)
            present.append("0" if grad is None else "1")
            if grad is not None:
                g = grad.detach().reshape(-1)[start:stop]
                data, _ = self.compressor.compress_push(g, f"{optimizer}/{server}/{name}", self.state, self.rank,
                                                        self.world_size)  # fmt: skip
                parts.append(data)
        payload = b"".join(parts)
        self.payload_bytes += len(payload)
        return payload, "".join(present)

    def state_dict(self) -> dict:
        return {"state": self.state.state_dict(), "payload_bytes": self.payload_bytes}

    def load_state_dict(self, saved: dict) -> None:
        self.state = CompressionState()
        self.state.load_state_dict(saved["state"])
        self.payload_bytes = int(saved.get("payload_bytes", 0))

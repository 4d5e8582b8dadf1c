"""A vision engine's decoded images: each image of a prompt opened once, off the event loop.

A continuation turn sends its whole context's images again (vLLM expands every placeholder of the
prompt), so the engine would otherwise decode every image of a conversation on every turn, on the
event loop that streams every session's tokens. Decoded images are kept by digest, least recently
used first out, bounded by their RGB bytes; decoding runs in a thread, one request's images at a
time (so what is decoded but not yet kept is one request's worth at most).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any, Optional, Sequence

from cluster.core.render.images import digest, open_rgb


class DecodedImages:
    def __init__(self, max_pixels: Optional[int], max_bytes: int = 256 << 20) -> None:
        self.max_pixels = max_pixels  # the connection checked it; this is the engine's own bound
        self.max_bytes = max_bytes
        self._known: OrderedDict[bytes, Any] = OrderedDict()
        self._bytes = 0
        self._decoding = asyncio.Lock()
        self.decoded = 0  # images decoded (the rest were found kept)

    @property
    def kept_bytes(self) -> int:
        return self._bytes

    async def rgb(self, images: Sequence[bytes]) -> list[Any]:
        """The images as RGB PIL images, in order (ValueError on one the engine will not open)."""
        keys = [digest(data) for data in images]
        if any(key not in self._known for key in keys):
            async with self._decoding:
                missing = {key: data for key, data in zip(keys, images) if key not in self._known}
                # Taken before the new images are kept: keeping them may evict one this request needs.
                found = {key: self._known[key] for key in keys if key in self._known}
                opened = await asyncio.to_thread(lambda: {key: open_rgb(data, self.max_pixels)
                                                          for key, data in missing.items()})
                for key, img in opened.items():
                    self._keep(key, img)
                self.decoded += len(opened)
                out = [opened[key] if key in opened else found[key] for key in keys]
        else:
            out = [self._known[key] for key in keys]
        for key in keys:
            if key in self._known:
                self._known.move_to_end(key)
        return out

    def _keep(self, key: bytes, img: Any) -> None:
        size = img.size[0] * img.size[1] * 3
        if size > self.max_bytes:
            return  # used for this request only
        self._known[key] = img
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, old = self._known.popitem(last=False)
            self._bytes -= old.size[0] * old.size[1] * 3

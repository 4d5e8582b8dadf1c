"""A vision engine decodes each image once, off its event loop, within a byte bound, and only as a
served format within the pixel bound (the connection checked both; this is the engine's copy)."""

import io

import pytest

from cluster.core.render.images import ImageRefused
from cluster.engines.image_inputs import DecodedImages


def png(width: int, height: int, mode: str = "RGB") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (width, height)).save(buf, format="PNG")
    return buf.getvalue()


async def test_a_continuation_s_images_are_decoded_once():
    images = DecodedImages(max_pixels=4096 * 4096)
    a, b = png(10, 10), png(11, 10)
    first = await images.rgb([a])
    second = await images.rgb([a, b])  # the next turn sends the whole context's images again
    assert images.decoded == 2
    assert second[0] is first[0] and [img.mode for img in second] == ["RGB", "RGB"]
    assert [img.size for img in second] == [(10, 10), (11, 10)]


async def test_kept_images_are_bounded_by_their_rgb_bytes():
    images = DecodedImages(max_pixels=4096 * 4096, max_bytes=3 * 100 * 100 * 2)  # two 100x100 images
    files = [png(100, 100 + i) for i in range(4)]
    for f in files:
        await images.rgb([f])
    assert images.kept_bytes <= images.max_bytes
    await images.rgb([files[0]])  # the oldest was let go: decoded again
    assert images.decoded == 5


async def test_a_request_never_evicts_an_image_it_needs():
    """The kept image a request reuses is not lost to the new image it brings."""
    images = DecodedImages(max_pixels=4096 * 4096, max_bytes=3 * 100 * 100 * 2)  # two 100x100 images
    a, b, c = png(100, 100), png(100, 99), png(99, 100)
    kept_a = (await images.rgb([a]))[0]
    await images.rgb([b])  # kept: a (oldest), b
    out = await images.rgb([a, c])  # keeping c evicts a, which this very request needs
    assert out[0] is kept_a and [img.size for img in out] == [(100, 100), (99, 100)]
    assert images.kept_bytes <= images.max_bytes


async def test_the_engine_refuses_an_image_past_its_pixel_bound_or_of_another_format():
    images = DecodedImages(max_pixels=1000 * 1000)
    with pytest.raises(ImageRefused):
        await images.rgb([png(2000, 2000, "1")])
    with pytest.raises(ImageRefused):
        await images.rgb([b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"])
    assert images.kept_bytes == 0

"""Images in a context, for vision models: which parts are images, in render order; what their
data URLs hold; and how many prompt tokens each becomes.

The chat template sees each image as the model's placeholder text (`<image>` for Idefics3 and
Llava), which the tokenizer turns into one placeholder token. The prompt loopserve renders, caches
and sends keeps one placeholder token per image, and the images travel beside it: vLLM runs the
model's processor on them and expands each placeholder into the image's tokens (it always does so
for token prompts), so a continuation's tail and the cached prefix stay valid token for token.
How many tokens an image becomes is the model's processor's answer (Idefics3: its tiles, so its
size); the renderer asks it for every image it renders and reports the extra tokens, which the
context limit and the KV budget count: what they see is the engine's prompt length.

Pure functions and one small cache: no I/O, no model; the processor is injected.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

from cluster.core.render.chat_messages import content_parts
from cluster.protocol.errors import ApiError

# What an image may arrive as: a data URL of one of these types, opened by Pillow as that format
# only (Pillow guesses a file's format from its bytes otherwise, and some of its plugins call out:
# EPS runs Ghostscript).
IMAGE_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
DEFAULT_MAX_PIXELS = 4096 * 4096


@dataclass(frozen=True)
class ImageLimits:
    """What one context may hold (vLLM's `limit_mm_per_prompt` counts a prompt's whole history)."""

    max_per_context: int
    max_image_bytes: int
    max_image_pixels: int = DEFAULT_MAX_PIXELS

    def check_count(self, n: int) -> None:
        if n > self.max_per_context:
            raise ApiError(400, f"The conversation would hold {n} images; this model takes at most "
                                f"{self.max_per_context} per conversation. Start a new conversation or compact it.",
                           param="input", code="too_many_images")


def image_parts(items: Sequence[dict[str, Any]]) -> Iterator[tuple[int, str, int, dict[str, Any]]]:
    """The `input_image` parts of `content_parts`."""
    return (found for found in content_parts(items) if found[3].get("type") == "input_image")


def decode_image(part: dict[str, Any], param: str, max_bytes: int, max_pixels: Optional[int] = None) -> bytes:
    """The image bytes of a data-URL `input_image` part, or the API's 400 naming the part. With
    `max_pixels`, the file's header is read too (nothing is decoded): it must be the declared
    format and hold at most `max_pixels` (a 21 KB PNG can hold 169 MP: 507 MB once decoded)."""
    url = part.get("image_url")
    if part.get("file_id") and not url:
        raise ApiError(400, "Images by 'file_id' need the Files API, which this server does not keep; send the image "
                            "as a data URL (data:image/png;base64,...).", param=f"{param}.file_id",
                       code="unsupported_value")
    if not isinstance(url, str) or not url:
        raise ApiError(400, "An input_image part needs 'image_url' (a data URL).", param=f"{param}.image_url",
                       code="missing_required_parameter")
    if not url.startswith("data:"):
        raise ApiError(400, "Image URLs are not fetched by this server; send the image as a data URL "
                            "(data:image/png;base64,...).", param=f"{param}.image_url", code="unsupported_value")
    head, _, payload = url.partition(",")
    mime = head[5:].split(";")[0].lower()
    if mime not in IMAGE_TYPES or not head.endswith(";base64"):
        raise ApiError(400, f"Unsupported image data URL '{head[:64]}': send base64 {', '.join(IMAGE_TYPES)}.",
                       param=f"{param}.image_url", code="invalid_image_format")
    if len(payload) * 3 // 4 > max_bytes:
        raise ApiError(400, f"The image is larger than {max_bytes} bytes.", param=f"{param}.image_url",
                       code="image_too_large")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "The image data URL is not valid base64.", param=f"{param}.image_url",
                       code="invalid_image_format") from None
    if max_pixels is not None:
        try:
            width, height = image_size(data, IMAGE_TYPES[mime])
        except ImageTooLarge:
            raise ApiError(400, f"The image has more than {max_pixels} pixels; scale it down.",
                           param=f"{param}.image_url", code="image_too_large") from None
        except ImageRefused as exc:
            raise ApiError(400, f"The image is not a readable {mime} file ({exc}).", param=f"{param}.image_url",
                           code="invalid_image_format") from None
        if width * height > max_pixels:
            raise ApiError(400, f"The image is {width}x{height} pixels; this server takes at most {max_pixels} "
                                "pixels an image. Scale it down.", param=f"{param}.image_url", code="image_too_large")
    return data


class ImageRefused(ValueError):
    """A file Pillow will not open as the format it was declared as (or any served format)."""


class ImageTooLarge(ImageRefused):
    """A header declaring more pixels than Pillow itself will open."""


def image_size(data: bytes, fmt: Optional[str] = None) -> tuple[int, int]:
    """Width and height from the file's header (Pillow opens lazily: no pixel is decoded)."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            # The size is checked by the caller, from the header: Pillow's own bomb warning is moot here
            # (nothing is decoded), and its error (past 2x its limit) is a size too.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=[fmt] if fmt else list(IMAGE_TYPES.values())) as img:
                return img.size
    except Image.DecompressionBombError:
        raise ImageTooLarge() from None  # past twice Pillow's limit: past any bound a caller sets
    except Exception as exc:  # noqa: BLE001 - whatever a plugin raises on a malformed header
        raise ImageRefused(type(exc).__name__) from None


def open_rgb(data: bytes, max_pixels: Optional[int]):
    """The image decoded to RGB, opened as a served format only and refused past `max_pixels`
    before anything is decoded (the engine's copy of the connection's check)."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=list(IMAGE_TYPES.values())) as img:
                if max_pixels is not None and img.size[0] * img.size[1] > max_pixels:
                    raise ImageRefused(f"{img.size[0]}x{img.size[1]} pixels is above {max_pixels}")
                return img.convert("RGB")
    except ImageRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a plugin raises on a malformed file
        raise ImageRefused(type(exc).__name__) from None


def context_images(items: Sequence[dict[str, Any]], max_bytes: int, prefix: str = "input",
                   memo: Optional[dict[int, bytes]] = None, max_pixels: Optional[int] = None) -> list[bytes]:
    """Every image of `items` decoded, in render order (400 on the first bad one). `memo` (by the
    part's identity, for parts alive while it is) decodes a part seen before only once."""
    if memo is None:
        return [decode_image(part, f"{prefix}[{i}].{field}[{j}]", max_bytes, max_pixels)
                for i, field, j, part in image_parts(items)]
    out = []
    for i, field, j, part in image_parts(items):
        data = memo.get(id(part))
        if data is None:
            data = memo[id(part)] = decode_image(part, f"{prefix}[{i}].{field}[{j}]", max_bytes, max_pixels)
        out.append(data)
    return out


def digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:16]


class ImageTokens:
    """How many prompt tokens each image becomes, by the model's processor (remembered per image:
    a full render of a long history asks again for every image it holds)."""

    def __init__(self, placeholder: str, placeholder_id: int, count: Callable[[bytes], int],
                 max_entries: int = 4096) -> None:
        self.placeholder = placeholder  # the text the chat template sees for an image
        self.placeholder_id = placeholder_id  # its token id, repeated `count` times in a prompt
        self._count = count
        self._known: OrderedDict[bytes, int] = OrderedDict()
        self.max_entries = max_entries

    def tokens_for(self, image: bytes) -> int:
        key = digest(image)
        n = self._known.get(key)
        if n is None:
            try:
                n = int(self._count(image))
            except Exception as exc:  # noqa: BLE001 - a file Pillow cannot read
                raise ApiError(400, f"The image could not be read ({type(exc).__name__}).", param="input",
                               code="invalid_image_format") from None
            self._known[key] = n
            if len(self._known) > self.max_entries:
                self._known.popitem(last=False)
        else:
            self._known.move_to_end(key)
        return n

    def extra_tokens(self, token_ids: array, images: Sequence[bytes]) -> int:
        """How many tokens the engine adds to `token_ids` by expanding its image placeholders (each
        placeholder token becomes `tokens_for(image)` tokens). The placeholders must be exactly the
        images: a placeholder typed as text would make the model read the wrong image, or none."""
        found = token_ids.count(self.placeholder_id)
        if found != len(images):
            raise ApiError(400, f"The input holds {found} image placeholder(s) '{self.placeholder}' for "
                                f"{len(images)} image(s); do not write the placeholder as text.", param="input",
                           code="invalid_value")
        return sum(self.tokens_for(image) - 1 for image in images)


def processor_image_tokens(processor: Any, placeholder_id: int) -> Callable[[bytes], int]:
    """An image's token count as the model's own HF processor expands it (the count vLLM checks):
    all the tokens its placeholder becomes (Idefics3: tiles, their row/column markers and the
    global view), less what the tokenizer adds around any text (a BOS)."""
    placeholder = getattr(processor, "image_token", None) or processor.tokenizer.convert_ids_to_tokens(placeholder_id)
    added = len(processor.tokenizer(placeholder)["input_ids"]) - 1

    def count(image: bytes) -> int:
        # Checked on the connection replica (format, pixels) before any render is asked for.
        out = processor(text=placeholder, images=[open_rgb(image, None)])
        return len(out["input_ids"][0]) - added

    return count


def placeholder_of(processor: Any, override: Optional[str] = None) -> Optional[str]:
    return override or getattr(processor, "image_token", None)


def load_processor(model_path: str, model_name: str, override: Optional[str] = None) -> tuple[Any, str, int]:
    """A vision model's HF processor, its image placeholder token and that token's id (the
    renderer writes the placeholder; the engine must never generate it)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_path)
    placeholder = placeholder_of(processor, override)
    if not placeholder:
        raise ValueError(f"model {model_name!r}: its processor names no image token; set model.images.placeholder")
    return processor, placeholder, processor.tokenizer.convert_tokens_to_ids(placeholder)

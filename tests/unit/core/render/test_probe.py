"""The start-up render probe on real chat templates that are on this machine, and
token-exact continuations.

Templates: the served ChatML+Hermes template (tiny model, SmolLM2), SmolLM2's own
template (inside its GGUF), vLLM's shipped ChatML / basic / MiniCPM-V 4.5 (a Qwen3-style
template that drops reasoning from earlier turns), Llama 4's (tools inside the first user
message; shipped in transformers), Mistral's request encoding in mistral_common (v1, v3,
v7, tekken) through vLLM's MistralTokenizer, and a template written here that puts the
tools before the last user message as Mistral v3 does.
"""

from __future__ import annotations

import pathlib
import re
import shutil

import pytest
from transformers import AutoTokenizer

from cluster.core.render.chat_messages import item_roles
from cluster.core.render.probe import SCENARIOS, TOOLS, _check, _State, format_step
from cluster.core.render.tokenizer import renderer_for
from cluster.core.turn.cache import SessionCache
from cluster.core.turn.context import normalize_tools
from cluster.core.turn.turn import TurnRequest, TurnScope
from cluster.protocol.requests import parse_request
from tests.support.harness import InProcessStack

# Mistral v3 style, as Jinja: the tools block goes right before the *last* user message.
TOOLS_BEFORE_LAST_USER = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if loop.index0 == ns.last_user and tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{%- endif %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def tokenizer_with(tiny_model_dir, template: str, specials=(), eos=None):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    if eos:
        tok.eos_token = eos
    tok.chat_template = template
    return tok


def drive(renderer, turns, instructions=None, tools=None):
    """A conversation through the renderer as the turn driver runs it (delta when the renderer
    takes it, else full); returns [(assembled prompt, full render's prompt)] per turn."""
    items, st, out = [], None, []
    for new, output in turns:
        ctx = items + new
        try:
            want = renderer.full(ctx, instructions, tools).assemble(None)[1]
        except Exception:  # noqa: BLE001 - the template refuses this conversation (so would the server)
            return out
        res = None
        if st is not None:
            res = renderer.delta(ctx[st.anchor_start: st.item_count], ctx[st.item_count:], st.anchor_start,
                                 instructions, tools, history_roles=item_roles(ctx[: st.item_count]))
        prefix, prompt = res.assemble(st.prefix) if res is not None else renderer.full(
            ctx, instructions, tools).assemble(None)
        out.append((prompt, want))
        st = _State(ctx, prefix, len(ctx), (res or renderer.full(ctx, instructions, tools)).anchor_start,
                    prompt[len(prefix):], True)
        items = ctx + output
    return out


def all_exact(renderer):
    for turns in SCENARIOS.values():
        for instructions in (None, "Be brief."):
            for tools in (TOOLS, None):
                for got, want in drive(renderer, turns, instructions, tools):
                    assert got == want


def test_the_served_template_is_proven_exact_everywhere(tiny_model_dir):
    r = renderer_for(AutoTokenizer.from_pretrained(tiny_model_dir))
    report = r.probe_report
    assert not report.wrong
    for step in ("tool -> assistant+calls [tools, reusing output]", "assistant+calls -> tool [tools]",
                 "tool -> user [tools]", "assistant -> user [system, tools]"):
        assert step in report.summary()["proven"]
    all_exact(r)


def test_smollm2s_own_template_from_its_gguf():
    from cluster.models.builtin import smollm2_gguf

    gguf = smollm2_gguf()
    r = renderer_for(AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name))
    assert not r.probe_report.wrong and len(r.probe_report.proven) > 40
    all_exact(r)


def test_tools_before_the_last_user_message_fall_back(tiny_model_dir):
    tok = tokenizer_with(tiny_model_dir, TOOLS_BEFORE_LAST_USER)
    tools = normalize_tools([{"type": "function", "name": "f", "parameters": {"type": "object"}}])
    turns = [([{"type": "message", "role": "user", "content": "hi"}],
              [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]),
             ([{"type": "function_call_output", "call_id": "c1", "output": "ok"}],
              [{"type": "message", "role": "assistant", "content": "done"}]),
             ([{"type": "message", "role": "user", "content": "more"}], [])]
    # Without the probe the local checks accept the delta (the window, from the tool result on,
    # has no user message before the new one) and the tools block appears twice.
    unprobed = renderer_for(tok, probe=False)
    *_, (got, want) = drive(unprobed, turns, tools=tools)
    assert got != want
    assert unprobed.decode(got).count("<|im_start|>tools") == 2
    probed = renderer_for(tok)
    assert "tool -> assistant [tools]" in probed.probe_report.summary()["falls_back"] or \
        "assistant -> user [tools]" in probed.probe_report.summary()["falls_back"]
    assert "assistant+calls -> tool [tools]" in probed.probe_report.summary()["proven"]
    assert all(got == want for got, want in drive(probed, turns, tools=tools))
    all_exact(probed)


def test_vllms_shipped_templates(tiny_model_dir):
    import vllm

    folder = pathlib.Path(vllm.__file__).parent / "transformers_utils" / "chat_templates"
    chatml = renderer_for(tokenizer_with(tiny_model_dir, (folder / "template_chatml.jinja").read_text()))
    assert not chatml.probe_report.wrong
    all_exact(chatml)
    # No special tokens between messages: a cut could merge tokens, so only a call's output after the call
    # (cut at the call's closing tag) is proven; every delta's cut is checked as it runs, and the conversations
    # stay exact.
    basic = renderer_for(tokenizer_with(tiny_model_dir, (folder / "template_basic.jinja").read_text()))
    assert {step[3:] for step in basic.probe_report.proven} <= {("assistant+calls", "tool")}
    all_exact(basic)
    # Qwen3-style: reasoning of earlier turns is dropped once a new user message arrives. The analysis
    # anchors windows at the last user message and renders a new one in full; the tool loop is proven.
    qwen3_like = renderer_for(tokenizer_with(tiny_model_dir, (folder / "template_minicpmv45.jinja").read_text()))
    assert (qwen3_like.hazards.anchor_role, qwen3_like.hazards.refused_adds) == ("user", {"user"})
    proven = qwen3_like.probe_report.summary()["proven"]
    assert {"user -> assistant+calls+think", "assistant+calls+think -> tool"} <= set(proven)
    all_exact(qwen3_like)


def test_llama4_tools_inside_the_first_user_message(tiny_model_dir):
    import transformers.models.llama4.processing_llama4 as llama4

    template = eval(re.search(r'chat_template = (".*?")\n', pathlib.Path(llama4.__file__).read_text()).group(1))
    tok = tokenizer_with(tiny_model_dir, template, ["<|header_start|>", "<|header_end|>", "<|eot|>",
                                                     "<|python_start|>", "<|python_end|>"], eos="<|eot|>")
    r = renderer_for(tok)
    assert "Environment: ipython" in r.decode(r.full(SCENARIOS["tool_loop"][0][0], "s", TOOLS).assemble(None)[1])
    assert "assistant+calls -> tool [system, tools]" in r.probe_report.summary()["proven"]
    all_exact(r)


@pytest.mark.parametrize("name,file", [("tokenizer.model.v1", "tokenizer.model.v1"),
                                       ("tokenizer.model.v3", "mistral_instruct_tokenizer_240323.model.v3"),
                                       ("tokenizer.model.v7", "mistral_instruct_tokenizer_241114.model.v7"),
                                       ("tekken.json", "tekken_240911.json")])
def test_mistral_common_encodings(tmp_path, name, file):
    import mistral_common
    from vllm.tokenizers.mistral import MistralTokenizer

    shutil.copy(pathlib.Path(mistral_common.__file__).parent / "data" / file, tmp_path / name)
    r = renderer_for(MistralTokenizer.from_pretrained(str(tmp_path)))
    assert r.hazards is None  # an encoder, not a Jinja template: the probe alone decides
    summary = r.probe_report.summary()
    if name == "tokenizer.model.v1":  # v1 has no tools at all
        assert not [s for s in summary["proven"] if "tool ->" in s or "-> tool" in s]
    else:
        # A window that starts with a tool result is not a conversation mistral_common accepts.
        assert summary["falls_back"]["tool -> assistant"] in ("window_render_failed",
                                                              "template_refuses_it (InvalidMessageStructureException)")
        # v3/v7/tekken move the tools (v3: and the system prompt) to the last user message.
        assert "assistant -> user [system, tools]" in summary["falls_back"]
    assert summary["proven"]
    for turns in SCENARIOS.values():
        for tools in (TOOLS, None) if name != "tokenizer.model.v1" else (None,):
            try:
                pairs = drive(r, turns, "Be brief.", tools)
            except Exception:  # noqa: BLE001 - mistral_common refuses this conversation shape outright
                continue
            assert all(got == want for got, want in pairs)


def test_a_probe_check_catches_a_wrong_delta(tiny_model_dir):
    """The check the probe is made of: a delta that differs from the full render is recorded wrong."""
    from cluster.core.render.probe import ProbeReport

    r = renderer_for(tokenizer_with(tiny_model_dir, TOOLS_BEFORE_LAST_USER), probe=False)
    items = [{"type": "message", "role": "user", "content": "hi"},
             {"type": "message", "role": "assistant", "content": "hello"}]
    prefix = r.full(items[:1], None, TOOLS).assemble(None)[0]
    report = ProbeReport()
    _check(report, r, _State(items[:1], prefix, 1, 0, r.full(items[:1], None, TOOLS).generation, True),
           items + [{"type": "message", "role": "user", "content": "more"}], None, TOOLS, None)
    assert {format_step(s) for s in report.inexact[0][0]} == {"user -> assistant [tools]", "assistant -> user [tools]"}


TOOL = [{"type": "function", "name": "read_file", "description": "Read a file",
         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


async def test_continuations_reuse_the_generated_tokens(tokenizer):
    """The next prompt holds the engine's own output tokens, so the prefix cache covers the
    previous prompt and output (the scripted engine's cache is token-exact like vLLM's)."""
    stack = InProcessStack(tokenizer, verify=True)
    cache = SessionCache()
    resp = None
    prompts = []
    for n in range(6):
        if resp is None:
            body = {"input": "read the readme", "tools": TOOL}
        elif resp["output"][0]["type"] == "function_call":  # the scripted engine calls after a user message
            body = {"previous_response_id": resp["id"], "tools": TOOL, "input": [
                {"type": "function_call_output", "call_id": resp["output"][0]["call_id"], "output": f"line {n}\n" * 50}]}
        else:  # ... and answers after a tool result
            body = {"previous_response_id": resp["id"], "tools": TOOL, "input": f"now step {n}"}
        evs = [ev async for ev in stack.driver.run(TurnRequest(parse_request(body), TurnScope(cache, session_key="s1")))]
        resp = evs[-1]["response"]
        prompts.append((resp["usage"]["input_tokens"], resp["usage"]["input_tokens_details"]["cached_tokens"],
                        resp["usage"]["output_tokens"]))
    assert stack.mismatches == 0
    assert stack.renderer.reused_outputs == 5
    assert all(job.prior is not None for job in stack.render_jobs[1:])
    for (p0, _, o0), (_, cached, _) in zip(prompts, prompts[1:]):
        assert cached >= p0 + o0 - 1  # all but the last generated token, which was never computed


def shortens_old_tool_outputs(limit: int) -> str:
    """A template that renders an earlier tool output as `[cut]` once it is longer than `limit`
    characters and a newer tool output exists: content-dependent, as the probe's short texts
    never show."""
    return (
        "{%- set ns = namespace(last_tool=-1) %}"
        "{%- for m in messages %}{%- if m.role == 'tool' %}{%- set ns.last_tool = loop.index0 %}{%- endif %}"
        "{%- endfor %}"
        "{%- for m in messages %}"
        "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
        "{%- for tc in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
        "{{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
        "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
        "{%- if m.content | length > " + str(limit) + " and loop.index0 < ns.last_tool %}[cut]"
        "{%- else %}{{ m.content }}{%- endif %}\n</tool_response><|im_end|>\n"
        "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    )


@pytest.mark.parametrize("limit", [200, 2000])  # 2,000: past every text but the reasoning tool loop's outputs
def test_the_probe_sees_a_template_that_shortens_long_old_tool_outputs(tiny_model_dir, limit):
    r = renderer_for(tokenizer_with(tiny_model_dir, shortens_old_tool_outputs(limit)), analysis=False)
    falls_back = r.probe_report.summary()["falls_back"]
    assert any(step.startswith("tool") for step in falls_back), falls_back
    all_exact(r)  # the long-contents conversation included: every continuation equals a full render


TOOL = [{"type": "function", "name": "read_file",
         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


async def test_a_sampled_full_render_catches_what_the_probe_cannot(tiny_model_dir):
    from cluster.core.render.audit import RenderAudit
    from cluster.core.turn.post_work import PostWorkQueue

    # Past 5,000 characters: longer than anything in the probe's battery, so the probe proves it;
    # reading the template would refuse it (test_template_analysis.py): off, as for a template
    # whose dependence the AST cannot show.
    tok = tokenizer_with(tiny_model_dir, shortens_old_tool_outputs(5000))
    queue = PostWorkQueue(retries=0)
    stack = InProcessStack(tok, verify=False, post_work=queue, analysis=False)
    assert not stack.renderer.probe_report.wrong
    preparer = stack.driver.preparer
    audit = RenderAudit(stack.render, 1, decode=stack.renderer.decode, on_mismatch=preparer.render_fully)
    queue.add("render_audit", audit)
    cache, prev = SessionCache(), None

    async def turn(new):
        nonlocal prev
        req = parse_request({"input": new, "tools": TOOL, "previous_response_id": prev})
        final = [ev async for ev in stack.driver.run(TurnRequest(req, TurnScope(cache, session_key="s")))][-1]["response"]
        prev = final["id"]
        await queue.drain()
        return final

    def tool_output(resp, text):
        [call] = [o for o in resp["output"] if o["type"] == "function_call"]
        return [{"type": "function_call_output", "call_id": call["call_id"], "output": text}]

    first = await turn("Read the big file.")
    await turn(tool_output(first, "A" * 6000))
    assert audit.checked == 1 and audit.mismatches == 0  # one long output alone: rendered in full, exact
    second = await turn("And the other one.")
    await turn(tool_output(second, "B" * 100))
    # The template now cuts the first output; the delta sent it whole: caught, and the replica
    # renders every turn in full from here on.
    assert audit.mismatches == 1 and preparer.deltas_off is not None
    third = await turn("Thanks, now a third.")
    prompt = stack.decode_raw(stack.engine_requests[-1].prompt_token_ids)
    assert "[cut]" in prompt and "A" * 6000 not in prompt
    await turn(tool_output(third, "C"))
    assert audit.mismatches == 1 and stack.driver.metrics.timings[-1].full_render


async def test_the_sampled_check_agrees_with_exact_deltas_when_tools_are_rendered(tokenizer):
    """The tiny model's template renders the tools with `tojson` (key order kept). The audit re-renders
    from the turn's render key: it once held the tools with sorted keys, so every sampled check on a
    turn with tools was a mismatch and the replica rendered every turn in full from then on."""
    from cluster.core.render.audit import RenderAudit
    from cluster.core.turn.post_work import PostWorkQueue

    queue = PostWorkQueue(retries=0)
    stack = InProcessStack(tokenizer, verify=True, post_work=queue)
    audit = RenderAudit(stack.render, 1, decode=stack.renderer.decode, on_mismatch=stack.driver.preparer.render_fully)
    queue.add("render_audit", audit)
    tools = [{"type": "function", "name": "read_file", "description": "Read a file",  # keys not sorted
              "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
    cache, prev, new = SessionCache(), None, "Read the readme."
    for i in range(4):
        req = parse_request({"input": new, "tools": tools, "previous_response_id": prev})
        resp = [ev async for ev in stack.driver.run(TurnRequest(req, TurnScope(cache, session_key="s")))][-1]["response"]
        await queue.drain()
        prev, new = resp["id"], [{"type": "function_call_output", "call_id": o["call_id"], "output": f"file {i}"}
                                 for o in resp["output"] if o["type"] == "function_call"]
        new.append({"type": "message", "role": "user", "content": f"step {i}"})
    assert "read_file" in stack.decode_raw(stack.engine_requests[-1].prompt_token_ids)  # tools are rendered
    assert audit.checked == 3 and audit.mismatches == 0 and stack.mismatches == 0
    assert stack.driver.preparer.deltas_off is None

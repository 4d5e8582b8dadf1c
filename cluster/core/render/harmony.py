"""gpt-oss's prompts, rendered in harmony (openai-harmony), as vLLM's server renders them.

Chat messages (`chat_messages.py`) become harmony messages the way vLLM's harmony path makes
them (`vllm/entrypoints/openai/parser/harmony_utils.py`: a leading system message becomes the
developer message's instructions, tools its `functions` namespace, an assistant's reasoning an
`analysis` message, a tool call a `commentary` message to `functions.<name>`, a plain answer a
`final` message, a tool output a message from `functions.<name>`), with the system message's
reasoning effort and conversation start date. The conversation is then rendered to token ids by
openai-harmony, with harmony's rule for reasoning applied over the whole conversation: every
`analysis` message before the last `final` answer is dropped.

That rule is the one thing a delta render cannot see from its window: a new final answer drops
reasoning from turns before it. So a delta whose new messages hold a final answer renders in full
(`drops_reasoning`); a tool loop's turns (reasoning, calls, tool outputs) only append, and stay
deltas. tests/unit/core/render/test_harmony.py checks every render against vLLM's own.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any, Optional, Sequence

from cluster.core.render.renderer import IncrementalRenderer
from cluster.protocol.errors import ApiError

Message = dict[str, Any]
EFFORTS = ("low", "medium", "high")
# The conversation start date the system message carries, fixed per process: a session's prompts
# stay one prefix whatever the clock says (vLLM pins it with VLLM_SYSTEM_START_DATE).
START_DATE = datetime.date.today().isoformat()


def harmony_renderer(tokenizer, model=None) -> IncrementalRenderer:
    from cluster.models.o200k import harmony_encoding

    enc = harmony_encoding(model.resolved_path() if model is not None else getattr(tokenizer, "name_or_path", None))
    end_of_answer = enc.encode("<|return|>", allowed_special="all")[0]

    def apply(messages: list[Message], tools, add_generation_prompt: bool, reasoning_effort: Optional[str] = None):
        return render(enc, messages, tools, add_generation_prompt, reasoning_effort)

    def encode(text: str) -> list[int]:
        return enc.encode(text, disallowed_special=())  # client text never becomes a special token

    renderer = IncrementalRenderer(apply, encode, [], decode=enc.decode, eos=end_of_answer)
    renderer.effort_kwargs = effort_kwargs
    renderer.delta_rule = drops_reasoning
    renderer.raw_arguments = True  # a call's arguments are rendered as the model wrote them
    renderer.window_start = calls_answered
    renderer.max_token_chars = 128  # o200k's longest rank is well under this many characters
    return renderer


def effort_kwargs(effort: Optional[str]) -> dict[str, Any]:
    if effort is None or effort == "none":
        return {}
    if effort == "minimal":
        effort = "low"
    if effort not in EFFORTS:
        raise ApiError(400, f"reasoning.effort {effort!r} is not supported by this model; one of {list(EFFORTS)}.",
                       param="reasoning.effort", code="unsupported_parameter")
    return {"reasoning_effort": effort}


def drops_reasoning(added: Sequence[Message]) -> Optional[str]:
    """Why a delta adding `added` must render in full: a final answer drops earlier reasoning."""
    return "final_answer_drops_reasoning" if any(_is_final(m) for m in added) else None


def calls_answered(messages: Sequence[Message]) -> int:
    """A window starts at the calls the trailing tool outputs answer: a tool output is rendered as
    from `functions.<name>`, and only its call knows the name."""
    i = len(messages) - 1
    while i > 0 and messages[i].get("role") == "tool":
        i -= 1
    return i if i < len(messages) - 1 and messages[i].get("tool_calls") else len(messages) - 1


def _is_final(message: Message) -> bool:
    return message.get("role") == "assistant" and not message.get("tool_calls") and bool(message.get("content"))


def render(enc, messages: list[Message], tools: Optional[list[dict[str, Any]]], add_generation_prompt: bool,
           reasoning_effort: Optional[str] = None) -> list[int]:
    from openai_harmony import Conversation, RenderConversationConfig, Role

    msgs = list(messages)
    instructions = None
    if msgs and msgs[0].get("role") in ("system", "developer"):
        instructions = msgs.pop(0).get("content") or None
    harmony = preamble(instructions, tools, reasoning_effort) + to_harmony(msgs)
    harmony = drop_reasoning_before_final(harmony)
    conversation = Conversation.from_messages(harmony)
    config = RenderConversationConfig(auto_drop_analysis=False)
    if add_generation_prompt:
        return legacy_call_headers(enc, enc.render_conversation_for_completion(conversation, Role.ASSISTANT,
                                                                               config=config))
    return legacy_call_headers(enc, enc.render_conversation(conversation, config=config))


@functools.lru_cache(maxsize=4)
def special_ids(enc) -> tuple[int, int, int, int]:
    """`<|start|>`, `<|channel|>`, `<|constrain|>`, `<|message|>` (openai-harmony's `encode` builds a
    regex of its 1,091 special tokens on every call that allows them: looked up once)."""
    return tuple(enc.encode(t, allowed_special="all")[0] for t in ("<|start|>", "<|channel|>", "<|constrain|>",
                                                                    "<|message|>"))


def legacy_call_headers(enc, ids: list[int]) -> list[int]:
    """Earlier tool calls' headers as gpt-oss was trained on them, as vLLM renders them:
    `<|start|>assistant to=functions.x<|channel|>commentary json<|message|>`, not openai-harmony's
    newer `<|start|>assistant<|channel|>commentary to=functions.x <|constrain|>json<|message|>`
    (the model can echo the newer one back malformed)."""
    start, channel, constrain, message = special_ids(enc)
    if constrain not in ids:  # no earlier tool call: nothing to rewrite
        return ids
    out: list[int] = []
    i = 0
    while i < len(ids):
        if ids[i] == start and message in ids[i + 1:]:
            end = ids.index(message, i + 1)
            header = ids[i + 1:end]
            if channel in header and constrain in header[header.index(channel):]:
                c, k = header.index(channel), header.index(constrain, header.index(channel))
                author, middle, kind = enc.decode(header[:c]), enc.decode(header[c + 1:k]), enc.decode(header[k + 1:])
                if author == "assistant" and " to=" in middle and middle.endswith(" ") and kind:
                    name, recipient = middle[:-1].split(" to=", 1)
                    if name and recipient:
                        out += [start, *enc.encode(f"assistant to={recipient}", disallowed_special=()), channel,
                                *enc.encode(f"{name} {kind}", disallowed_special=()), message]
                        i = end + 1
                        continue
        out.append(ids[i])
        i += 1
    return out


def preamble(instructions: Optional[str], tools: Optional[list[dict[str, Any]]], effort: Optional[str]) -> list:
    from openai_harmony import (DeveloperContent, Message as HMessage, ReasoningEffort, Role, SystemContent,
                                ToolDescription)

    system = SystemContent.new().with_conversation_start_date(START_DATE)
    if effort is not None:
        system = system.with_reasoning_effort(ReasoningEffort(effort.capitalize()))
    out = [HMessage.from_role_and_content(Role.SYSTEM, system)]
    functions = [t.get("function") or t for t in tools or () if t.get("type") == "function"]
    if instructions or functions:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if functions:
            developer = developer.with_function_tools([
                ToolDescription.new(name=f["name"], description=f.get("description") or "",
                                    parameters=f.get("parameters")) for f in functions])
        out.append(HMessage.from_role_and_content(Role.DEVELOPER, developer))
    return out


def to_harmony(messages: Sequence[Message]) -> list:
    """Chat messages -> harmony messages, as vLLM's `parse_chat_input_to_harmony_message`."""
    from openai_harmony import Author, Message as HMessage, Role

    names = {c.get("id"): (c.get("function") or {}).get("name") for m in messages for c in m.get("tool_calls") or ()}
    out = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant":
            if m.get("tool_calls") and content:
                out.append(HMessage.from_role_and_content(Role.ASSISTANT, content).with_channel("commentary"))
            if m.get("reasoning"):
                out.append(HMessage.from_role_and_content(Role.ASSISTANT, m["reasoning"]).with_channel("analysis"))
            for call in m.get("tool_calls") or ():
                fn = call.get("function") or {}
                args = fn.get("arguments") or ""
                args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                out.append(HMessage.from_role_and_content(Role.ASSISTANT, args).with_channel("commentary")
                           .with_recipient(f"functions.{fn.get('name', '')}").with_content_type("json"))
            if not m.get("tool_calls") and content:
                out.append(HMessage.from_role_and_content(Role.ASSISTANT, content).with_channel("final"))
        elif role == "tool":
            author = Author.new(Role.TOOL, f"functions.{names.get(m.get('tool_call_id'), '')}")
            out.append(HMessage.from_author_and_content(author, content).with_channel("commentary")
                       .with_recipient("assistant"))
        elif role in ("system", "developer"):  # a system message past the first (a compaction summary)
            from openai_harmony import DeveloperContent

            out.append(HMessage.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(content)))
        else:
            out.append(HMessage.from_role_and_content(Role.USER, content))
    return out


def drop_reasoning_before_final(messages: list) -> list:
    """harmony's rule over the whole conversation: reasoning before the last final answer is dropped."""
    last_final = max((i for i, m in enumerate(messages) if m.author.role.value == "assistant" and m.channel == "final"),
                     default=-1)
    return [m for i, m in enumerate(messages) if not (i < last_final and m.channel == "analysis")]

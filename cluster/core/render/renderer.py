"""Incremental chat-template rendering: render only new items, append their tokens.

Exactness contract: prefix tokens + delta tokens == tokens of a full render of
the same context. The delta is the render of (anchor + new) minus the render of
the anchor, where the anchor is the last message already rendered; it is used
only when (a) the anchor render is a true prefix, (b) every cut is at a special
token, so the tokenizer cannot merge across it, and (c) the start-up probe
(`probe.py`) proved this shape of delta exact on the served template (a
template may re-render *earlier* messages when a new one arrives: tools moved
before the last user message, reasoning dropped from earlier turns). Otherwise
the renderer falls back to a full render (correct, O(history), counted by reason). A template may end
a conversation with a tail that later messages replace: the delta then drops those last tokens of
the cached prefix first (`RenderResult.retract`, cut at a special token).

Token-exact continuations: when the previous turn's generated tokens are known
(`PriorOutput`) and the template renders that output as exactly the text the
model generated, the delta reuses the generated token ids instead of
re-tokenizing their text, so the engine's prefix cache covers them.

A template renders text (HF chat templates) or token ids (mistral_common, via
vLLM's `MistralTokenizer`); the delta logic is the same on both.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from cluster.core.messages import PriorOutput, RenderJob
from cluster.core.render.chat_messages import ContentGuard, Message, delta_steps, messages_from_items
from cluster.core.render.images import ImageTokens, context_images
from cluster.protocol.errors import ApiError

Template = Union[str, list[int]]  # a render: text, or token ids for templates that tokenize themselves
# (messages, tools, add_generation_prompt, **template arguments) -> render
ApplyTemplate = Callable[..., Template]
Encode = Callable[[str], list[int]]
MAX_RETRACT = 256  # the most characters (or token ids) of a template's tail a delta may take back


@dataclass
class TemplateHazards:
    """What reading the chat template found content-dependent (template_analysis.py), by role."""

    followed: bool = True  # False: it uses what the analysis cannot follow, nothing renders as a delta
    in_context: set[str] = field(default_factory=set)
    refused_adds: set[str] = field(default_factory=set)
    where: list[str] = field(default_factory=list)  # what was found, for the log and the stats
    # `loop.last` was taken as constant for assistant messages: a window ending with one renders in full.
    assumes_input_last: bool = False
    digest: str = ""  # the template's sha256 (what a mismatch report names)
    # Earlier messages render by state this role's messages set (the last user query): a delta's window
    # starts at the last message of the role and must hold one ("": no such state).
    anchor_role: str = ""

    def refusal(self, history_roles: Iterable[str], window_roles: Iterable[str], added_roles: Iterable[str],
                last_role: Optional[str]) -> Optional[str]:
        """Why a delta must render in full (None: the AST allows it)."""
        if not self.followed:
            return "template_not_analysable"
        if self.in_context and not self.in_context.isdisjoint({*history_roles, *window_roles}):
            return "content_dependent_in_context"
        if self.refused_adds.intersection(added_roles):
            return "content_dependent_state"
        if last_role == "assistant" and self.assumes_input_last:
            return "window_ends_with_assistant"
        if self.anchor_role and self.anchor_role not in window_roles:
            return "window_without_anchor"
        return None

    def summary(self) -> dict:
        return {"followed": self.followed, "in_context": sorted(self.in_context),
                "refused_adds": sorted(self.refused_adds), "anchor_role": self.anchor_role, "where": self.where[:20]}


def anchored_window(role: str) -> Callable[[Sequence[Message]], int]:
    """Windows that start at the last message of `role` (`TemplateHazards.anchor_role`), else at the last."""
    def start(messages: Sequence[Message]) -> int:
        return next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == role), len(messages) - 1)
    return start


def _starts(seq: Template, head: Template) -> bool:
    return len(seq) >= len(head) and seq[: len(head)] == head


@dataclass
class RenderResult:
    """What a render sends back: only the new tokens (O(new items) on the wire)."""

    appended: array  # tokens to append to the cached prefix (a full render: the whole prefix)
    generation: array  # the generation prompt's tokens, after the prefix
    anchor_start: int  # item index of the last rendered message
    full: bool  # True when this was a full render
    rendered_chars: int  # characters (or tokens) of template output rendered
    # A full render whose generation prompt cannot be cut off at a special token.
    prompt_override: Optional[array] = None
    reused_output: bool = False  # the previous turn's generated tokens were reused
    fallback: str = ""  # a delta job rendered fully: why (see IncrementalRenderer.fallbacks)
    # Tokens the engine adds by expanding the image placeholders in `appended` (vision models):
    # the engine's prompt is this much longer than the ids (render/images.py).
    image_tokens: int = 0
    # The cached prefix's last tokens this delta replaces, before `appended`: a closing tail that later
    # messages render otherwise (DeepSeek-R1's template closes tool outputs one way at the end, another before a call).
    retract: array = field(default_factory=lambda: array("i"))

    def continues(self, base: array) -> bool:
        """Whether this delta applies to the cached prefix `base` (it ends with the tail it retracts)."""
        n = len(self.retract)
        return self.full or not n or base[len(base) - n:] == self.retract

    def prefix(self, base: Optional[array]) -> array:
        """The new prefix given the cached prefix this delta extends (the one copy of the history a
        turn makes: the parent's prefix stays as it is, its state may be continued again)."""
        if self.full or base is None:
            return self.appended
        prefix = base[: len(base) - len(self.retract)]  # the one copy
        prefix.extend(self.appended)
        return prefix

    def assemble(self, base: Optional[array]) -> tuple[array, array]:
        """(prefix, prompt) given the cached prefix this delta extends."""
        prefix = self.prefix(base)
        return prefix, self.prompt_override if self.prompt_override is not None else prefix + self.generation

    def prompt_len(self, prefix: array) -> int:
        """The engine prompt's length, `prefix` being what `prefix()` returned (no prompt is built)."""
        return len(self.prompt_override) if self.prompt_override is not None else len(prefix) + len(self.generation)

    @property
    def delta_tokens(self) -> int:
        return len(self.appended) + len(self.generation)


class IncrementalRenderer:
    """Chat template + tokenizer, rendering only what is new when it can."""

    def __init__(self, apply_template: ApplyTemplate, encode: Encode, special_tokens: Sequence[str],
                 decode: Optional[Callable[[Sequence[int]], str]] = None, eos: Optional[Template] = None,
                 template_source: str = "", guard: Optional[ContentGuard] = None) -> None:
        self._apply = apply_template
        # Added tokens' text in what a client sent stays text (`guard.py`); `encode` is then the
        # guard's, which encodes a marked string as plain text.
        self.guard = guard
        self.template_source = template_source  # what `reasoning.effort` is looked up in
        self._encode = encode
        self.decode = decode  # raw (special tokens kept): the probe's stand-in for a model's output text
        self.eos = eos  # what ends a generated turn (text, or one token id): the probe's outputs stop there
        # Longest first so startswith checks find the right token.
        self._specials = tuple(sorted((s for s in special_tokens if s), key=len, reverse=True))
        self.full_renders = self.delta_renders = self.reused_outputs = 0
        # Delta steps the start-up probe proved exact (None: no probe ran, trust the local checks).
        self.proven: Optional[frozenset] = None
        # What reading the template's AST found content-dependent (None: not analysed, or no Jinja
        # template, as mistral_common's encoder): deltas it refuses render in full.
        self.hazards: Optional[TemplateHazards] = None
        self.startup_ms: dict[str, float] = {}  # the analysis's and the probe's start-up cost
        self.probe_report: Optional[Any] = None  # probe.ProbeReport
        self.fallbacks: dict[str, int] = {}  # reason -> delta jobs rendered fully
        self.last_fallback = ""
        self.on_fallback: Optional[Callable[[str, tuple], None]] = None
        # A vision model's image placeholder and token counts (None: text only; images never get here).
        self.images: Optional[ImageTokens] = None
        # The most characters one token stands for (`tokenizer.py`; None: no floor before tokenizing).
        self.max_token_chars: Optional[int] = None
        # Tokens a user message adds beyond its text, at least (`tokenizer.py`; 0: no such floor).
        self.min_user_message_tokens = 0
        # A family's own `reasoning.effort` arguments (None: the Jinja template's) and its rule for what
        # a delta's window cannot see (messages added -> why it renders in full), as harmony.py sets.
        self.effort_kwargs: Optional[Callable[[Optional[str]], dict[str, Any]]] = None
        self.delta_rule: Optional[Callable[[Sequence[Message]], Optional[str]]] = None
        self.raw_arguments = False  # tool calls' arguments as sent (harmony), not parsed for a template's tojson
        # Where the next delta's window starts, as an index into the messages rendered: the last message by
        # default; a family whose tool outputs name their call (harmony) starts at the calls they answer.
        self.window_start: Callable[[Sequence[Message]], int] = lambda messages: len(messages) - 1

    def stats(self) -> dict[str, Any]:
        report = self.probe_report
        return {"full_renders": self.full_renders, "delta_renders": self.delta_renders,
                "reused_outputs": self.reused_outputs, "fallbacks": dict(self.fallbacks),
                "probe": report.summary() if report is not None else None,
                "template_analysis": self.hazards.summary() if self.hazards is not None else None,
                "startup_ms": dict(self.startup_ms)}

    def reset_counters(self) -> None:
        self.full_renders = self.delta_renders = self.reused_outputs = 0
        self.fallbacks = {}

    def _system(self, instructions: Optional[str]) -> list[Message]:
        if not instructions:
            return []
        return [{"role": "system", "content": self.guard.escape(instructions) if self.guard else instructions}]

    def _safe_cut(self, before: Template, after: Template) -> bool:
        """A cut the tokenizer cannot merge across: at a special token (token ids always)."""
        if not isinstance(after, str) or not after or not before:
            return True
        return after.startswith(self._specials) or before.endswith(self._specials)

    def _tokens(self, rendered: Template) -> array:
        if isinstance(rendered, str):
            return array("i", self._encode(rendered)) if rendered else array("i")
        return array("i", rendered)

    def _image_tokens(self, ids: array, images: Sequence[bytes]) -> int:
        """The tokens the engine adds to `ids` by expanding its images (`images`: this render's, in order)."""
        return self.images.extra_tokens(ids, images) if self.images is not None else 0

    def _messages(self, items: Sequence[dict[str, Any]]) -> tuple[list[Message], list[int]]:
        placeholder = self.images.placeholder if self.images is not None else "[image]"
        messages, starts = messages_from_items(items, placeholder, self.raw_arguments)
        # The image placeholders it wrote stay tokens (one typed as text is refused by the image count).
        return (self.guard.escape(messages, keep=placeholder) if self.guard else messages), starts

    def _images(self, items: Sequence[dict[str, Any]]) -> list[bytes]:
        # Checked at the edge (size, type) before a render is asked for.
        return context_images(items, max_bytes=1 << 62) if self.images is not None else []

    def _fallback(self, reason: str, shape: tuple = ()) -> None:
        self.last_fallback = reason
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        if self.on_fallback is not None:
            self.on_fallback(reason, shape)

    def _applier(self, tools: Optional[list[dict[str, Any]]], effort: Optional[str]) -> Callable[..., Template]:
        kwargs = self.effort_kwargs(effort) if self.effort_kwargs else template_effort_kwargs(self.template_source, effort)
        if tools and self.guard:
            tools = self.guard.escape(tools)
        return lambda messages, add_generation_prompt: self._apply(messages, tools or None, add_generation_prompt,
                                                                   **kwargs)

    def full(
        self, items: Sequence[dict[str, Any]], instructions: Optional[str], tools: Optional[list[dict[str, Any]]],
        effort: Optional[str] = None,
    ) -> RenderResult:
        apply = self._applier(tools, effort)
        self.full_renders += 1
        messages, starts = self._messages(items)
        images = self._images(items)
        msgs = self._system(instructions) + messages
        text = apply(msgs, False) if msgs else ""
        with_gen = apply(msgs, True)
        anchor = starts[self.window_start(messages)] if starts else 0
        if isinstance(with_gen, list) and not text:
            text = []
        suffix = with_gen[len(text) :]
        prefix = self._tokens(text)
        extra = self._image_tokens(prefix, images)
        if _starts(with_gen, text) and self._safe_cut(text, suffix):
            return RenderResult(prefix, self._tokens(suffix), anchor, True, len(with_gen), image_tokens=extra)
        return RenderResult(prefix, array("i"), anchor, True, len(with_gen), self._tokens(with_gen),
                            image_tokens=extra)

    def delta(
        self,
        anchor_items: Sequence[dict[str, Any]],
        new_items: Sequence[dict[str, Any]],
        anchor_start: int,
        instructions: Optional[str],
        tools: Optional[list[dict[str, Any]]],
        prior: Optional[PriorOutput] = None,
        effort: Optional[str] = None,
        history_roles: frozenset = frozenset(),
    ) -> Optional[RenderResult]:
        """Tokens for `new_items` appended after a cached prefix; None if not provably exact.

        `prior`: the previous turn's generation prompt and generated tokens; `new_items`
        then starts with that turn's output items. `history_roles`: the chat roles of the
        context up to the anchor (a content-dependent template refuses some of them).
        """
        apply = self._applier(tools, effort)
        tools = tools or None
        system = self._system(instructions)
        anchor_msgs, _ = self._messages(anchor_items)
        both_msgs, both_starts = self._messages(list(anchor_items) + list(new_items))
        if self.hazards is not None:
            why = self.hazards.refusal(history_roles, {m["role"] for m in both_msgs},
                                       {m["role"] for m in both_msgs[len(anchor_msgs):]},
                                       both_msgs[-1]["role"] if both_msgs else None)
            if why is not None:
                self._fallback(why, delta_steps(bool(system), bool(tools), prior is not None, both_msgs))
                return None
        if self.delta_rule is not None and (why := self.delta_rule(both_msgs[len(anchor_msgs):])):
            self._fallback(why, delta_steps(bool(system), bool(tools), prior is not None, both_msgs))
            return None
        images = self._images(new_items)
        if prior is not None:
            res = self._delta_reusing(system, anchor_msgs, both_msgs, both_starts, anchor_start, tools, prior, apply,
                                      images)
            if res is not None:
                return res
        shape = delta_steps(bool(system), bool(tools), False, both_msgs)
        if self.proven is not None and not self.proven.issuperset(shape):
            self._fallback("shape_not_proven", shape)
            return None
        try:
            base = apply(system + anchor_msgs, False) if (system or anchor_msgs) else ""
            text = apply(system + both_msgs, False) if (system or both_msgs) else ""
            with_gen = apply(system + both_msgs, True)
        except Exception:  # noqa: BLE001 - the window alone may not be a valid conversation
            self._fallback("window_render_failed", shape)
            return None
        tail = base[self._kept(base, text):]
        base = base[: len(base) - len(tail)]
        if len(tail) > MAX_RETRACT or not _starts(text, base) or not _starts(with_gen, text):
            self._fallback("not_a_prefix", shape)
            return None
        delta_text, gen_text = text[len(base) :], with_gen[len(text) :]
        if not (self._safe_cut(base, delta_text) and self._safe_cut(text, gen_text)):
            self._fallback("unsafe_cut", shape)
            return None
        self.delta_renders += 1
        new_anchor = anchor_start + both_starts[self.window_start(both_msgs)] if both_starts else anchor_start
        appended = self._tokens(delta_text)
        return RenderResult(appended, self._tokens(gen_text), new_anchor, False, len(with_gen),
                            image_tokens=self._image_tokens(appended, images), retract=self._tokens(tail))

    def _kept(self, base: Template, text: Template) -> int:
        """How much of the anchor's render `base` the new render keeps: all, or up to the last special
        token before they differ (a closing tail that the new messages replace; token ids cut anywhere)."""
        lo, hi = 0, min(len(base), len(text))
        while lo < hi:  # the common prefix's length, by slices (C speed on long renders)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if base[:mid] == text[:mid] else (lo, mid - 1)
        if lo == len(base) or not isinstance(base, str):
            return lo
        return max((i + len(s) for s in self._specials if (i := base.rfind(s, max(0, lo - MAX_RETRACT), lo)) >= 0),
                   default=0)

    def _delta_reusing(self, system, anchor_msgs, both_msgs, both_starts, anchor_start, tools,
                       prior: PriorOutput, apply: Callable[..., Template],
                       images: Sequence[bytes] = ()) -> Optional[RenderResult]:
        """The delta with the previous turn's generated tokens in place of a re-render of
        their text: used when the template renders that output as exactly what was generated."""
        shape = delta_steps(bool(system), bool(tools), True, both_msgs)
        if self.proven is not None and not self.proven.issuperset(shape):
            self._fallback("reuse_shape_not_proven", shape)
            return None
        try:
            base_gen = apply(system + anchor_msgs, True)
            text = apply(system + both_msgs, False)
            with_gen = apply(system + both_msgs, True)
        except Exception:  # noqa: BLE001
            self._fallback("window_render_failed", shape)
            return None
        generated: Template = prior.text if isinstance(text, str) else list(prior.token_ids)
        head = base_gen + generated
        if not (_starts(text, head) and _starts(with_gen, text)):
            self._fallback("output_rendered_differently", shape)
            return None
        rest, gen_text = text[len(head) :], with_gen[len(text) :]
        if not (self._safe_cut(head, rest) and self._safe_cut(text, gen_text)):
            self._fallback("unsafe_cut", shape)
            return None
        self.delta_renders += 1
        self.reused_outputs += 1
        tail = self._tokens(rest)
        appended = array("i", prior.generation) + array("i", prior.token_ids) + tail
        new_anchor = anchor_start + both_starts[self.window_start(both_msgs)] if both_starts else anchor_start
        return RenderResult(appended, self._tokens(gen_text), new_anchor, False, len(with_gen), reused_output=True,
                            image_tokens=self._image_tokens(tail, images))


def render_job(renderer: IncrementalRenderer, job: RenderJob) -> tuple[Optional[RenderResult], bool]:
    """Run a render job from the turn driver; returns (result, mismatch).

    `verify_items` + `verify_prefix` (tests, debugging) check the delta against a full render;
    on a mismatch the full render is returned, so output stays correct. A delta that reused
    generated tokens is compared as text (the model's own tokens may tokenize its text
    differently: that is the point of reusing them).
    """
    if not job.delta:
        return renderer.full(job.items, job.instructions, job.tools, job.reasoning_effort), False
    res = renderer.delta(job.anchor_items, job.new_items, job.anchor_start, job.instructions, job.tools, job.prior,
                         job.reasoning_effort, job.history_roles)
    if res is not None and job.verify_items is not None:
        full = renderer.full(job.verify_items, job.instructions, job.tools, job.reasoning_effort)
        want, got = full.assemble(None)[1], res.assemble(job.verify_prefix)[1]
        if res.reused_output and renderer.decode is not None:
            want, got = renderer.decode(want), renderer.decode(got)
        if want != got:
            return full, True
    return res, False


def template_effort_kwargs(template: str, effort: Optional[str]) -> dict[str, Any]:
    """The chat-template arguments for `reasoning.effort`, or a 400 if the template has none."""
    if effort is None:
        return {}
    if "reasoning_effort" in template:
        return {"reasoning_effort": effort}
    if "enable_thinking" in template:
        return {"enable_thinking": effort != "none"}
    if effort == "none":
        return {}
    raise ApiError(400, "Unsupported parameter: 'reasoning.effort' is not supported with this model (its chat "
                        "template has no reasoning-effort argument); omit it or send 'none'.",
                   param="reasoning.effort", code="unsupported_parameter")

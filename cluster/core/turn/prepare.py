"""Preparing a turn: the request's context resolved on its parent and rendered.

Plain logic over two injected ports, the renderer (a Ray handle in production, the renderer
itself inline for deltas) and the tenant's stored items. The driver prepares a response's first
engine call with it; a multi-agent response's stream prepares each later call with it too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, NamedTuple, Optional, Protocol

from cluster import telemetry
from cluster.core.messages import RenderJob, ToolSpec, TurnTiming
from cluster.core.render.images import ImageLimits, context_images, image_parts
from cluster.core.render.renderer import RenderResult
from cluster.core.render.tokenizer import kept_items, min_prompt_tokens
from cluster.core.turn.cache import (
    RenderedPrefix,
    RenderKey,
    ResponseState,
    items_nbytes,
    text_chars,
)
from cluster.core.turn.context import (
    ResolvedContext,
    normalize_tools,
    open_sealed,
    reject_non_text,
    resolve_context,
)
from cluster.core.turn.controls import check_output_controls
from cluster.core.turn.turn import Rendered
from cluster.protocol.errors import ApiError
from cluster.protocol.request_bounds import RENDERED_TOOL_TYPES
from cluster.protocol.requests import ResponsesRequest
from cluster.protocol.sealing import Sealer


class RenderPort(Protocol):
    # None from a delta job means "not provably exact, send a full job".
    async def __call__(self, job: RenderJob) -> Optional[RenderResult]: ...


# Item references one request may hold (each is a store read).
MAX_ITEM_REFERENCES = 256


def context_too_large(size: int, limit: int) -> ApiError:
    return ApiError(400, f"The conversation holds about {size} bytes of input; the limit is {limit} bytes. "
                         "Start a new conversation or compact it.", param="input", code="context_too_large")


# (item id, tenant) -> the stored item (an `item_reference` input), or None.
ItemLookup = Callable[[str, Optional[str]], Awaitable[Optional[dict[str, Any]]]]


@dataclass
class TurnSettings:
    """The turn driver's slice of the configuration."""

    model_name: str
    default_max_tokens: int
    max_model_len: int
    verify_renders: bool = False
    output_chunk_chars: int = 256
    max_unverified_chars: Optional[int] = None  # None: two chunks (TurnSafety)
    classify_tool_outputs: bool = False
    max_input_items: Optional[int] = None
    max_context_tokens: Optional[int] = None
    max_context_bytes: Optional[int] = None
    # The engine can force tool calls (tool_choice required/named) for this model's format.
    can_force_tool_calls: bool = True
    # The model's own sampling defaults (temperature, top_p) the engine applies to a request that
    # sets none: what a response reports it used.
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    images: Optional[ImageLimits] = None  # a vision model's image limits (None: text only, images are a 400)
    # The most characters one token of the model stands for (`render/tokenizer.py`): inputs that cannot
    # fit the context are refused before the tokenizer runs. None: no such floor.
    max_token_chars: Optional[int] = None
    min_user_message_tokens: int = 0  # the template's markers around each user message, at least

    @property
    def context_limit(self) -> int:
        # A prompt must leave room for one generated token; an operator may bound it lower.
        return min(self.max_model_len - 1, self.max_context_tokens or self.max_model_len)


class Prepared(NamedTuple):
    context: ResolvedContext
    rendered: Rendered
    tools: list[ToolSpec]
    render_key: RenderKey


class TurnPreparer:
    def __init__(self, settings: TurnSettings, *, render: RenderPort, items: Optional[ItemLookup] = None,
                 tracer: Any = None, sealer: Optional[Sealer] = None) -> None:
        self.settings = settings
        self.sealer = sealer  # opens compaction and reasoning blobs (None: compaction items are refused)
        # Why this replica no longer renders deltas (a sampled check found one inexact: core/render/audit.py).
        self.deltas_off: Optional[str] = None
        self.model_name = settings.model_name
        self.render = render
        self.items = items
        self.tracer = tracer or telemetry.tracer()

    async def _truncate(self, ctx: ResolvedContext, job: RenderJob) -> tuple[ResolvedContext, RenderResult]:
        """`truncation: "auto"`: drop the oldest items, whole user turns at a time (a cut at a
        user message never separates a tool call from its output), keeping the instructions,
        until the prompt fits; the response continues from what the model saw. Galloping then
        binary search: O(log turns) full renders, each of about the model's context at most.
        When even the last user turn alone does not fit, the context_length_exceeded error stands."""
        items = ctx.items
        cuts = [i for i, item in enumerate(items)
                if i > 0 and item.get("type", "message") == "message" and item.get("role") == "user"]
        best: Optional[tuple[int, RenderResult]] = None

        async def fits(k: int) -> Optional[RenderResult]:
            rendered = await self.render(job.as_full(items[cuts[k]:]))
            fit = rendered.prompt_len(rendered.prefix(None)) + rendered.image_tokens <= self.settings.context_limit
            return rendered if fit else None

        # Galloping from the newest turn back: each render is at most about twice what is kept,
        # so the work is bounded by the model's context, not by how large the body is.
        bad, good, step = -1, len(cuts), 1
        while good > 0:
            k = max(0, len(cuts) - step)
            rendered = await fits(k)
            if rendered is None:
                bad = k
                break
            best, good, step = (cuts[k], rendered), k, step * 2
        lo, hi = bad + 1, good - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            rendered = await fits(mid)
            if rendered is not None:
                best, hi = (cuts[mid], rendered), mid - 1
            else:
                lo = mid + 1
        if best is None:
            rendered = await self.render(job)
            return ctx, rendered
        cut, rendered = best
        return ResolvedContext(items[cut:], max(0, ctx.new_start - cut), ctx.known_call_ids, ctx.pending_call_ids,
                               ctx.parent), rendered

    async def count_input_tokens(self, req: ResponsesRequest, parent: Optional[ResponseState], owner: str) -> int:
        """What `input_tokens` would be for this request (renders, does not generate); item
        references resolve in `owner`'s items only."""
        prepared = await self.prepare(req, parent, TurnTiming(), None, owner)
        return prepared.rendered.engine_len

    async def _dereference(self, items: list[dict[str, Any]], owner: Optional[str],
                           held: int) -> tuple[list[dict[str, Any]], int]:
        """`item_reference` inputs -> the tenant's stored items (400 when not found). Each distinct
        item is fetched once, and the input's size is summed as it grows: a short body naming one
        large item many times stops at the context limit, not after holding every copy."""
        refs = sum(1 for item in items if item.get("type") == "item_reference")
        if refs > MAX_ITEM_REFERENCES:
            raise ApiError(400, f"Invalid 'input': {refs} item references; at most {MAX_ITEM_REFERENCES} are allowed "
                                "in one request.", param="input", code="array_above_max_length")
        fetched: dict[str, dict[str, Any]] = {}
        out, total = [], 0
        for i, item in enumerate(items):
            if item.get("type") == "item_reference":
                ref = str(item.get("id"))
                found = fetched.get(ref)
                if found is None:
                    # No tenant, no items: a missing owner never stands for anyone's ("default" included).
                    found = await self.items(ref, owner) if self.items is not None and owner else None
                    if found is None:
                        raise ApiError(400, f"Item with id '{ref}' not found.", param=f"input[{i}]",
                                       code="invalid_value")
                    fetched[ref] = found
                item = dict(found)  # stored input and output items render as they are (shallow: shared content)
            total += items_nbytes([item])
            limit = self.settings.max_context_bytes
            if limit is not None and held + total > limit:
                raise context_too_large(held + total, limit)
            out.append(item)
        return out, total

    def check_body_floor(self, body: Any) -> None:
        """`_check_floor`'s input part on the request body as it came, before it is validated:
        validating and copying 10,000 items (~70 ms of the event loop) only to learn that their
        role markers alone are over the context is what a client over nothing but its rate limit
        could make a replica do ten times a second. Malformed items count as nothing here; the
        validation that follows refuses them."""
        items = body.get("input") if isinstance(body, dict) else None
        if not self.settings.max_token_chars or not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            return
        instructions = body.get("instructions")
        truncation = body.get("truncation") if isinstance(body.get("truncation"), str) else None
        self._check_input_floor(items, truncation, instructions if isinstance(instructions, str) else None)

    def _check_input_floor(self, items: list[dict[str, Any]], truncation: Optional[str],
                           instructions: Optional[str]) -> None:
        chars, limit = self.settings.max_token_chars, self.settings.context_limit
        floor = min_prompt_tokens(kept_items(items, truncation), chars, self.settings.min_user_message_tokens) \
            + len(instructions or "") // chars
        if floor > limit:
            raise context_too_long(limit, floor, at_least=True)

    def _check_floor(self, req: ResponsesRequest, new_items: list[dict[str, Any]]) -> None:
        """Before anything is rendered or tokenized: the new items and the instructions (rendered as
        they are) must fit the context at the tokenizer's densest, and the tool definitions may hold
        no more characters than the whole context could (a template writes them out, at least)."""
        chars, limit = self.settings.max_token_chars, self.settings.context_limit
        if not chars:
            return
        self._check_input_floor(new_items, req.truncation, req.instructions)
        # Only what a template writes: tools the model is not offered (web_search, ...) are bounded as
        # echo at parse time (request_bounds.MAX_ECHO_CHARS), not by the context.
        rendered = [t for t in req.tools or [] if t.get("type") in RENDERED_TOOL_TYPES]
        tools = text_chars(rendered) if rendered else 0
        if tools > limit * chars:
            raise ApiError(400, f"Invalid 'tools': the tool definitions hold {tools} characters; this model's context of "
                                f"{limit} tokens holds at most {limit * chars}.", param="tools",
                           code="context_length_exceeded")

    def render_fully(self, reason: str) -> None:
        """Every turn from now on renders its whole context (a delta render was found inexact)."""
        self.deltas_off = reason

    async def input_items(self, req: ResponsesRequest, parent: Optional[ResponseState],
                          owner: Optional[str]) -> list[dict[str, Any]]:
        """The request's input items resolved for `owner` as a turn would see them (references
        fetched, sealed blobs opened), without rendering: what compaction works from."""
        items = req.input_items()
        if any(item.get("type") == "item_reference" for item in items):
            items, _ = await self._dereference(items, owner, parent.context_bytes if parent is not None else 0)
        return open_sealed(items, self.sealer, owner)

    async def prepare(self, req: ResponsesRequest, parent: Optional[ResponseState], timing: TurnTiming, tctx: Any,
                      owner: Optional[str] = None, items: Optional[list[dict[str, Any]]] = None) -> Prepared:
        """Resolve the request's context on `parent` (item references, limits, output controls)
        and render it: only the anchor and the new items when the parent's render can be extended.
        `items` stand for the request's input (a window the turn compacted to)."""
        t0 = time.perf_counter()
        new_items = req.input_items() if items is None else items
        new_bytes: Optional[int] = None  # summed once: while dereferencing, or below
        decoded: dict[int, bytes] = {}  # the new images, decoded once (checked here, sent below)
        if any(item.get("type") == "item_reference" for item in new_items):
            new_items, new_bytes = await self._dereference(new_items, owner,
                                                           parent.context_bytes if parent is not None else 0)
        with self.tracer.start_as_current_span("resolve_context", context=tctx):
            # Sealed blobs open for this tenant, or the request stops here: nothing of them reaches the model.
            new_items = open_sealed(new_items, self.sealer, owner)
            if self.settings.images is None:
                reject_non_text(new_items, self.model_name)
            else:  # decoded and checked here (bytes, format, pixels), before a render or the engine sees them
                context_images(new_items, self.settings.images.max_image_bytes, memo=decoded,
                               max_pixels=self.settings.images.max_image_pixels)
            ctx = resolve_context(new_items, parent)
            if self.settings.images is not None:  # counted before a render runs the processor on each
                self.settings.images.check_count(self._image_count(ctx.items, parent))
            self._check_floor(req, new_items)
            limit = self.settings.max_context_bytes
            if limit is not None:
                # Payload the state will keep alive (rendered or not): bounded per context.
                size = (parent.context_bytes if parent is not None else 0) + (
                    new_bytes if new_bytes is not None else items_nbytes(new_items))
                if size > limit:
                    raise context_too_large(size, limit)
            if not ctx.items and not req.is_warm_up:
                raise ApiError(400, "Missing required parameter: 'input'.", param="input",
                               code="missing_required_parameter")
            tools_spec = normalize_tools(req.tools)
            check_output_controls(req, tools_spec, model=self.model_name,
                                  can_force_tool_calls=self.settings.can_force_tool_calls)
            effort = req.reasoning.effort if req.reasoning is not None else None
            key = RenderKey.of(req.instructions, tools_spec, effort)
        timing.resolve = time.perf_counter() - t0
        timing.new_items = len(new_items)
        timing.context_items = len(ctx.items)
        t1 = time.perf_counter()
        st = self.settings
        pre = parent.rendered if parent is not None else None
        full_job = RenderJob(req.instructions, tools_spec, items=ctx.items, reasoning_effort=effort)
        if pre is not None and pre.key == key and self.deltas_off is None:
            # Only the anchor message and the new items travel: O(new items).
            job = RenderJob(req.instructions, tools_spec, delta=True, reasoning_effort=effort,
                            anchor_items=ctx.items[pre.anchor_start : pre.item_count],
                            new_items=ctx.items[pre.item_count :], anchor_start=pre.anchor_start,
                            history_roles=pre.roles,
                            prior=pre.prior if parent.output_start == pre.item_count else None,
                            new_images=st.images is not None and any(image_parts(ctx.items[pre.item_count:])),
                            new_bytes=items_nbytes(ctx.items[pre.item_count :]))
            if st.verify_renders:
                job.verify_items, job.verify_prefix = ctx.items, pre.token_ids
        else:
            job = full_job
        span = self.tracer.start_span("render", context=tctx)
        try:
            job.trace = full_job.trace = telemetry.inject(telemetry.context_of(span))
            rendered = await self.render(job)
            # Not provably exact, or its tail is not this prefix's: render it all.
            if rendered is None or (pre is not None and not rendered.continues(pre.token_ids)):
                rendered = await self.render(full_job)
            span.set_attribute("loopserve.render.mode", "full" if rendered.full else "delta")
            span.set_attribute("loopserve.render.delta_tokens", rendered.delta_tokens)
        finally:
            span.end()
        extends = pre is not None and not rendered.full
        prefix = rendered.prefix(pre.token_ids if extends else None)
        images = self._images(ctx.items, pre if extends else None, decoded)
        image_tokens = rendered.image_tokens + (pre.image_tokens if extends else 0)
        timing.render = time.perf_counter() - t1
        timing.full_render = rendered.full
        timing.delta_tokens = rendered.delta_tokens
        prompt_len = rendered.prompt_len(prefix)
        if prompt_len > st.context_limit and req.truncation == "auto":
            ctx, rendered = await self._truncate(ctx, full_job)
            prefix = rendered.prefix(None)
            prompt_len = rendered.prompt_len(prefix)
            timing.full_render, extends = True, False
            images, image_tokens = self._images(ctx.items, None, decoded), rendered.image_tokens
        if st.images is not None:
            st.images.check_count(len(images))
        if prompt_len + image_tokens > st.context_limit:
            raise context_too_long(st.context_limit, prompt_len + image_tokens)
        return Prepared(ctx, Rendered(prefix, rendered.generation, rendered.anchor_start, extends,
                                      rendered.prompt_override, images, image_tokens,
                                      len(rendered.retract) if extends else 0), tools_spec, key)

    @staticmethod
    def _image_count(items: list[dict[str, Any]], parent: Optional[ResponseState]) -> int:
        """How many images the context holds: the parent's render's count and the new items'."""
        pre = parent.rendered if parent is not None else None
        if pre is None or pre.item_count > len(items):
            return sum(1 for _ in image_parts(items))
        return len(pre.images) + sum(1 for _ in image_parts(items[pre.item_count:]))

    def _images(self, items: list[dict[str, Any]], pre: Optional[RenderedPrefix],
                decoded: dict[int, bytes]) -> tuple[bytes, ...]:
        """The prompt's images, in order: the engine expands every placeholder of the prompt, the
        parent's included, so a continuation sends them all (`pre`: the prefix it extends)."""
        if self.settings.images is None:
            return ()
        if pre is None:
            return tuple(context_images(items, self.settings.images.max_image_bytes, memo=decoded))
        return pre.images + tuple(context_images(items[pre.item_count:], self.settings.images.max_image_bytes,
                                                 memo=decoded))


def context_too_long(limit: int, tokens: int, at_least: bool = False) -> ApiError:
    return ApiError(400, f"This model's maximum context length is {limit} tokens, but the input has "
                         f"{'at least ' if at_least else ''}{tokens} tokens.",
                    code="context_length_exceeded", param="input")

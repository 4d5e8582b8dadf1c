"""The start-up probe: which delta renders are exact on the served chat template.

A delta render sees only the anchor message and the new items, so it cannot see
a template that renders *earlier* messages differently once a new one arrives
(Mistral v3 moves the tools and the system prompt to the last user message;
Qwen3-style templates drop reasoning from turns before the last user message;
Llama 3.1/4 put the tools inside the first user message). The probe drives the
renderer through a battery of conversations exactly as the turn driver does
(a full render, then one delta per turn, with and without reusing the
generated tokens) and compares every assembled prompt with a full render of the
same context. It also checks every single step (one message appended to a
conversation) of every battery conversation. A step (`render.delta_steps`: from
one message kind to the next, with or without tools, system prompt, reused
output) is proven when it was exact and never part of a wrong delta (an inexact
multi-step delta blames its steps that no single-step check proved); a delta
takes the incremental path only when all its steps are proven.

Plain Python (no I/O): `probe(renderer)` runs in ~0.1-1 s at replica start.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from cluster.core.messages import PriorOutput
from cluster.core.render.chat_messages import COMPACTION_SUMMARY, messages_from_items
from cluster.core.render.chat_messages import delta_steps
from cluster.core.render.renderer import IncrementalRenderer, RenderResult

log = logging.getLogger("loopserve.render")

Item = dict[str, Any]

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "shell", "description": "Run a command.", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
]
OTHER_TOOLS = TOOLS[:1]


def _user(text: str) -> Item:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def _developer(text: str) -> Item:
    return {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": text}]}


def _says(text: str) -> Item:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


def _call(call_id: str, name: str = "read_file", args: str = '{"path": "src/main.py"}') -> Item:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": args}


def _result(call_id: str, text: str = "def main():\n    return 0\n") -> Item:
    return {"type": "function_call_output", "call_id": call_id, "output": text}


def _thinks(text: str) -> Item:
    return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _compaction() -> Item:
    # As a turn sees it: the sealed blob opened (cluster/core/turn/context.py), its summary beside it.
    return {"type": "compaction", "encrypted_content": "ls1.probe.sealed", COMPACTION_SUMMARY:
            "The user asked about main.py; it was read and holds one function, main(), that returns 0."}


# A turn: (new input items, the model's output items).
Turn = tuple[list[Item], list[Item]]

SCENARIOS: dict[str, list[Turn]] = {
    "chat": [([_user("Hello there.")], [_says("Hi! How can I help?")]),
             ([_user("What is 2 + 2?"), _user("Answer with a digit.")], [_says("4.")]),
             ([_user("And 3 + 3?")], [_says("6.")]),
             ([_user("Thanks.")], [])],
    "tool_loop": [([_user("Fix the bug in main.py.")], [_call("call_a1")]),
                  ([_result("call_a1")], [_call("call_a2", "shell", '{"command": "pytest -q"}')]),
                  ([_result("call_a2", "1 passed"), _user("Also run the linter.")], [_call("call_a4", "shell")]),
                  ([_result("call_a4", "ok")], [_says("Fixed: main returns 0.")]),
                  ([_user("Now add a test.")], [_call("call_a3")]),
                  ([_result("call_a3")], [_says("Done.")]),
                  ([_user("Thanks.")], [])],
    "parallel_calls": [([_user("Read both files.")], [_call("call_b1"), _call("call_b2", args='{"path": "b.py"}')]),
                       ([_result("call_b1"), _result("call_b2", "x = 1")], [_call("call_b3")]),
                       ([_result("call_b3")], [_call("call_b6"), _call("call_b7", args='{"path": "d.py"}')]),
                       ([_result("call_b6"), _result("call_b7")], [_says("Both read.")]),
                       ([_user("Again.")], [_call("call_b4"), _call("call_b5", args='{"path": "c.py"}')]),
                       ([_result("call_b4"), _result("call_b5")], [])],
    "text_and_call": [([_user("Check main.py.")], [_says("Let me look."), _call("call_c1")]),
                      ([_result("call_c1")], [_says("It looks fine."), _call("call_c2", "shell", '{"command": "ls"}')]),
                      ([_result("call_c2", "main.py")], [_says("All good.")]),
                      ([_user("Great.")], [])],
    "reasoning": [([_user("Fix main.py.")], [_thinks("I should read it first."), _call("call_d1")]),
                  ([_result("call_d1")], [_thinks("It returns 0, fine."), _says("It is correct.")]),
                  ([_user("Are you sure?")], [_thinks("Check again."), _call("call_d2")]),
                  ([_result("call_d2")], [_thinks("Yes."), _says("Yes.")]),
                  ([_user("Ok.")], [])],
    # A compacted window as /responses/compact returns it: the user messages, then the compaction item.
    "compaction": [([_user("Fix main.py."), _compaction(), _user("Continue with main.py.")], [_says("Continuing.")]),
                   ([_user("Read it.")], [_call("call_e1")]),
                   ([_result("call_e1")], [_says("Read.")]),
                   ([_user("Thanks.")], [])],
    # Codex: a warm-up holding its instructions as a developer message, then the first turn
    # adds more developer and user messages to it.
    "warm_up": [([_developer("You are a coding agent.")], []),
                ([_developer("Skills: none."), _user("<environment_context>cwd=/repo</environment_context>"),
                  _user("Fix main.py.")], [_call("call_f1")]),
                ([_result("call_f1")], [_says("Fixed.")]),
                ([_user("Thanks.")], [])],
    "developer_mid": [([_user("Hi.")], [_says("Hello.")]),
                      ([_developer("Answer in one word."), _user("Status?")], [_says("Green.")]),
                      ([_user("More?")], [_says("No.")]),
                      ([_user("Ok.")], [])],
}
# Long and varied contents, as real agent loops carry them: a template may render an earlier
# message differently depending on its content and on what came after it (shorten an old tool
# output past some length once a newer one exists, escape or strip code), which short probe
# texts never show. What the battery cannot foresee, the sampled check catches (audit.py).
_SOURCE = "".join(f"def step_{n}(x):\n    return x * {n}  # ünïcode, \"quotes\", {{braces}} and\ttabs\n"
                  for n in range(12))
_JSON = '{"files": [' + ", ".join(f'{{"path": "src/m{n}.py", "lines": {40 * n}}}' for n in range(20)) + "]}"
SCENARIOS["long_contents"] = [
    ([_user("Refactor the module. " + "Keep the public API stable and the tests green. " * 8)],
     [_says("Reading it first."), _call("call_l1")]),
    ([_result("call_l1", _SOURCE)], [_says("Now the file list."), _call("call_l2", "shell", '{"command": "ls -R"}')]),
    ([_result("call_l2", _JSON)], [_call("call_l3", "shell", '{"command": "pytest -q"}')]),
    ([_result("call_l3", "." * 300 + "\n3 failed, 297 passed in 12.3s\n" + "E   AssertionError\n" * 10)],
     [_says("Three failures; " + "fixing them one by one. " * 10)]),
    ([_user("Go on.")], []),
]
# The model reasoning before its calls (Qwen3, gpt-oss), with tool outputs of several lengths: a
# step into the next tool output is then proven on long texts too, not only on short ones.
SCENARIOS["long_reasoning_tools"] = [
    ([_user("Audit the repository.")], [_thinks("Start with the sources. " * 4), _call("call_r1")]),
    ([_result("call_r1", _SOURCE * 2)], [_thinks("Then the listing."), _call("call_r2", "shell", '{"command": "ls"}')]),
    ([_result("call_r2", _JSON * 4)], [_thinks("Now run the tests."), _call("call_r3", "shell")]),
    ([_result("call_r3", "E   AssertionError\n" * 200)], [_thinks("One failure."), _says("Found it.")]),
    ([_user("Fix it.")], []),
]
# Scenarios whose tools change mid-way (a new RenderKey: the driver renders fully).
TOOL_CHANGES = {"tool_loop": 3}


@dataclass
class ProbeReport:
    """What the probe found, per delta step."""

    exact: dict[tuple, int] = field(default_factory=dict)  # step -> exact deltas it was part of
    single_exact: set = field(default_factory=set)  # steps a single-step check proved
    wrong: dict[tuple, str] = field(default_factory=dict)  # step -> the first failure blamed on it
    inexact: list = field(default_factory=list)  # (steps, why) of wrong multi-step deltas
    checks: int = 0
    # Roles whose arrival the template analysis refuses (with windows anchored at the last such message):
    # a delta adding one renders in full whatever the probe finds, so it proves or blames no step.
    refused_adds: frozenset = frozenset()
    # The template renders an assistant message that ends the context differently (`loop.last`): the
    # driver's contexts end with their input, so no single step starts from one.
    input_last: bool = False

    @property
    def proven(self) -> frozenset:
        return frozenset(s for s in self.exact if s not in self.wrong)

    def record(self, steps: tuple, ok: bool, why: str = "", single: bool = False) -> None:
        self.checks += 1
        if ok:
            for step in steps:
                self.exact[step] = self.exact.get(step, 0) + 1
            if single:
                self.single_exact.update(steps)
        elif single or len(steps) == 1:
            for step in steps:
                self.wrong.setdefault(step, why)
        else:
            self.inexact.append((steps, why))

    def settle(self) -> None:
        """Blame each wrong multi-step delta on its steps no single-step check proved
        (all of them when every step looked exact alone)."""
        for steps, why in self.inexact:
            blamed = [s for s in steps if s not in self.single_exact] or list(steps)
            for step in blamed:
                self.wrong.setdefault(step, why)

    def summary(self) -> dict[str, Any]:
        return {"checks": self.checks, "proven": sorted(map(format_step, self.proven)),
                "falls_back": {format_step(s): why for s, why in sorted(self.wrong.items(), key=str)}}


def format_step(step: tuple) -> str:
    system, tools, reuse, before, after = step
    flags = [f for f, on in (("system", system), ("tools", tools), ("reusing output", reuse)) if on]
    return f"{before} -> {after}" + (f" [{', '.join(flags)}]" if flags else "")


@dataclass
class _State:
    """The turn driver's view of a conversation after one turn (see TurnPreparer.prepare)."""

    items: list[Item]
    prefix: array
    item_count: int
    anchor_start: int
    generation: array
    prompt_extends_prefix: bool


def _simulated_output(r: IncrementalRenderer, items: list[Item], output: list[Item], instructions, tools,
                      st: _State) -> Optional[PriorOutput]:
    """The tokens a model would have generated for `output`: the full render's own tokens
    after the prompt, up to the end of the turn."""
    if not output or not st.prompt_extends_prefix or r.decode is None:
        return None
    prompt = st.prefix + st.generation
    try:  # followed by a user message: some encoders refuse a conversation that ends with the assistant
        with_output = r.full(items + output + [_user("Next.")], instructions, tools).assemble(None)[0]
    except Exception:  # noqa: BLE001
        return None
    if with_output[: len(prompt)] != prompt:
        return None
    ids = list(with_output[len(prompt):])
    eos = r.eos
    if isinstance(eos, str) and eos:
        text = r.decode(ids)
        end = text.find(eos)
        if end < 0:
            return None
        text = text[: end + len(eos)]
        # Token boundaries: keep the ids whose text ends exactly at the end of the turn.
        for n in range(1, len(ids) + 1):
            if r.decode(ids[:n]) == text:
                return PriorOutput(array("i", st.generation), array("i", ids[:n]), text)
        return None
    if isinstance(eos, int) and eos in ids:
        ids = ids[: ids.index(eos) + 1]
        return PriorOutput(array("i", st.generation), array("i", ids), r.decode(ids))
    return None


# What the renderer checks on every delta before it is used: a failure there falls back at run time too, so
# the probe learns nothing about a step from it (a step is blamed only for a delta that passed them and was wrong).
CAUGHT_AT_RUN_TIME = frozenset({"not_a_prefix", "unsafe_cut", "window_render_failed", "output_rendered_differently"})


def _check(report: ProbeReport, r: IncrementalRenderer, st: _State, ctx: list[Item], instructions, tools,
           prior: Optional[PriorOutput], single: bool = False) -> Optional[RenderResult]:
    """One delta as the driver would run it after state `st`, against a full render of `ctx`."""
    anchor_items, new_items = ctx[st.anchor_start: st.item_count], ctx[st.item_count:]
    both, _ = messages_from_items(list(anchor_items) + list(new_items))
    steps = delta_steps(bool(instructions), bool(tools), prior is not None, both)
    if not steps or report.refused_adds.intersection(m["role"] for m in messages_from_items(new_items)[0]):
        return None
    try:
        want = r.full(ctx, instructions, tools).assemble(None)[1]
    except Exception as exc:  # noqa: BLE001 - a template that cannot render this conversation at all
        report.record(steps, False, f"template_refuses_it ({type(exc).__name__})", single)
        return None
    r.last_fallback = ""
    res = r.delta(anchor_items, new_items, st.anchor_start, instructions, tools, prior)
    if (single or report.refused_adds) and ((res is None and r.last_fallback in CAUGHT_AT_RUN_TIME) or (
            res is not None and prior is not None and not res.reused_output)):
        # Every delta checks its cut and its reuse as it runs: a single step (a state the probe made up)
        # or an anchored window failing there proves or blames no step.
        return None
    if res is None or (prior is not None and not res.reused_output):
        report.record(steps, False, r.last_fallback or "output_rendered_differently", single)
        return None
    got = res.assemble(st.prefix)[1]
    report.record(steps, got == want, "" if got == want else "differs_from_full_render", single)
    return res if got == want else None


def _single_steps(report: ProbeReport, r: IncrementalRenderer, items: list[Item], instructions, tools) -> None:
    """Every message of a conversation appended alone to the conversation before it."""
    messages, starts = messages_from_items(items)
    bounds = starts[1:] + [len(items)]
    for i in range(1, len(starts)):
        if messages[i]["role"] == "assistant" or (report.input_last and messages[i - 1]["role"] == "assistant"):
            continue  # a turn's context never ends with the assistant (the driver's runs cover these steps)
        try:
            prefix = r.full(items[: starts[i]], instructions, tools)
        except Exception:  # noqa: BLE001 - e.g. an encoder that refuses a conversation ending with the assistant
            continue
        anchor = starts[r.window_start(messages[:i])]
        st = _State(items[: starts[i]], prefix.assemble(None)[0], starts[i], anchor, array("i"), True)
        _check(report, r, st, items[: bounds[i]], instructions, tools, None, single=True)


def _run(report: ProbeReport, r: IncrementalRenderer, turns: Sequence[Turn], instructions: Optional[str],
         tools: Optional[list], changes_at: Optional[int]) -> None:
    items: list[Item] = []
    st: Optional[_State] = None
    prior: Optional[PriorOutput] = None
    for i, (new, output) in enumerate(turns):
        turn_tools = OTHER_TOOLS if (tools and changes_at is not None and i >= changes_at) else tools
        ctx = items + new
        res: Optional[RenderResult] = None
        if st is not None and not (changes_at is not None and i == changes_at and tools):
            res = _check(report, r, st, ctx, instructions, turn_tools, None)
            if prior is not None:
                res = _check(report, r, st, ctx, instructions, turn_tools, prior) or res
        try:
            if res is None:
                res = r.full(ctx, instructions, turn_tools)
                prefix, prompt = res.assemble(None)
            else:
                prefix, prompt = res.assemble(st.prefix if st is not None else None)
        except Exception:  # noqa: BLE001 - the template refuses this conversation: nothing more to learn
            return
        st = _State(ctx, prefix, len(ctx), res.anchor_start, array("i", prompt[len(prefix):]),
                    res.prompt_override is None)
        prior = _simulated_output(r, ctx, output, instructions, turn_tools, st)
        items = ctx + output


def probe(renderer: IncrementalRenderer) -> ProbeReport:
    """Run the battery; the renderer then takes the delta path only for proven shapes."""
    renderer.proven = None  # the probe itself runs the unguarded paths
    hazards, renderer.hazards = renderer.hazards, None  # and proves what the template does, not what the AST allows
    report = ProbeReport(refused_adds=frozenset(hazards.refused_adds) if hazards and hazards.anchor_role else frozenset(),
                         input_last=bool(hazards and hazards.anchor_role and hazards.assumes_input_last))
    try:
        for name, turns in SCENARIOS.items():
            conversation = [item for new, output in turns for item in new + output]
            for instructions in (None, "You are a coding agent. Be brief."):
                for tools in (TOOLS, None):
                    _run(report, renderer, turns, instructions, tools, TOOL_CHANGES.get(name))
                    _single_steps(report, renderer, conversation, instructions, tools)
    finally:
        renderer.hazards = hazards
    report.settle()
    renderer.proven = report.proven
    renderer.probe_report = report
    renderer.reset_counters()
    for step, why in sorted(report.wrong.items(), key=str):
        log.info("a delta render with the step %s falls back to a full render: %s", format_step(step), why)
    return report

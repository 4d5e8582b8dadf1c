"""Reading a chat template for content-dependence: where a message's content, or state that later
messages change, decides how an earlier message renders (docs/behaviour.md, "Exact renders").

A delta render renders only the newest messages after a cached prefix; it is exact while every
earlier message renders the same once later ones arrive. The start-up probe (probe.py) proves that
per step of message kinds, on texts it chose; a template that tests content (its length, a
substring, a comparison) can always be given texts the probe did not try. This module walks the
template's Jinja AST (jinja2's parser, with transformers' extensions) and finds, by role:

- `in_context`: roles whose rendering tests their content in the same condition as something any
  later message changes (`loop.last`, `loop.revindex`, `loop.length`, `loop.nextitem` of a loop over
  the messages, the `messages` list itself, state that the message count moves). Once the
  conversation holds such a message, no turn renders incrementally.
- `refused_adds`: roles whose arrival changes state set while looping over the messages (a
  `namespace` attribute, a variable set outside the loop) that some message's rendering tests or
  prints, when that state or the test on it depends on content. A delta adding one renders in full.
- `anchor_role`: content tested with state that only user messages set, whatever they hold (Qwen3's
  last user query): windows start at the last user message, which computes it as a full render does.
- `followed=False`: the template uses what the analysis cannot follow (include, import, extends,
  call blocks, a call passing content to a function it does not define, an unknown tag): every
  role is treated as content-dependent and nothing renders incrementally.

Left incremental: transforms of a message's own content (trim, lower, slicing, a test choosing how
that message prints). Presence and type tests (`is defined`, `is string`) read no content, nor does
a test for an added token's text (`startswith('<tool_response>')`): the renderer's guard keeps it out
of client text. An assistant message is never the last of a turn's context (its input follows), so
`loop.last` is constant for it; a window that ends with one renders in full.

Run once per template at start-up; the probe stays for what the AST cannot see (tokenizer merges
at cut points, the generation prompt)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Optional

from cluster.core.render.renderer import TemplateHazards
from cluster.core.render.template_shapes import ShapeReading

ROLES = frozenset({"system", "user", "assistant", "tool"})  # as chat_messages.py hands them to templates
CONTENT_FIELDS = frozenset({"content", "reasoning_content", "reasoning", "thinking", "text", "arguments"})
PRESENCE_TESTS = frozenset({"defined", "undefined", "none", "string", "mapping", "iterable", "sequence", "number",
                            "boolean", "true", "false", "integer", "float", "callable"})
LATER_LOOP_ATTRS = frozenset({"last", "revindex", "revindex0", "length", "nextitem"})
BUILTIN_CALLS = frozenset({"raise_exception", "namespace", "range", "dict", "strftime_now", "lipsum", "cycler",
                           "joiner"})


@dataclass(frozen=True)
class Flow:
    """What an expression's value depends on."""

    content: bool = False  # a message's content, read (not only tested for presence)
    later: bool = False  # something any later message changes
    state: frozenset = frozenset()  # state set while looping over the messages that it reads

    def __or__(self, other: "Flow") -> "Flow":
        return Flow(self.content or other.content, self.later or other.later, self.state | other.state)

    __add__ = __or__  # sum() of flows


NOTHING = Flow()


@dataclass(frozen=True)
class _Loop:
    over_messages: bool
    later_attrs: frozenset  # its `loop.*` attributes that later messages change


class _Walker(ShapeReading):
    def __init__(self) -> None:
        from jinja2 import nodes

        self.n = nodes
        self.hazards = TemplateHazards()
        self.macros: dict[str, object] = {}
        self.namespaces: set[str] = set()
        self.state_flow: dict[str, Flow] = {}  # state -> the flow of what was stored in it
        self.state_writers: dict[str, set[str]] = {}  # state -> roles whose messages set it
        self.state_reads: dict[str, set[str]] = {}  # state -> roles whose rendering reads it (in a test or print)
        self.loops: list[_Loop] = []
        self.message_vars: set[str] = set()
        self.in_macro = 0
        self.protected: tuple[str, ...] = ()  # added tokens' text, which never survives in client content
        self.state_tests: dict[frozenset, set[str]] = {}  # later-moving states tested with content -> roles

    # -- statements ---------------------------------------------------------------------
    def walk(self, body, roles: frozenset, env: dict, conds: Flow) -> None:
        n = self.n
        for node in body:
            if isinstance(node, (n.Include, n.Import, n.FromImport, n.Extends, n.CallBlock, n.Block)):
                self._unfollowed(node, type(node).__name__.lower())
            elif isinstance(node, n.Macro):
                self.macros[node.name] = node
            elif isinstance(node, n.Output):
                for expr in node.nodes:
                    self._read(self.flow(expr, env, roles), roles)
            elif isinstance(node, n.If):
                self._if(node, roles, env, conds)
            elif isinstance(node, n.For):
                self._for(node, roles, env, conds)
            elif isinstance(node, n.Assign) and self._call_name(node.node) == "namespace":
                for kw in node.node.kwargs:  # its attributes' first values (`namespace(last=messages|length)`)
                    name = f"{node.target.name}.{kw.key}"
                    self.state_flow[name] = self.state_flow.get(name, NOTHING) | self.flow(kw.value, env, roles)
            elif isinstance(node, n.Assign):
                self._assign(node.target, self.flow(node.node, env, roles), roles, env, conds)
            elif isinstance(node, n.AssignBlock):
                inner = dict(env)
                self.walk(node.body, roles, inner, conds)
                self._assign(node.target, Flow(content=True, later=conds.later), roles, env, conds)
            elif isinstance(node, (n.Scope, n.ScopedEvalContextModifier, n.EvalContextModifier, n.FilterBlock, n.With)):
                inner = dict(env)
                for target, value in zip(getattr(node, "targets", []), getattr(node, "values", [])):
                    self._bind(target, self.flow(value, env, roles), inner)
                self.walk(node.body, roles, inner, conds)
            elif isinstance(node, n.ExprStmt):
                self.flow(node.node, env, roles)
            elif isinstance(node, n.Stmt) and not isinstance(node, (n.Break, n.Continue)):
                self._unfollowed(node, type(node).__name__.lower())

    def _if(self, node, roles: frozenset, env: dict, conds: Flow) -> None:
        taken: set[str] = set()
        pure = True  # every test so far only chose a role: an `else` gets the roles left
        branches = [(node.test, node.body)] + [(e.test, e.body) for e in node.elif_]
        # Whether the branches print (or call a macro that may): else the test only decides state.
        shown = (self.n.Output, self.n.Call)
        prints = any(isinstance(stmt, shown) or next(stmt.find_all(shown), None) is not None
                     for stmt in [*node.body, *(s for e in node.elif_ for s in e.body), *node.else_])
        before = conds  # a branch runs under its enclosing tests and every earlier test of its chain
        for test, body in branches:
            these, only_role = self._roles_of(test, roles)
            under = before | self.flow(test, env, roles)
            self._test(test, under, these, prints)
            pure = pure and only_role
            taken |= these
            self.walk(body, these, env, under)
            before = under
        if node.else_:
            rest = roles - taken if pure else roles
            self.walk(node.else_, frozenset(rest), env, before)

    def _for(self, node, roles: frozenset, env: dict, conds: Flow) -> None:
        n = self.n
        over = self._iterates_messages(node.iter)
        iter_flow = self.flow(node.iter, env, roles) if not over else NOTHING
        plain = over and self._forward(node.iter)
        later = LATER_LOOP_ATTRS if plain else frozenset({"last", "revindex", "revindex0", "length", "nextitem",
                                                          "index", "index0", "first", "previtem", "cycle"})
        inner = dict(env)
        if over:
            if isinstance(node.target, n.Name):
                self.message_vars.add(node.target.name)
                inner[node.target.name] = NOTHING
        else:
            self._bind(node.target, iter_flow, inner)
        self.loops.append(_Loop(over, later if over else frozenset()))
        try:
            if node.test is not None:
                conds = conds | self.flow(node.test, inner, roles)
                self._test(node.test, conds, roles, True)
            self.walk(node.body, roles, inner, conds)
        finally:
            self.loops.pop()
        if node.else_:
            self.walk(node.else_, roles, env, conds)

    def _assign(self, target, value: Flow, roles: frozenset, env: dict, conds: Flow) -> None:
        n = self.n
        in_messages = any(loop.over_messages for loop in self.loops)
        stored = Flow(value.content or conds.content, self._later(value) or self._later(conds), value.state | conds.state)
        if isinstance(target, n.NSRef) or (isinstance(target, n.Name) and not self.loops and not self.in_macro):
            name = f"{target.name}.{target.attr}" if isinstance(target, n.NSRef) else target.name
            if isinstance(target, n.Name):
                env[target.name] = value
            if in_messages or isinstance(target, n.NSRef):
                self.state_flow[name] = self.state_flow.get(name, NOTHING) | stored
                if in_messages:
                    self.state_writers.setdefault(name, set()).update(roles)
            return
        self._bind(target, value, env)

    def _bind(self, target, value: Flow, env: dict) -> None:
        n = self.n
        if isinstance(target, n.Name):
            env[target.name] = value
        elif isinstance(target, n.Tuple):
            for item in target.items:
                self._bind(item, value, env)

    # -- findings ---------------------------------------------------------------------
    def _test(self, test, flow: Flow, roles: frozenset, prints: bool) -> None:
        """A condition inside a loop over the messages (`flow`: with its enclosing and earlier tests):
        content tested together with what any later message changes decides what a message of
        `roles` prints (`prints`: the branches print). State read there is decided by the messages
        that set it (`refused_adds`)."""
        if not any(loop.over_messages for loop in self.loops):
            return
        state_content = any(self.state_flow.get(s, NOTHING).content for s in flow.state)
        moving = frozenset(s for s in flow.state if self.state_flow.get(s, NOTHING).later)
        if flow.content and flow.later and prints:
            self._found(roles, "in_context", test, "content tested with what later messages change")
        elif flow.content and moving and prints:  # decided in finish(), by who moves that state
            self.state_tests.setdefault(moving, set()).update(roles)
        if flow.state and (flow.content or state_content):
            for s in flow.state:
                self.state_reads.setdefault(s, set()).update(roles)

    def _read(self, flow: Flow, roles: frozenset) -> None:
        """Printed state: a message prints what others' content stored."""
        for s in flow.state:
            if self.state_flow.get(s, NOTHING).content:
                self.state_reads.setdefault(s, set()).update(roles)

    def _found(self, roles: frozenset, kind: str, node, why: str) -> None:
        target = self.hazards.in_context if kind == "in_context" else self.hazards.refused_adds
        target.update(roles)
        self.hazards.where.append(f"line {getattr(node, 'lineno', '?')}: {'/'.join(sorted(roles))} messages: {why}")

    def _unfollowed(self, node, what: str) -> None:
        self.hazards.followed = False
        self.hazards.where.append(f"line {getattr(node, 'lineno', '?')}: cannot follow {what}")

    def finish(self) -> TemplateHazards:
        for states, roles in self.state_tests.items():
            writers = set().union(*(self.state_writers.get(s, set()) for s in states))
            if writers == {"user"} and not any(self.state_flow[s].content for s in states):
                # Set by user messages alone, whatever they hold (the last user query, say): a window that
                # starts at the last user message computes it as a full render does, and a user message
                # added renders in full.
                self.hazards.anchor_role = "user"
                self.hazards.refused_adds.add("user")
                self.hazards.where.append(f"{'/'.join(sorted(roles))} messages test content with "
                                          f"{'/'.join(sorted(states))}, which user messages set: windows start there")
            else:
                self._found(frozenset(roles), "in_context", None, f"content tested with {'/'.join(sorted(states))}, "
                            f"which {'/'.join(sorted(writers)) or 'the message count'} moves")
        for state, readers in self.state_reads.items():
            writers = self.state_writers.get(state, set())
            if readers and writers:
                self.hazards.refused_adds.update(writers)
                self.hazards.where.append(f"{'/'.join(sorted(writers))} messages set {state}, which, with content, "
                                          f"decides how {'/'.join(sorted(readers))} messages render")
        return self.hazards

    # -- expressions ------------------------------------------------------------------
    def flow(self, node, env: dict, roles: frozenset) -> Flow:
        n = self.n
        if isinstance(node, (n.Const, n.TemplateData)) or node is None:
            return NOTHING
        if isinstance(node, n.Name):
            if node.name == "messages":
                return Flow(later=True)
            if node.name in env:
                return env[node.name]
            if node.name in self.state_flow:  # what later messages change in it: `_later`, by its writers
                return Flow(state=frozenset({node.name}))
            return NOTHING
        if isinstance(node, (n.Getattr, n.Getitem)):
            attr = node.attr if isinstance(node, n.Getattr) else (
                node.arg.value if isinstance(node.arg, n.Const) and isinstance(node.arg.value, str) else None)
            if attr is not None:
                return self._attribute(node.node, attr, env, roles)
            if isinstance(node.node, n.Name) and node.node.name == "messages":
                return NOTHING if self._earlier_index(node.arg) else Flow(later=True)
            return self.flow(node.node, env, roles) | self.flow(node.arg, env, roles)
        if isinstance(node, n.Test):
            inner = self.flow(node.node, env, roles)
            if node.name in PRESENCE_TESTS:
                return Flow(later=inner.later, state=inner.state)
            return self._all([node.node, *node.args], env, roles)
        if isinstance(node, n.Call):
            return self._call(node, env, roles)
        return self._all(list(node.iter_child_nodes()), env, roles)

    def _later(self, flow: Flow) -> bool:
        """Whether a later message can change `flow`'s value, through the state it reads too."""
        return flow.later or any(self.state_flow.get(s, NOTHING).later for s in flow.state)

    def _protected_consts(self, args) -> bool:
        return bool(args) and all(isinstance(a, self.n.Const) and isinstance(a.value, str)
                                  and any(t in a.value for t in self.protected) for a in args)

    def _all(self, children, env: dict, roles: frozenset) -> Flow:
        return sum((self.flow(child, env, roles) for child in children), NOTHING)

    def _attribute(self, base, attr: str, env: dict, roles: frozenset) -> Flow:
        n = self.n
        if isinstance(base, n.Name) and base.name == "loop" and self.loops:
            loop = self.loops[-1]
            if attr == "last" and loop.over_messages and roles <= {"assistant"}:
                self.hazards.assumes_input_last = True
                return NOTHING
            return Flow(later=attr in loop.later_attrs)
        if isinstance(base, n.Name) and base.name in self.namespaces:
            return Flow(state=frozenset({f"{base.name}.{attr}"}))
        inner = self.flow(base, env, roles)
        return inner | Flow(content=True) if attr in CONTENT_FIELDS else inner

    def _call(self, node, env: dict, roles: frozenset) -> Flow:
        n = self.n
        args = self._all([*node.args, *(kw.value for kw in node.kwargs), node.dyn_args, node.dyn_kwargs], env, roles)
        name = self._call_name(node)
        if isinstance(node.node, n.Getattr):  # a method: content.startswith(...), items.split(...)
            if node.node.attr in ("startswith", "endswith") and self._protected_consts(node.args):
                return NOTHING  # client text holds no added token's text (the guard marks it): always false
            return self.flow(node.node.node, env, roles) | args
        if name in self.macros:
            if self.in_macro < 8:
                macro = self.macros[name]
                inner = dict(env)
                for i, param in enumerate(macro.args):
                    given = node.args[i] if i < len(node.args) else next(
                        (kw.value for kw in node.kwargs if kw.key == param.name), None)
                    inner[param.name] = self.flow(given, env, roles) if given is not None else NOTHING
                self.in_macro += 1
                try:
                    self.walk(macro.body, roles, inner, NOTHING)
                finally:
                    self.in_macro -= 1
            return args
        if name in BUILTIN_CALLS:
            return args
        if args.content:
            self._unfollowed(node, f"a call of {name or 'an expression'} with content")
        return args

    def _call_name(self, node) -> Optional[str]:
        n = self.n
        return node.node.name if isinstance(node, n.Call) and isinstance(node.node, n.Name) else None


def _parse(source: str):
    """The template's AST, as transformers compiles chat templates (jinja2.TemplateSyntaxError if none)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols

    class Generation(Extension):  # transformers' `{% generation %}` (assistant masks): its body renders as is
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]).parse(source)


def concatenates_arguments(source: str) -> bool:
    """Whether the template joins a call's `arguments` to text with `+` or `~` (DeepSeek-R1's does): it
    needs them as the JSON string a client sent, not parsed for `tojson` (which makes `+` a TypeError)."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = _parse(source)
    except jinja2.TemplateSyntaxError:
        return False

    def is_arguments(node) -> bool:
        return (isinstance(node, nodes.Getattr) and node.attr == "arguments") or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "arguments")

    return any(is_arguments(operand) for node in tree.find_all((nodes.Add, nodes.Concat))
               for operand in ((node.left, node.right) if isinstance(node, nodes.Add) else node.nodes))


def analyze(source: str, protected: Iterable[str] = ()) -> TemplateHazards:
    """The template's content-dependence, read from its AST (see the module docstring). `protected`:
    the added tokens' text, which the renderer's guard marks in whatever a client sends."""
    import jinja2
    from jinja2 import nodes

    digest = hashlib.sha256(source.encode()).hexdigest()
    try:
        tree = _parse(source)
    except jinja2.TemplateSyntaxError as err:
        return TemplateHazards(followed=False, where=[f"line {err.lineno}: cannot parse: {err.message}"],
                               digest=digest)
    walker = _Walker()
    walker.protected = tuple(t for t in protected if t)
    walker.namespaces = {a.target.name for a in tree.find_all(nodes.Assign)
                         if isinstance(a.target, nodes.Name) and isinstance(a.node, nodes.Call)
                         and isinstance(a.node.node, nodes.Name) and a.node.node.name == "namespace"}
    try:
        # Twice: state set late in the template (a reverse pre-pass, a macro) is known on the second pass.
        for _ in range(2):
            walker.hazards = TemplateHazards(digest=digest)
            walker.state_reads, walker.state_tests = {}, {}
            walker.walk(tree.body, ROLES, {}, NOTHING)
        return walker.finish()
    except (RecursionError, AttributeError, TypeError, ValueError) as err:  # a shape this walk does not know
        return TemplateHazards(followed=False, where=[f"cannot follow the template: {type(err).__name__}"],
                               digest=digest)

"""What shape a chat template's Jinja nodes have: which roles a test lets through, whether a loop
runs over the messages and from their start, whether an index names an earlier message. Read by
the template analysis (template_analysis.py), whose walker holds `n` (jinja2.nodes), the loop
variables that stand for a message, and the loops it is in."""

from __future__ import annotations


class ShapeReading:
    n: object  # jinja2.nodes
    message_vars: set
    loops: list

    def _roles_of(self, test, roles: frozenset) -> tuple[frozenset, bool]:
        """The roles a test lets through, and whether it tests nothing but the role."""
        n = self.n
        if isinstance(test, n.Or):
            left, lp = self._roles_of(test.left, roles)
            right, rp = self._roles_of(test.right, roles)
            return left | right, lp and rp
        if isinstance(test, n.And):
            left, lp = self._roles_of(test.left, roles)
            right, rp = self._roles_of(test.right, roles)
            return left & right, lp and rp
        if isinstance(test, n.Compare) and len(test.ops) == 1 and self._is_role(test.expr):
            value = test.ops[0].expr
            names = ({value.value} if isinstance(value, n.Const) and isinstance(value.value, str) else
                     {v.value for v in value.items if isinstance(v, n.Const)} if isinstance(value, (n.List, n.Tuple))
                     else None)
            if names is not None:
                op = test.ops[0].op
                if op in ("eq", "in"):
                    return roles & frozenset(names), True
                if op in ("ne", "notin"):
                    return roles - frozenset(names), True
        return roles, False

    def _is_role(self, node) -> bool:
        n = self.n
        attr = node.attr if isinstance(node, n.Getattr) else (
            node.arg.value if isinstance(node, n.Getitem) and isinstance(node.arg, n.Const) else None)
        return attr == "role" and isinstance(node.node, n.Name) and node.node.name in self.message_vars

    def _iterates_messages(self, node) -> bool:
        n = self.n
        while isinstance(node, (n.Getitem, n.Filter)):
            node = node.node
        return isinstance(node, n.Name) and node.name == "messages"

    def _forward(self, node) -> bool:
        """`messages`, or `messages[k:]` with a constant k >= 0: loop indexes count from the start."""
        n = self.n
        if isinstance(node, n.Name):
            return True
        if isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice) and isinstance(node.node, n.Name):
            s = node.arg
            return (s.stop is None and (s.step is None) and
                    (s.start is None or isinstance(s.start, n.Const) and isinstance(s.start.value, int)
                     and s.start.value >= 0))
        return False

    def _earlier_index(self, arg) -> bool:
        """`messages[k]` (k >= 0 constant) or `messages[loop.index0 - k]`: a message no later one moves."""
        n = self.n
        if isinstance(arg, n.Const):
            return isinstance(arg.value, int) and arg.value >= 0
        if isinstance(arg, n.Sub) and isinstance(arg.right, n.Const):
            arg = arg.left
        return (isinstance(arg, n.Getattr) and arg.attr == "index0" and isinstance(arg.node, n.Name)
                and arg.node.name == "loop" and bool(self.loops) and "index0" not in self.loops[-1].later_attrs)

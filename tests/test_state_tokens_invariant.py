"""The invariant a checkpoint's snapshot rests on (`rollout.state_tokens`): a sample's or prompt's
token lists are only ever extended (`.extend`, `.append`, `+=`) or replaced by new lists
(`Sample.reset`), never changed in place, and the routing is immutable bytes. The snapshot records
each list and its length under the producer's pause and reads `lst[:n]` later; an in-place change
(`del s.response_ids[k:]`, a slice assignment, `.clear()`, `.pop()`, ...) made after the pause would
silently change the checkpoint. Reading the live lists instead of copying them made the save's pause
O(lists); this scan keeps that safe for code written later.

An AST scan of `megatron_bapo/`, so it sees code no test runs. It catches, on an attribute named like
a token field (`<anything>.response_ids`) or on a local name bound to one in the same function
(`ids = s.response_ids`): item or slice assignment and deletion, augmented assignment other than
`+=`, the in-place list methods, and `random.shuffle`. It does not follow a list passed to another
function or stored elsewhere; the planted examples below show what it catches.
"""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_bapo

FIELDS = frozenset({"prompt_ids", "response_ids", "response_logprobs", "response_versions", "routed_experts",
                    "teacher_logprobs"})
IN_PLACE = frozenset({"clear", "pop", "insert", "remove", "sort", "reverse", "__setitem__", "__delitem__",
                      "__imul__", "shuffle"})


def _token_attr(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr in FIELDS


class _Scan(ast.NodeVisitor):
    """Every in-place change of a token list in one module: (line, what)."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []
        self.aliases: list[set[str]] = [set()]

    def _is_tokens(self, node: ast.AST) -> bool:
        return _token_attr(node) or (isinstance(node, ast.Name) and node.id in self.aliases[-1])

    def _flag(self, node: ast.AST, what: str) -> None:
        self.found.append((node.lineno, f"{what}: {ast.unparse(node)[:80]}"))

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.aliases.append(set())
        self.generic_visit(node)
        self.aliases.pop()

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._store(target, node)
            if isinstance(target, ast.Name):  # `ids = s.response_ids` makes an alias; rebinding it ends it
                (self.aliases[-1].add if _token_attr(node.value) else self.aliases[-1].discard)(target.id)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._store(node.target, node)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._store(node.target, node)
        if self._is_tokens(node.target) and not isinstance(node.op, ast.Add):
            self._flag(node, "augmented assignment other than += (in place)")
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            if isinstance(target, ast.Subscript) and self._is_tokens(target.value):
                self._flag(node, "del of items")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in IN_PLACE:
            if self._is_tokens(func.value):
                self._flag(node, f".{func.attr}()")
            elif node.args and self._is_tokens(node.args[0]):  # list.sort(x), random.shuffle(x)
                self._flag(node, f"{func.attr}() of a token list")
        self.generic_visit(node)

    def _store(self, target: ast.AST, node: ast.AST) -> None:
        if isinstance(target, ast.Subscript) and self._is_tokens(target.value):
            self._flag(node, "item or slice assignment")
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self._store(element, node)


def in_place_changes(source: str) -> list[tuple[int, str]]:
    scan = _Scan()
    scan.visit(ast.parse(source))
    return scan.found


PLANTED = """
def f(s, k, ids):
    del s.response_ids[k:]
    s.response_logprobs[2:4] = [0.0, 0.0]
    s.response_versions[0] = 3
    s.prompt_ids.clear()
    s.response_ids.pop()
    s.sample.response_ids.insert(0, 1)
    s.response_versions.sort()
    s.response_ids *= 0
    mine = s.response_ids
    mine.reverse()
    random.shuffle(s.response_logprobs)
    a, s.response_ids[1] = 1, 2
"""

ALLOWED = """
def g(s, other, res):
    s.response_ids.extend(res.output_ids)
    s.response_versions.append(3)
    s.response_ids += [1]
    s.routed_experts += b"ab"
    s.response_ids, s.response_logprobs = [], []
    ids = s.response_ids[:4]
    other[0] = s.response_ids
    mine = list(s.response_ids)
    mine.pop()
    x = s.response_ids
    x = []
    x.clear()
"""


def test_the_scan_catches_each_kind_of_in_place_change():
    """Keeps the scan honest: each planted line is found, the append-only and replacing ones are not."""
    found = in_place_changes(PLANTED)
    assert sorted(line for line, _ in found) == [3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14], found
    assert in_place_changes(ALLOWED) == []


def test_no_module_changes_a_token_list_in_place():
    root = Path(megatron_bapo.__file__).parent
    found = [f"{path.relative_to(root.parent)}:{line}: {what}" for path in sorted(root.rglob("*.py"))
             for line, what in in_place_changes(path.read_text(encoding="utf-8"))]
    assert not found, ("token lists may only be extended or replaced (rollout.state_tokens: a checkpoint reads them "
                       "after its pause):\n" + "\n".join(found))

"""The server uses only the conversation core's public API (issue #25 item 3).

An AST check over ``chatcli/server/``: no ``chatcli.backends`` or ``llama_cpp`` import (the engine comes
through the ``Session``, and what only llama.cpp can do, such as building a grammar, through the ``Backend``
protocol), no ``Session.local_engine`` (the concrete engine: the ``Session`` has the calls the server
needs), no private (``_x``) name of another package, no ``ConversationDir`` built by hand (the store
hands them out), and on a conversation only its public operations and views: never its internals (``r``,
``dir``, ``log``, ``engine``...), never an assignment to one of its attributes.

Which expressions are conversations is found as the server's code names them: ``conv`` and the names
bound from a conversation, ``.conv`` / ``.conversation`` attributes, parameters and functions annotated
``Conversation``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from chatcli.core.conversation import Conversation

pytestmark = pytest.mark.fast

SERVER = Path(__file__).resolve().parent.parent / "chatcli" / "server"

# Conversation attributes that are its machinery, not its interface: what a front end reaching for them
# would couple itself to (the transcript's replay, the state log, the files, the backend, the template).
INTERNALS = frozenset({"r", "engine", "backend", "dir", "transcript", "log", "template", "after_save", "identity"})
# Instance attributes (set in __init__) that are part of the interface, to read.
PUBLIC_FIELDS = frozenset({"meta", "last_stats", "session_stats", "sampling", "max_tokens", "reserve"})
CONV_ATTRS = frozenset({"conv", "conversation"})


def allowed_attributes() -> frozenset[str]:
    names = {n for k in Conversation.__mro__ if k.__module__.startswith("chatcli.") for n in vars(k)}
    return frozenset({n for n in names if not n.startswith("_")} - INTERNALS | PUBLIC_FIELDS)


def _annotated_conv(node: ast.expr | None) -> bool:
    """Annotated as a conversation (``Conversation``, ``Conversation | None``), not a container of one."""
    return node is not None and ast.unparse(node).strip("'\"").replace(" | None", "") == "Conversation"


class _Checker:
    def __init__(self, tree: ast.Module, allowed: frozenset[str]) -> None:
        self.tree = tree
        self.allowed = allowed
        self.conv_names: set[str] = {"conv"}
        self.conv_funcs: set[str] = set()  # functions and methods that return a conversation
        self.modules: set[str] = set()  # names bound to modules of chatcli outside the server
        self.problems: list[str] = []

    def is_conv(self, e: ast.expr) -> bool:
        if isinstance(e, ast.Name):
            return e.id in self.conv_names
        if isinstance(e, ast.Attribute):
            return e.attr in CONV_ATTRS
        if isinstance(e, ast.BoolOp):
            return any(self.is_conv(v) for v in e.values)
        if isinstance(e, ast.Call):
            f = e.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            return name in self.conv_funcs
        return False

    def run(self) -> list[str]:
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                ret = ast.unparse(node.returns).replace(" | None", "") if node.returns else ""
                if ret == "Conversation" or ret.startswith("tuple[Conversation,"):
                    self.conv_funcs.add(node.name)  # a tuple's first element: see the assignments below
                for a in [*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs]:
                    if _annotated_conv(a.annotation):
                        self.conv_names.add(a.arg)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _annotated_conv(node.annotation):
                self.conv_names.add(node.target.id)
        # Names bound from a conversation are conversations (``conv = adopted or self._open(...)``).
        changed = True
        while changed:
            changed = False
            for node in ast.walk(self.tree):
                if not isinstance(node, (ast.Assign, ast.NamedExpr)):
                    continue
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs = list(zip(t.elts, node.value.elts, strict=False))  # conv, tail = prep.conv, prep.tail
                    elif isinstance(t, ast.Tuple):
                        pairs = [(t.elts[0], node.value)]  # conv, created, ... = self._acquire(...)
                    else:
                        pairs = [(t, node.value)]
                    for x, v in pairs:
                        if isinstance(x, ast.Name) and x.id not in self.conv_names and self.is_conv(v):
                            self.conv_names.add(x.id)
                            changed = True
        for node in ast.walk(self.tree):
            self.check_import(node)
            if isinstance(node, ast.Attribute):
                self.check_attribute(node)
            elif isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "ConversationDir":
                self.problems.append(f"line {node.lineno}: ConversationDir built by hand (use ConversationStore.dir)")
        return self.problems

    def check_import(self, node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                self._module(a.name, node.lineno)
                if a.name.startswith("chatcli.") and not a.name.startswith("chatcli.server"):
                    self.modules.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            self._module(node.module, node.lineno)
            if node.module.startswith("chatcli") and not node.module.startswith("chatcli.server"):
                for a in node.names:
                    if a.name.startswith("_"):
                        self.problems.append(f"line {node.lineno}: private name {a.name} from {node.module}")
                    elif a.name.islower():
                        self.modules.add(a.asname or a.name)  # perhaps a module (``from chatcli.core import x``)

    def _module(self, name: str, line: int) -> None:
        if name == "chatcli.backends" or name.startswith("chatcli.backends."):
            self.problems.append(f"line {line}: imports {name} (the engine comes through the Session)")
        if name == "llama_cpp" or name.startswith("llama_cpp."):
            self.problems.append(f"line {line}: imports {name} (only a backend touches llama.cpp)")

    def check_attribute(self, node: ast.Attribute) -> None:
        if node.attr == "local_engine":
            self.problems.append(f"line {node.lineno}: the concrete engine ({ast.unparse(node)}): use the "
                                 "Session's or the Backend's calls")
        if isinstance(node.value, ast.Name) and node.value.id in self.modules and node.attr.startswith("_"):
            self.problems.append(f"line {node.lineno}: private name {node.value.id}.{node.attr}")
        if not self.is_conv(node.value):
            return
        what = ast.unparse(node)
        if isinstance(node.ctx, ast.Store):
            self.problems.append(f"line {node.lineno}: assigns a conversation's attribute ({what})")
        elif node.attr not in self.allowed:
            self.problems.append(f"line {node.lineno}: conversation internals ({what})")


def problems_in(source: str) -> list[str]:
    return _Checker(ast.parse(source), allowed_attributes()).run()


@pytest.mark.parametrize("path", sorted(SERVER.glob("*.py")), ids=lambda p: p.name)
def test_the_server_uses_only_the_public_core_api(path: Path) -> None:
    found = problems_in(path.read_text("utf-8"))
    assert found == [], f"{path.name}:\n  " + "\n  ".join(found)


def test_the_check_sees_each_kind_of_reach_around() -> None:
    """The check above can fail: each way of reaching around the core's API is seen."""
    src = '''
from chatcli.backends.llamacpp import Engine
from chatcli.core.files.store import _ID_RE, ConversationDir
from chatcli.core import conversation
from chatcli.core.conversation import Conversation

def f(c: Conversation, slot: object) -> None:
    c.r.active
    slot.conv.dir.lock()
    other = slot.conv
    other.engine.n_past
    c.meta = {}
    ConversationDir(root / cid)
    conversation._eval
    c.send("hi")
    c.messages
    c.lock()
    def g() -> None:
        import chatcli.backends.cpuload
        from llama_cpp import llama_grammar
        import llama_cpp.llama_chat_format
    session.local_engine.sibling()
'''
    found = problems_in(src)
    for needle in ("imports chatcli.backends.llamacpp", "private name _ID_RE", "(c.r)", "(slot.conv.dir)",
                   "(other.engine)", "assigns a conversation's attribute (c.meta)", "ConversationDir built by hand",
                   "private name conversation._eval", "imports chatcli.backends.cpuload",
                   "imports llama_cpp (only", "imports llama_cpp.llama_chat_format",
                   "the concrete engine (session.local_engine)"):
        assert any(needle in p for p in found), (needle, found)
    assert len(found) == 12, found  # send, messages and lock are the public API

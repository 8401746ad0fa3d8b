"""The docs keep up with the code: docs/troubleshooting.md lists every reason the operator and
the worker report, and every relative link in the Markdown docs reaches a file and a heading.

Reasons are collected from the source with ast (Event(...) and post_event(...) calls, condition
reasons, the phases, the P2P failure kinds, the kubelet reasons quoted in the status), so a new
reason fails here until the troubleshooting page says what it means and what to do. Runtime:
about 0.3 s.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from weightlift.api.model import Phase
from weightlift.api.worker import WorkerPhase

REPO = Path(__file__).resolve().parents[2]
OPERATOR = REPO / "weightlift" / "operator"
TROUBLESHOOTING = REPO / "docs" / "troubleshooting.md"


class Unresolved(Exception):
    """A reason the collector cannot read: teach it the new form rather than skip it."""


class ReasonCollector:
    """Every string a reason can take at each place the operator emits one, in one module."""

    def __init__(self, tree: ast.Module, constants: dict[str, set[str]]) -> None:
        self.tree = tree
        self.constants = constants  # module-level string constants of the operator, by name
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node

    def reasons(self) -> set[str]:
        found: set[str] = set()
        for node in ast.walk(self.tree):
            for expr in self._reason_exprs(node):
                found |= self.strings(expr, node)
        return found

    def _reason_exprs(self, node: ast.AST) -> Iterator[ast.expr]:
        if isinstance(node, ast.Call):
            name = _called(node)
            keyword = next((k.value for k in node.keywords if k.arg == "reason"), None)
            if name in ("Event", "Condition") and keyword is not None:
                yield keyword
            elif name == "Event" and len(node.args) >= 2:
                yield node.args[1]
            elif name == "post_event":
                # state.post_event(involved, type, reason, message);
                # kube.post_event(core, involved, type, reason, message)
                at = 3 if _receiver(node) == "kube" else 2
                yield keyword if keyword is not None else node.args[at]
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "reason":
                    yield value
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for i, part in enumerate(_flatten(target)):
                    if isinstance(part, ast.Attribute) and part.attr == "reason":
                        yield _nth(node.value, i, len(_flatten(target)))

    def strings(self, expr: ast.expr, at: ast.AST) -> set[str]:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return {expr.value}
        if isinstance(expr, ast.IfExp):
            return self.strings(expr.body, at) | self.strings(expr.orelse, at)
        if isinstance(expr, ast.BoolOp):
            return set().union(*(self.strings(v, at) for v in expr.values))
        if isinstance(expr, ast.JoinedStr) and _about_phase(expr):
            # f"Phase{phase}": an Event per phase the planner names (EVENT_PHASES' members)
            prefix = "".join(str(v.value) for v in expr.values if isinstance(v, ast.Constant))
            return {prefix + p for p in self._event_phases()}
        if isinstance(expr, ast.Call) and _called(expr) == "str" and _about_phase(expr):
            return {p.value for p in Phase}
        if isinstance(expr, ast.Attribute):
            if expr.attr == "reason":
                return set()  # forwards a reason collected where it was made (event.reason)
            if expr.attr in self.constants:
                return self.constants[expr.attr]
        if isinstance(expr, ast.Name):
            return self._name(expr.id, at)
        raise Unresolved(f"line {expr.lineno}: {ast.unparse(expr)}")

    def _name(self, name: str, at: ast.AST) -> set[str]:
        func = self._enclosing_function(at)
        if func is not None:
            if name in {a.arg for a in (*func.args.args, *func.args.kwonlyargs)}:
                return set()  # a parameter: a helper forwarding its caller's reason
            found = self._assigned(name, func)
            if found is not None:
                return found
        if name in self.constants:
            return self.constants[name]
        raise Unresolved(f"{name} at line {getattr(at, 'lineno', '?')}")

    def _assigned(self, name: str, func: ast.AST) -> set[str] | None:
        found: set[str] | None = None
        for node in ast.walk(func):
            values: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    parts = _flatten(target)
                    for i, part in enumerate(parts):
                        if isinstance(part, ast.Name) and part.id == name:
                            values.append(_nth(node.value, i, len(parts)))
            elif isinstance(node, ast.For):
                parts = _flatten(node.target)
                for i, part in enumerate(parts):
                    if isinstance(part, ast.Name) and part.id == name:
                        values.extend(self._rows(node.iter, func, i, len(parts)))
            for value in values:
                found = (found or set()) | self.strings(value, node)
        return found

    def _rows(self, table: ast.expr, func: ast.AST, i: int, width: int) -> list[ast.expr]:
        """The i-th column of a table of tuples a for loop unpacks (`for a, b in table`)."""
        if isinstance(table, ast.Name):
            for node in ast.walk(func):
                if (
                    isinstance(node, ast.AnnAssign | ast.Assign)
                    and any(
                        isinstance(t, ast.Name) and t.id == table.id
                        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    )
                    and node.value is not None
                ):
                    table = node.value
                    break
        if isinstance(table, ast.List | ast.Tuple):
            return [_nth(row, i, width) for row in table.elts]
        raise Unresolved(f"a table at line {table.lineno}: {ast.unparse(table)}")

    def _enclosing_function(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                return node
        return None

    def _event_phases(self) -> set[str]:
        from weightlift.operator.planning import EVENT_PHASES

        return {str(p) for p in EVENT_PHASES}


def _called(call: ast.Call) -> str:
    func = call.func
    return (
        func.id
        if isinstance(func, ast.Name)
        else func.attr
        if isinstance(func, ast.Attribute)
        else ""
    )


def _receiver(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.value.id
    return ""


def _about_phase(expr: ast.expr) -> bool:
    return any(
        isinstance(n, ast.Name | ast.Attribute) and "phase" in ast.unparse(n)
        for n in ast.walk(expr)
    )


def _flatten(target: ast.expr) -> list[ast.expr]:
    return list(target.elts) if isinstance(target, ast.Tuple) else [target]


def _nth(value: ast.expr, i: int, width: int) -> ast.expr:
    if width == 1:
        return value
    if isinstance(value, ast.Tuple) and len(value.elts) == width:
        return value.elts[i]
    raise Unresolved(f"unpacking at line {value.lineno}: {ast.unparse(value)}")


def _string_constants(tree: ast.Module) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)):
            continue
        if isinstance(value := node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, set()).add(value)
    return found


def operator_reasons(sources: dict[str, str]) -> set[str]:
    """Event and condition reasons in these operator modules (name -> source text)."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    constants: dict[str, set[str]] = {}
    for tree in trees.values():
        for key, values in _string_constants(tree).items():
            constants.setdefault(key, set()).update(values)
    found: set[str] = set()
    for name, tree in trees.items():
        try:
            found |= ReasonCollector(tree, constants).reasons()
        except Unresolved as exc:
            raise Unresolved(f"{name}: {exc}") from exc
    return found


def peer_failure_kinds() -> set[str]:
    """PeerFailed's kinds: its default and every kind= a raise names."""
    tree = ast.parse((REPO / "weightlift/worker/p2p/target.py").read_text())
    kinds: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "PeerFailed":
            init = next(n for n in node.body if isinstance(n, ast.FunctionDef))
            kinds |= {str(d.value) for d in init.args.kw_defaults if isinstance(d, ast.Constant)}
        if isinstance(node, ast.Call) and _called(node) == "PeerFailed":
            kinds |= {
                str(k.value.value)
                for k in node.keywords
                if k.arg == "kind" and isinstance(k.value, ast.Constant)
            }
    return kinds


# bundle/launch.sh's `refuse Reason ...`, copy.sh's `reason=Reason`, probe.py's
# emit("refuse", "Reason", ...): an injected worker's refusals, named in the replica's status.
BUNDLE_REASON = re.compile(r'(?:^\s*|\|\| |&& )refuse (\w+)|reason=(\w+)|"refuse",\s*"(\w+)"', re.M)


def bundle_reasons() -> set[str]:
    found: set[str] = set()
    for path in sorted((REPO / "bundle").iterdir()):
        if path.suffix in (".sh", ".py"):
            for match in BUNDLE_REASON.finditer(path.read_text()):
                found.add(next(g for g in match.groups() if g))
    return found


def all_reasons() -> dict[str, set[str]]:
    from weightlift.operator.reconcile import STUCK_REASONS

    sources = {p.name: p.read_text() for p in sorted(OPERATOR.glob("*.py"))}
    return {
        "operator Event/condition reason": operator_reasons(sources),
        "ModelDeployment phase": {p.value for p in Phase},
        "worker phase": {p.value for p in WorkerPhase},
        "P2P failure kind": peer_failure_kinds(),
        "kubelet reason quoted in the status": set(STUCK_REASONS),
        "injected worker's refusal (bundle/)": bundle_reasons(),
    }


def test_the_collector_sees_the_reasons_it_must() -> None:
    found = all_reasons()
    operator = found["operator Event/condition reason"]
    # Every form: Event(...) literal, f"Phase{phase}", post_event with a module constant, the
    # conditions' table (tuple assignment, nested IfExp, str(phase)), an attribute assignment.
    assert {
        "ReplicaRestarted",
        "PhaseReady",
        "PhaseWaitingForSource",
        "NodeCompileStoreOff",
        "ReconcileError",
        "AllScheduled",
        "Unschedulable",
        "ProbeFailed",
        "Probing",
        "Loaded",
        "Degraded",
        "InvalidSpec",
        "FailedCreate",
    } <= operator
    assert "Pending" in operator  # the Ready condition's phase reason and Scheduled's own
    assert {"checksum", "emulated", "transfer", "stall"} <= found["P2P failure kind"]
    assert {
        "BundleIncomplete",
        "NoWritableVolume",
        "NoPython",
        "WrongPython",
        "ProbeFailed",
        "NoSpaceForWorker",
        "CopyFailed",
        "NoVLLM",
        "UnsupportedVLLM",
        "MissingDependency",
        "NoTritonServer",
        "NoPythonBackend",
    } == found["injected worker's refusal (bundle/)"]


def test_the_collector_finds_a_new_reason_and_refuses_what_it_cannot_read() -> None:
    new = 'def f(x):\n    result.events.append(Event("Warning", "BrandNew", "m"))\n'
    assert operator_reasons({"new.py": new}) == {"BrandNew"}
    condition = 'def f(ok):\n    r = "Up" if ok else "Down"\n    return Condition(reason=r)\n'
    assert operator_reasons({"c.py": condition}) == {"Up", "Down"}
    opaque = 'def f():\n    return Event("Normal", compute(), "m")\n'
    with pytest.raises(Unresolved):
        operator_reasons({"opaque.py": opaque})


def test_troubleshooting_lists_every_reason() -> None:
    page = TROUBLESHOOTING.read_text()
    missing = {
        what: sorted(r for r in reasons if f"`{r}`" not in page)
        for what, reasons in all_reasons().items()
    }
    missing = {what: names for what, names in missing.items() if names}
    assert not missing, f"docs/troubleshooting.md does not explain (as `Reason`): {missing}"


# ---- links ----------------------------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def markdown_files() -> list[Path]:
    return [REPO / "README.md", REPO / "ARCHITECTURE.md", *sorted((REPO / "docs").rglob("*.md"))]


def prose(path: Path) -> list[str]:
    """The lines outside fenced code blocks (links and headings in code are not Markdown's)."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose(path):
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = anchor(m.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_anchor_matches_github() -> None:
    assert anchor("A real node (`--node kubelet`)") == "a-real-node---node-kubelet"
    assert anchor("P2P between GPUs: cuda_ipc on a node, GPUDirect RDMA across nodes") == (
        "p2p-between-gpus-cuda_ipc-on-a-node-gpudirect-rdma-across-nodes"
    )


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = []
    for line in prose(doc):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file_part, _, fragment = target.partition("#")
            path = (doc.parent / file_part).resolve() if file_part else doc
            if not path.exists():
                broken.append(f"{target}: no such file")
            elif fragment and path.suffix == ".md" and fragment not in anchors(path):
                broken.append(f"{target}: no heading #{fragment} in {path.name}")
    assert not broken, f"{doc.relative_to(REPO)}: {broken}"

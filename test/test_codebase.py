"""The codebase's own rules, checked on every run: private torch internals only in the integration
package, no import cycles inside the library, modules of at most 700 lines, documentation within its
size limits, and a repository that neither narrates its history nor points outside itself."""

import ast
import os
import re
import subprocess

from torch.testing._internal.common_utils import run_tests, TestCase

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "torch_fsdp_offload")
INTEGRATION = os.path.join(PACKAGE, "_integration")
# Where torch's private internals may be read: the FSDP glue, the leaf helpers, and the optimizer's
# read guards and gradient watch (each names its internals in docs/design.md).
PRIVATE_TORCH_ALLOWED = (
    INTEGRATION + os.sep,
    os.path.join(PACKAGE, "_helpers") + os.sep,
    os.path.join(PACKAGE, "optimizer", "pending_updates.py"),
    os.path.join(PACKAGE, "optimizer", "dtensor_grads.py"),
)
MAX_MODULE_LINES = 700

# Spellings of torch's private internals: FSDP2's and FSDP1's private modules, torch._C, the
# private attributes of tensors and FSDP objects we read, and the pin_memory swap.
PRIVATE_TORCH = re.compile(
    r"\btorch(?:\.\w+)*\._(?!_)\w+|_fully_shard\b|_fsdp_param|_fsdp_state|_fsdp_common|_runtime_utils|"
    r"_flat_param\b|_sharded_param_data|_sharded_local_tensor|\._local_tensor\b|\._version\b|"
    r"Tensor\.pin_memory\s*=|_get_fsdp_state|_pin_memory_utils|from torch(?:\.\w+)* import _\w+"
)
# Spelled with character classes so that these patterns do not match their own source.
HISTORY = re.compile(
    r"\bs[e]ssions?\b|\br[o]und [0-9]+\b|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|"
    r"eleventh|twelfth|thirteenth|fourteenth|fifteenth)\s+s[e]ssion\b|\b(?:fifth|sixth|seventh|eighth|ninth|"
    r"tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth)\s+(?:r[u]n|r[o]und)s?\b",
    re.IGNORECASE,
)
OUTSIDE = re.compile(r"\.\./s[h]ared|s[h]ared/reference|s[h]ared/design|fsdp-internals\.md|anchors\.md")


def _library_modules() -> dict[str, str]:
    modules = {}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                relative = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
                modules[relative.removesuffix(".__init__")] = path
    return modules


def _tracked_files() -> list[str]:
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return []
    return [line for line in listed.stdout.splitlines() if line]


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every import cycle a depth-first walk of ``graph`` meets, as ``a -> b -> a``."""
    cycles: list[str] = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def _imports(path: str, module: str, known: set[str]) -> set[str]:
    """The library modules ``module`` imports, at module level or inside functions."""
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


class TestCodebase(TestCase):
    def test_private_torch_internals_only_where_allowed(self):
        offenders = []
        for module, path in _library_modules().items():
            if path.startswith(PRIVATE_TORCH_ALLOWED):
                continue
            for number, line in enumerate(open(path, encoding="utf-8"), 1):
                if PRIVATE_TORCH.search(line.split("#", 1)[0]):
                    offenders.append(f"{module}:{number}: {line.strip()}")
        self.assertEqual(offenders, [], "private torch internals outside the modules allowed to read them")

    def test_planner_platform_report_train_and_benchmarks_use_public_names(self):
        private = re.compile(r"torch_fsdp_offload(?:\.\w+)*\._\w+|from torch_fsdp_offload(?:\.\w+)* import \(?\s*_\w+")
        users = [os.path.join(PACKAGE, "planner"), os.path.join(PACKAGE, "platform", "cli.py"),
                 os.path.join(PACKAGE, "train.py"), os.path.join(PACKAGE, "__main__.py"), os.path.join(ROOT, "benchmarks")]
        offenders = []
        for user in users:
            paths = [user] if user.endswith(".py") else [
                os.path.join(directory, name) for directory, _, names in os.walk(user) for name in names if name.endswith(".py")
            ]
            for path in paths:
                for number, line in enumerate(open(path, encoding="utf-8"), 1):
                    if private.search(line.split("#", 1)[0]):
                        offenders.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
        self.assertEqual(offenders, [])

    def test_no_import_cycles(self):
        modules = _library_modules()
        known = set(modules)
        graph = {module: _imports(path, module, known) for module, path in modules.items()}
        # A package's __init__ re-exporting its submodules is not a cycle with them.
        for module in graph:
            graph[module] = {m for m in graph[module] if not module.startswith(m + ".")}
        self.assertEqual(_cycles(graph), [])

    def test_no_import_cycle_between_parts(self):
        # A part is a subpackage or a top-level module: collapsed so, imports still go one way.
        modules = _library_modules()
        known = set(modules)

        def part(module: str) -> str:
            return ".".join(module.split(".")[:2])

        graph: dict[str, set[str]] = {}
        for module, path in modules.items():
            targets = {part(m) for m in _imports(path, module, known)} - {part(module), "torch_fsdp_offload"}
            graph.setdefault(part(module), set()).update(targets)
        self.assertEqual(_cycles(graph), [])

    def test_module_level_state_is_process_wide_only(self):
        # State lives on the objects that own it: a module keeps at module level only what is one
        # per process by nature, each named here with why.
        expected = {
            "torch_fsdp_offload._integration.installation": {"installed", "_holders"},  # torch's patches are process-wide
            "torch_fsdp_offload.memory": {"_pinned_pool", "_managed_lock", "_managed_totals", "_managed_ranges"},  # the host allocator, like torch's
            "torch_fsdp_offload.transfer": {"_engines", "_engines_lock"},  # one copy engine per device, like CUDA's streams
            "torch_fsdp_offload.platform": {"_DETECTIONS"},  # facts about this machine, read once
            "torch_fsdp_offload.platform.bandwidth": {"_BANDWIDTHS"},
            # per thread; and one guarding subclass per tensor class, as classes are per process
            "torch_fsdp_offload.optimizer.pending_updates": {"_stepping", "_guarded_classes"},
            "torch_fsdp_offload.optimizer.dtensor_grads": {"_lock", "NORM_READS"},  # process-wide counts
            "torch_fsdp_offload.cpu_copy_stream": {"misuses_detected", "_overrides"},  # the test engine's
        }
        found: dict[str, set[str]] = {}
        library = "\n".join(open(path, encoding="utf-8").read() for path in _library_modules().values())
        for module, path in _library_modules().items():
            source = open(path, encoding="utf-8").read()
            for node in ast.parse(source).body:
                if isinstance(node, ast.AnnAssign):
                    targets, value = [node.target], node.value
                elif isinstance(node, ast.Assign):
                    targets, value = node.targets, node.value
                else:
                    continue
                constructor = ast.unparse(value.func).split(".")[-1] if isinstance(value, ast.Call) else None
                # Registries, locks and thread-locals; and containers the library writes to (a table
                # it only reads is a constant).
                registry = constructor in {"WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "Lock", "RLock", "local", "_HostPool"}
                container = isinstance(value, (ast.List, ast.Dict, ast.Set)) or constructor in {"set", "dict", "list", "defaultdict"}
                for target in targets:
                    if not isinstance(target, ast.Name) or target.id == "__all__":
                        continue
                    written = re.search(
                        rf"\b{target.id}(\[[^\]]*\]\s*[-+]?=(?!=)|\.(append|add|update|clear|pop|setdefault|remove|discard|extend|insert)\()",
                        library,
                    )
                    if registry or (container and written):
                        found.setdefault(module, set()).add(target.id)
        self.assertEqual(found, expected)

    def test_modules_are_at_most_700_lines(self):
        long = {
            module: sum(1 for _ in open(path, encoding="utf-8"))
            for module, path in _library_modules().items()
        }
        self.assertEqual({m: n for m, n in long.items() if n > MAX_MODULE_LINES}, {})

    def test_docs_within_their_size_limits(self):
        docs = os.path.join(ROOT, "docs")
        lengths = {
            name: sum(1 for _ in open(os.path.join(docs, name), encoding="utf-8"))
            for name in os.listdir(docs)
            if name.endswith(".md")
        }
        self.assertEqual({n: k for n, k in lengths.items() if k > 400}, {})
        self.assertLessEqual(sum(lengths.values()), 1500)
        readme = sum(1 for _ in open(os.path.join(ROOT, "README.md"), encoding="utf-8"))
        self.assertLessEqual(readme, 200)

    def test_repository_neither_narrates_history_nor_points_outside(self):
        found = []
        for name in _tracked_files():
            path = os.path.join(ROOT, name)
            if HISTORY.search(name):
                found.append(f"file name: {name}")
            if not name.endswith((".py", ".md", ".sh", ".txt", ".cfg", ".toml")) or not os.path.isfile(path):
                continue
            for number, line in enumerate(open(path, encoding="utf-8", errors="replace"), 1):
                if HISTORY.search(line) or OUTSIDE.search(line):
                    found.append(f"{name}:{number}: {line.strip()[:100]}")
        self.assertEqual(found, [])


if __name__ == "__main__":
    run_tests()

"""The module layout, checked so it stays: no import cycle between the paged reference and the
Numba kernel, lesson 2 does not reach into lesson 4, caching off is a null object, old import paths still work."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import tinyserve

PKG = Path(tinyserve.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """The tinyserve modules a file imports (relative imports resolved), wherever the import statement is."""
    package = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            out.add(module)
            out.update(f"{module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("tinyserve")}


def test_paged_and_the_kernel_do_not_import_each_other():
    kernel, paged = imported_modules(PKG / "kernels" / "attention.py"), imported_modules(PKG / "paged.py")
    assert "tinyserve.paged" not in kernel and "tinyserve.attention_backends" in kernel
    assert not any(m.startswith("tinyserve.kernels") for m in paged)
    assert not any(m.startswith(("tinyserve.paged", "tinyserve.kernels"))
                   for m in imported_modules(PKG / "attention_backends.py"))   # both backends load lazily


def test_lesson_2_does_not_import_lesson_4():
    assert "tinyserve.paged" not in imported_modules(PKG / "kv_cache.py")
    assert "tinyserve.kv_sizing" in imported_modules(PKG / "kv_cache.py")


def test_block_manager_has_no_cache_is_none_branches():
    assert "cache is None" not in (PKG / "block_manager.py").read_text()
    assert "cache is not None" not in (PKG / "block_manager.py").read_text()


def test_moved_names_live_in_one_place():
    # the names that moved out of paged.py and prefix_cache.py are imported from their modules, not through shims
    from tinyserve import paged, prefix_cache
    for gone in ("max_kv_positions", "get_paged_attention", "check_block_tables"):
        assert not hasattr(paged, gone), f"paged.{gone}: import it from its own module"
    assert not hasattr(prefix_cache, "CacheStats")
    assert "noqa: F401" not in (PKG / "paged.py").read_text() + (PKG / "prefix_cache.py").read_text()


def test_engine_is_split_by_idea():
    # the step's batch layout and the Ctrl-C deferral live in their own modules; engine.py keeps the request
    # lifecycle and the step loop
    from tinyserve import engine, interrupts, step_batch
    assert engine.StepBatch is step_batch.StepBatch and engine.interrupts_deferred is interrupts.interrupts_deferred


def test_engine_step_has_no_speculation_branch():
    # speculation is a step strategy the Engine is given (spec_step.step_strategy): Engine.step calls it the same way
    # whether it drafts or not, so no `if` in the step asks about it
    tree = ast.parse((PKG / "engine.py").read_text())
    step = next(f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "Engine"
                for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "step")
    tests = [ast.unparse(n.test) for n in ast.walk(step) if isinstance(n, (ast.If, ast.IfExp))]
    assert tests and not [t for t in tests if "spec" in t or "draft" in t], tests


def test_one_positive_int_check():
    # engine.py, paged.py and kv_cache.py use config.check_positive_int instead of their own copies
    for name in ("engine.py", "paged.py"):
        text = (PKG / name).read_text()
        assert "check_positive_int(" in text and "must be an integer >= 1" not in text


# --- the import graph: no circle, and no import that runs up the layers ------------------------------------------
# Every tinyserve module in one layer, lowest first. A module may import from its own layer or any layer below; an
# import of a higher layer (wherever the import statement stands, inside a function too) is a knot: the reference
# model reaching for the fast path, a kernel reaching for a strategy. A module missing here fails the test, so a new
# file is placed on purpose.
LAYERS = (
    # 0. foundations: shapes, numbers, the CPU, the wire format; nothing of the model
    ("config", "layers", "measure", "interrupts", "kv_sizing", "protocol", "roofline",
     "kernels.isa",
     # the JSON grammar of structured output: bytes and token masks, nothing of the model (sampling applies it)
     "constrained", "constrained.automaton", "constrained.masks", "constrained.schema", "constrained.vocab",
     "constrained.regex", "tool_calls"),
    # 1. the readable reference: the float32 model and what every strategy shares
    ("model", "attention_backends", "sampling", "gqa", "online_attention",
     "gguf_quants", "gguf_file"),   # a GGUF file read into the float32 model
    # 2. the quantisation formats and their NumPy references (nothing that starts Numba)
    ("quant",),
    # 3. the Numba kernels: they compute what the reference defines
    ("kernels", "kernels.simd", "kernels.fast_exp", "kernels.int8_dot", "kernels.int4_dot", "kernels.matmul",
     "kernels.layer", "kernels.spin", "kernels.key_chunks", "kernels.attention", "kernels.dense_attention",
     "kernels.decode_step",
     "kernels.forward", "kernels.block_layer", "kernels.block_decode",
     "kernels.block_forward"),
    # 4. which path runs for a model (mode, backend, kernel variant): the one door into the kernels
    ("backend",),
    # 5. the strategies and the engine (lessons 1-9), the weights and the tokenizer
    ("stopping", "naive", "weights", "zoo", "gguf_tokenizer", "chat_template", "tokenizer", "kv_cache", "paged",
     "cache_base", "prefix_cache", "block_hash_cache", "scheduler", "sequence", "drafters", "speculative", "spec_step",
     "block_manager",
     "step_batch", "engine", "engine_loop", "tensor_parallel", "orchestrators",
     "queueing"),    # queueing theory beside a replay of the trace through the scheduler's own plan
    # 6. the programs: the compile swap, the command line and what it runs
    ("jit", "cli_options", "generate", "bench", "chat", "http_guard", "structured_api", "server", "speed", "loadgen",
     "__main__", "",
     "course"),      # what the notebooks run: the measured machine, the verdicts, the threads of every path
)


def module_name(path: Path) -> str:
    """tinyserve/kernels/matmul.py -> "kernels.matmul"; a package's __init__.py is the package ("" for tinyserve)."""
    parts = path.relative_to(PKG).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the tinyserve modules it imports ("kernels.matmul", ...), every import statement in the file."""
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:          # relative: from . / .. / .x import y
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]) if package else ""
                    mod = ".".join(p for p in (base, node.module) if p)
                elif node.module and node.module.split(".")[0] == "tinyserve":
                    mod = node.module.removeprefix("tinyserve").lstrip(".")
                else:
                    continue
                for a in node.names:    # `from .kernels import isa` imports the module kernels.isa ...
                    sub = f"{mod}.{a.name}" if mod else a.name
                    out.add(sub if sub in files else mod)
                out.update(packages_of(f"{mod}.", name))      # ... and runs the package kernels on the way
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "tinyserve":
                        mod = a.name.removeprefix("tinyserve").lstrip(".")
                        out.add(mod)
                        out.update(packages_of(mod, name))
        out.discard(name)
        graph[name] = out
    return graph


def packages_of(module: str, importer: str = "") -> set[str]:
    """The packages Python runs on the way to `module`: `from .kernels import isa` and `from .kernels.isa import X`
    both run kernels/__init__.py (Numba, its cache folder, the OpenMP spin setting), so both import the package
    `kernels` too. Left out: tinyserve's own __init__ (it runs for every import of the package) and the importer's
    own packages (they are running already when a submodule imports its sibling)."""
    parts = module.split(".")
    return {p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
            if p and not (importer == p or importer.startswith(p + "."))}


def test_relative_imports_resolve_as_python_does():
    # `from .matmul import ...` in kernels/ is kernels.matmul, `from ..quant import ...` is quant, `from . import isa`
    # is kernels.isa: a graph that got these wrong would pass the checks below for the wrong reason
    graph = import_graph()
    assert {"kernels.matmul", "kernels.spin", "attention_backends", "quant"} <= graph["kernels.decode_step"]
    assert {"kernels.isa", "kernels.decode_step"} <= graph["kernels.forward"]
    assert {"config", "layers"} <= graph["model"] and "kernels.isa" in graph["kernels.simd"]


def test_the_package_kernels_counts_when_a_submodule_is_imported():
    # `from .kernels import isa` runs kernels/__init__.py (it imports numba): quant once reached the kernels so
    graph = import_graph()
    assert {"kernels", "kernels.isa", "kernels.forward"} <= graph["backend"]
    assert packages_of("kernels.isa") == {"kernels"} and packages_of("constrained.masks") == {"constrained"}
    assert packages_of("kernels.") == {"kernels"}          # `from .kernels import isa`: the package, then isa
    assert not packages_of("") and not packages_of("quant") and not packages_of("kernels.isa", "kernels.simd")


def test_only_backend_reaches_into_the_kernels():
    # one module decides the path and calls the kernels; quant.py is the NumPy reference of the formats
    outside = sorted(m for m, targets in import_graph().items() if not m.startswith("kernels") and m != "backend"
                     and any(t.startswith("kernels") for t in targets))
    assert not outside, f"modules other than backend.py that import kernels/: {outside}"
    assert not any(t.startswith("kernels") for t in import_graph()["quant"])


def test_every_module_has_a_layer():
    placed = [m for layer in LAYERS for m in layer]
    assert len(placed) == len(set(placed)), "a module is in two layers"
    missing = sorted(set(import_graph()) - set(placed))
    assert not missing, f"modules without a layer in LAYERS (place each one on purpose): {missing}"


def test_no_import_runs_up_the_layers():
    level = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    upward = sorted(f"{m or 'tinyserve'} (layer {level[m]}) imports {t or 'tinyserve'} (layer {level[t]})"
                    for m, targets in import_graph().items() for t in targets
                    if m in level and t in level and level[t] > level[m])
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_no_import_circle():
    graph = import_graph()
    circles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v: str) -> None:          # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


# --- the front door: docs/architecture.md names every module ------------------------------------------------------

def architecture_modules() -> set[str]:
    """The files docs/architecture.md's table "Every module" names, as paths under tinyserve/ ("kernels/isa.py"). A
    row of a subpackage may name its later files short: `kernels/attention.py`, `dense_attention.py`."""
    text = (PKG.parent / "docs" / "architecture.md").read_text()
    table = text[text.index("## Every module"):]
    named = set()
    for row in (line for line in table.splitlines() if line.startswith("| `")):
        prefix = ""
        for name in re.findall(r"`([\w/]+\.py)`", row.split("|")[1]):
            prefix = name.rpartition("/")[0] + "/" if "/" in name else prefix
            named.add(name if "/" in name else prefix + name)
    return named


def test_architecture_lists_every_module():
    files = {p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py")}
    named = architecture_modules()
    assert not sorted(files - named), f"modules docs/architecture.md does not list: {sorted(files - named)}"
    assert not sorted(named - files), f"docs/architecture.md lists files that do not exist: {sorted(named - files)}"


# --- comments state rules; the measurements that justify them live in docs/ ---------------------------------------
# A comment or docstring says why a line is as it is, in the present tense; a figure measured on some CPU on some day
# goes to docs/performance.md (a command regenerates it) and the comment names that section. Every file is held to it.
MEASURED = re.compile(
    r"\b\d+(\.\d+)?(-\d+(\.\d+)?)?\s?(ms|µs|us|ns)\b|~\d+(\.\d+)?(-\d+(\.\d+)?)?\s?s\b"      # a time
    r"|\d\s?(GB/s|MB/s|tokens/s)"                                                             # a rate
    r"|\b\d+(\.\d+)?(-\d+(\.\d+)?)?x (faster|slower)\b|\b\d+(\.\d+)?(-\d+(\.\d+)?)? ?% (faster|slower)\b"  # a speed-up
    r"|\b20\d\d-\d\d-\d\d\b"                                                                  # a date
    r"|\b(Zen ?\d|EPYC|Xeon|Haswell|Skylake|Cascade Lake|Alder Lake|Ice Lake|Sapphire Rapids|Graviton|Apple M\d)\b")


def comment_lines(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring line of a file."""
    import io
    import tokenize
    src = path.read_text()
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                 str):
                out += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return out


def test_no_comment_holds_a_measurement_a_date_or_a_cpu_model():
    found = [f"tinyserve/{p.relative_to(PKG).as_posix()}:{line}: {text.strip()[:100]}"
             for p in sorted(PKG.rglob("*.py"))
             for line, text in comment_lines(p) if MEASURED.search(text)]
    assert not found, "comments with a measured figure, a date or a CPU model (move it to docs/):\n" + "\n".join(found)


def test_the_measurement_check_can_fail():
    for text in ("# a decode step took ~9 ms", "# 1.5x faster", "# reads at 27 GB/s", "# measured 2026-12-06",
                 "# on the AMD EPYC", "# ~20-45 s cold", "# 15-40 % faster"):
        assert MEASURED.search(text), text
    for text in ("# [T, N, H] float32", "# a 4 x 16 tile", "# 5 bits each", "# one scale per 64 values"):
        assert not MEASURED.search(text), text

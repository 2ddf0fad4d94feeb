"""The module layout, checked so it stays: no import cycle between the paged reference and the
Numba kernel, lesson 2 does not reach into lesson 4, caching off is a null object, old import paths still work."""
from __future__ import annotations

import ast
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


def test_moved_names_still_resolve_at_their_old_paths():
    from tinyserve import attention_backends, cache_base, kv_sizing, paged, prefix_cache, scheduler
    assert paged.blocks_for is scheduler.blocks_for is kv_sizing.blocks_for
    assert paged.max_kv_positions is kv_sizing.max_kv_positions
    assert paged.get_paged_attention is attention_backends.get_paged_attention
    assert paged.check_paged_inputs is attention_backends.check_paged_inputs
    assert paged.check_block_tables is attention_backends.check_block_tables
    assert prefix_cache.BlockCache is cache_base.BlockCache and prefix_cache.CacheStats is cache_base.CacheStats
    assert prefix_cache.block_tokens is cache_base.block_tokens


def test_engine_is_split_by_idea():
    # the step's batch layout and the Ctrl-C deferral live in their own modules; engine.py keeps the request
    # lifecycle and the step loop
    from tinyserve import engine, interrupts, step_batch
    assert engine.StepBatch is step_batch.StepBatch and engine.interrupts_deferred is interrupts.interrupts_deferred
    assert len((PKG / "engine.py").read_text().splitlines()) < 400


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
    ("config", "layers", "measure", "interrupts", "kv_sizing", "protocol", "roofline", "course", "queueing",
     "kernels.isa",
     # the JSON grammar of structured output: bytes and token masks, nothing of the model (sampling applies it)
     "constrained", "constrained.automaton", "constrained.masks", "constrained.schema", "constrained.vocab"),
    # 1. the readable reference: the float32 model and what every strategy shares
    ("model", "attention_backends", "sampling", "gqa", "online_attention",
     "gguf_quants", "gguf_file"),   # a GGUF file read into the float32 model
    # 2. the quantisation modes and their NumPy references
    ("quant",),
    # 3. the Numba kernels: they compute what the reference defines
    ("kernels", "kernels.simd", "kernels.fast_exp", "kernels.int8_dot", "kernels.int4_dot", "kernels.matmul",
     "kernels.layer", "kernels.spin", "kernels.key_chunks", "kernels.attention", "kernels.dense_attention", "kernels.decode_step",
     "kernels.forward"),
    # 4. which forward runs for a model: the reference or the kernels
    ("backend",),
    # 5. the strategies and the engine (lessons 1-9), the weights and the tokenizer
    ("stopping", "naive", "weights", "tokenizer", "kv_cache", "paged", "cache_base", "prefix_cache",
     "block_hash_cache", "scheduler", "sequence", "drafters", "speculative", "spec_step", "block_manager",
     "step_batch", "engine", "engine_loop", "tensor_parallel", "orchestrators"),
    # 6. the programs: the compile swap, the command line and what it runs
    ("jit", "cli_options", "bench", "chat", "http_guard", "structured_api", "server", "speed", "loadgen", "__main__", ""),
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
                for a in node.names:    # `from .kernels import isa` imports the module kernels.isa
                    sub = f"{mod}.{a.name}" if mod else a.name
                    out.add(sub if sub in files else mod)
            elif isinstance(node, ast.Import):
                out.update(a.name.removeprefix("tinyserve").lstrip(".") for a in node.names
                           if a.name.split(".")[0] == "tinyserve")
        out.discard(name)
        graph[name] = out
    return graph


def test_relative_imports_resolve_as_python_does():
    # `from .matmul import ...` in kernels/ is kernels.matmul, `from ..quant import ...` is quant, `from . import isa`
    # is kernels.isa: a graph that got these wrong would pass the checks below for the wrong reason
    graph = import_graph()
    assert {"kernels.matmul", "kernels.spin", "attention_backends", "quant"} <= graph["kernels.decode_step"]
    assert {"kernels.isa", "kernels.decode_step"} <= graph["kernels.forward"]
    assert {"config", "layers"} <= graph["model"] and "kernels.isa" in graph["kernels.simd"]


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

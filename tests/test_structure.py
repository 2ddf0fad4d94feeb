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

#!/usr/bin/env python
"""Mutation testing of the lesson self-checks: does each exercise's check catch small changes to the right answer?

    python tools/mutation.py 6                    # `make mutation MUT=6`: every exercise of lesson 6
    python tools/mutation.py 6 --ex verify_greedy # one exercise
    python tools/mutation.py all                  # `make mutation`: lessons 1-9 (long)
    python tools/mutation.py 3 --ci               # what CI runs: a bounded sample, fails below the bar

The mutants are made by cosmic-ray's mutation operators (cosmic_ray.mutating.mutate_code, one operator occurrence
per mutant) applied to the reference function or class behind each exercise (the REFERENCE table of
tests/lessons/test_lesson_NN.py, the same one the learner switch reads; for a reference that only wraps a helper, the
helper: DELEGATES). Each mutant is written into a patch file and
judged exactly as a kept wrong answer is (tools/check.py, TINYSERVE_IMPL=patch): that exercise's checks, in a
process of its own (forked, so the imports are paid once), with a timeout. cosmic-ray's own runner is not used: it
rewrites whole modules in place and runs the tests against the reference, not through the learner switch.

A mutant is killed when a check fails (or the patch file does not load), survives when every check passes, and
times out when the checks do not finish in time (counted as caught: a learner would not see a green tick). A
survivor that behaves exactly like the reference is listed in tests/lessons/equivalent_mutants.txt with a reason; the
score is killed / (all - equivalent). A line whose text appears more than once in the definition (`break`) is mutated
at every place and named there with its occurrence, counted from the top. A mutant of a branch the exercise's stub
does not ask for is listed there too, with a reason that starts "outside the exercise:", and is not counted either.
Mutations in annotations, decorators and assert statements are not made (annotations and asserts do not change what a
correct call returns), nor inside f-strings (an error message's words are not what the checks judge).
"""
from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import inspect
import json
import os
import re
import signal
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":   # before NumPy loads: forked children must not inherit a BLAS thread pool
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import parso  # noqa: E402
from cosmic_ray.mutating import mutate_code  # noqa: E402
from cosmic_ray.operators import (binary_operator_replacement as _bin,  # noqa: E402
                                  comparison_operator_replacement as _cmp, unary_operator_replacement as _un)
from cosmic_ray.operators.boolean_replacer import (AddNot, ReplaceAndWithOr, ReplaceFalseWithTrue,  # noqa: E402
                                                   ReplaceOrWithAnd, ReplaceTrueWithFalse)
from cosmic_ray.operators.break_continue import ReplaceBreakWithContinue, ReplaceContinueWithBreak  # noqa: E402
from cosmic_ray.operators.number_replacer import NumberReplacer  # noqa: E402
from cosmic_ray.operators.operator import Example, Operator  # noqa: E402
from cosmic_ray.operators.zero_iteration_for_loop import ZeroIterationForLoop  # noqa: E402

import check  # noqa: E402  tools/check.py: the same runner the kept wrong answers go through
from tinyserve.course import exercise_table  # noqa: E402

EQUIVALENTS = ROOT / "tests" / "lessons" / "equivalent_mutants.txt"
BAR = 0.90
# a reason that starts so marks a mutant of code the exercise does not ask for (e.g. the reference's W8A8-64 branch,
# when the stub asks for "int8" and "w8a8" only): not equivalent, but no check of that exercise may judge it
OUT_OF_SCOPE = "outside the exercise:"

# cosmic-ray makes every operator into every other one (12 x 11 binary replacements); a learner's slip is the
# neighbouring operator, so the runs use the neighbours: + -> - and *, / -> * and //, < -> <= and >, ...
_BINARY = ["Add_Sub", "Add_Mul", "Sub_Add", "Mul_Div", "Mul_Add", "Div_Mul", "Div_FloorDiv", "FloorDiv_Div",
           "FloorDiv_Mul", "Mod_FloorDiv", "Pow_Mul", "BitAnd_BitOr", "BitOr_BitAnd", "BitXor_BitOr",
           "LShift_RShift", "RShift_LShift"]
_COMPARE = ["Eq_NotEq", "NotEq_Eq", "Lt_LtE", "Lt_Gt", "LtE_Lt", "LtE_GtE", "Gt_GtE", "Gt_Lt", "GtE_Gt", "GtE_LtE",
            "Is_IsNot", "IsNot_Is"]


class _SwapToken(Operator):
    """Replace one token's text by SWAP[text] where `applies` (the two operators below differ only in that)."""
    SWAP: dict[str, str] = {}
    EXAMPLE = ("", "")

    def applies(self, node) -> bool:
        raise NotImplementedError

    def mutation_positions(self, node):
        if getattr(node, "value", None) in self.SWAP and self.applies(node):
            yield (node.start_pos, node.end_pos)

    def mutate(self, node, index):
        node.value = self.SWAP[node.value]
        return node

    @classmethod
    def examples(cls):
        return (Example(*cls.EXAMPLE),)


class SwapMinMax(_SwapToken):
    """max(...) <-> min(...) (also np.maximum/np.minimum): cosmic-ray has no operator for the two regimes of a bound."""
    SWAP = {"max": "min", "min": "max", "maximum": "minimum", "minimum": "maximum"}
    EXAMPLE = ("y = max(a, b)", "y = min(a, b)")

    def applies(self, node) -> bool:
        return isinstance(node, parso.python.tree.Name) and _is_called(node)


class ReplaceAugmentedAssign(_SwapToken):
    """x += y -> x -= y, ...: cosmic-ray's binary replacements leave the augmented assignments alone."""
    SWAP = {"+=": "-=", "-=": "+=", "*=": "/=", "/=": "*=", "//=": "/=", "|=": "&=", "&=": "|="}
    EXAMPLE = ("x += 1", "x -= 1")

    def applies(self, node) -> bool:
        return isinstance(node, parso.python.tree.Operator)


def _is_called(name) -> bool:
    nxt = name.get_next_sibling()
    return nxt is not None and getattr(nxt, "type", None) == "trailer" and nxt.children[0].value == "("


OPERATORS: list[type[Operator]] = (
    [getattr(_bin, f"ReplaceBinaryOperator_{p}") for p in _BINARY]
    + [getattr(_cmp, f"ReplaceComparisonOperator_{p}") for p in _COMPARE]
    + [_un.ReplaceUnaryOperator_USub_UAdd, _un.ReplaceUnaryOperator_Delete_Not]
    + [AddNot, ReplaceTrueWithFalse, ReplaceFalseWithTrue, ReplaceAndWithOr, ReplaceOrWithAnd,
       ReplaceBreakWithContinue, ReplaceContinueWithBreak, NumberReplacer, ZeroIterationForLoop, SwapMinMax,
       ReplaceAugmentedAssign])


# --- the mutants of one exercise ---------------------------------------------------------------------------------

@dataclass
class Mutant:
    exercise: str
    operator: str
    line: int            # in the reference module
    before: str          # the line as written (stripped)
    after: str           # the mutated line (stripped)
    source: str          # the whole mutated definition
    diff: str
    verdict: str = ""    # killed / survived / timeout / equivalent
    why: str = ""        # the first failing check (killed) or the equivalence reason
    occurrence: int = 1  # the same change to the same text on another line of the definition (e.g. `break`) counts on

    @property
    def key(self) -> tuple[str, str, str, int]:
        return (self.exercise, self.before, self.after, self.occurrence)


# A reference that only wraps a helper of its own module (kv_cache.generate is list(generate_stream(...))): the
# helper holds what the exercise asks the learner to write, so the helper is mutated, and each patch defines the
# mutated helper and then the reference's own wrapper, which calls it
DELEGATES = {"tinyserve.kv_cache:generate": "generate_stream",
             "tinyserve.block_hash_cache:block_hashes": "chain_hashes"}


@dataclass
class Target:
    exercise: str
    module: str          # where the definition lives (tinyserve.layers for kv_cache's re-exported rectangular_mask)
    name: str
    path: Path
    first_line: int
    source: str          # the definition that is mutated, decorators included
    wrapper: str = ""    # DELEGATES: the reference's own definition, appended unchanged after the mutated helper


def _definition(obj) -> tuple[Path, int, str]:
    path = Path(inspect.getsourcefile(obj))
    lines = path.read_text().splitlines(keepends=True)
    node = next(n for n in ast.parse("".join(lines)).body
                if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == obj.__name__)
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return path, start, "".join(lines[start - 1:node.end_lineno])


def target(exercise: str, ref: str) -> Target:
    obj = _resolve(ref)
    wrapper = ""
    if ref in DELEGATES:
        wrapper = _definition(obj)[2]
        obj = _resolve(f"{obj.__module__}:{DELEGATES[ref]}")
    path, start, source = _definition(obj)
    return Target(exercise, obj.__module__, obj.__name__, path, start, source, wrapper)


def _resolve(ref: str):
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def _excluded_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Annotations, decorators and asserts of a definition: ((line, col), (end_line, end_col)), 1-based lines."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        parts = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            parts += [node.returns, *node.decorator_list]
            a = node.args
            parts += [x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x]
        elif isinstance(node, ast.ClassDef):
            parts += node.decorator_list
        elif isinstance(node, ast.AnnAssign):
            parts.append(node.annotation)
        elif isinstance(node, (ast.Assert, ast.JoinedStr)):   # f-strings: the words of a message are not checked
            parts.append(node)
        spans += [((p.lineno, p.col_offset), (p.end_lineno, p.end_col_offset)) for p in parts if p is not None]
    return spans


def _inside(pos, spans) -> bool:
    return any(lo <= pos < hi for lo, hi in spans)


def mutants(t: Target) -> list[Mutant]:
    spans = _excluded_spans(t.source)
    tree = parso.parse(t.source)
    nodes = list(_walk(tree))
    out, seen = [], set()
    for op_cls in OPERATORS:
        op = op_cls()
        positions = [p for n in nodes for p in op.mutation_positions(n)]
        for occurrence, (start, _end) in enumerate(positions):
            if _inside(start, spans):
                continue
            code = mutate_code(t.source, op, occurrence)
            if code is None or code == t.source:
                continue
            try:
                ast.parse(code)
            except SyntaxError:
                continue
            old, new = t.source.splitlines(), code.splitlines()
            changed = [i for i, (a, b) in enumerate(zip(old, new)) if a != b] or [start[0] - 1]
            i = changed[0]
            before, after = old[i].strip(), new[i].strip() if i < len(new) else ""
            if (i, before, after) in seen:   # the same text from two operators (e.g. `not` added twice)
                continue
            seen.add((i, before, after))   # the same text on another line (`break`, `i += 1`) is another mutant
            diff = "\n".join(difflib.unified_diff(old, new, f"a/{_rel(t.path)}", f"b/{_rel(t.path)}", lineterm="", n=1))
            diff = re.sub(r"^@@ -(\d+)", lambda m: f"@@ -{int(m.group(1)) + t.first_line - 1}", diff, flags=re.M)
            out.append(Mutant(t.exercise, op_cls.__name__.replace("ReplaceBinaryOperator_", "")
                              .replace("ReplaceComparisonOperator_", ""), t.first_line + i, before, after, code, diff))
    out.sort(key=lambda m: m.line)
    # number the lines that carry the same text and change top to bottom: the equivalents file names one by it
    counts: dict[tuple[str, str], int] = {}
    for m in out:
        m.occurrence = counts[(m.before, m.after)] = counts.get((m.before, m.after), 0) + 1
    return out


def _walk(node):
    yield node
    for child in getattr(node, "children", ()):
        yield from _walk(child)


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def patch_file(t: Target, source: str, folder: Path) -> Path:
    """A patch file (TINYSERVE_IMPL=patch) that defines the (mutated) exercise in a copy of its module's namespace,
    so its helpers and imports resolve as in the reference; every other exercise stays the reference."""
    future = "from __future__ import annotations\n" if "from __future__ import annotations" in t.path.read_text() else ""
    text = (f"{future}import importlib as _importlib\n"
            f"globals().update({{_k: _v for _k, _v in vars(_importlib.import_module({t.module!r})).items()"
            f" if not _k.startswith('__')}})\n\n{source}" + (f"\n\n{t.wrapper}" if t.wrapper else ""))
    path = folder / f"mutant_{os.getpid()}_{time.monotonic_ns()}.py"
    path.write_text(text)
    return path


# --- judging: one forked process per mutant ------------------------------------------------------------------------

def judge(lesson: int, t: Target, source: str, timeout: float, folder: Path) -> tuple[str, str, float]:
    """('killed' | 'survived' | 'timeout' | 'error', the first failing check, seconds) for one definition."""
    path = patch_file(t, source, folder)
    result = folder / (path.stem + ".json")
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:   # the child: the learner's checks on the patch, nothing printed
        try:
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            res = check.run(lesson, path, "patch", only=t.exercise, stop_at_first=True)
            failing = [c for c in res.checks.get(t.exercise, []) if not c.passed]
            if res.errors:
                out = ("killed", "the patch did not load: " + res.errors[0].strip().splitlines()[-1][:150])
            elif res.ran == 0:
                out = ("error", "no check ran")
            elif failing:
                out = ("killed", f"{failing[0].test}: {(failing[0].message.splitlines() or [''])[0][:150]}")
            else:
                out = ("survived", "")
            result.write_text(json.dumps(out))
        finally:
            os._exit(0)
    deadline = t0 + timeout
    while True:
        done, _status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.perf_counter() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            path.unlink(missing_ok=True)
            return "timeout", f"no verdict within {timeout:.0f} s", time.perf_counter() - t0
        time.sleep(0.02)
    path.unlink(missing_ok=True)
    if not result.exists():
        return "killed", "the checks' process died", time.perf_counter() - t0
    verdict, why = json.loads(result.read_text())
    result.unlink()
    return verdict, why, time.perf_counter() - t0


# --- equivalents -------------------------------------------------------------------------------------------------

# `... -> `...` (occurrence 2)`: the second line of the definition with this text and this change (`break`, ...)
_EQ = re.compile(r"^\[(?P<ex>\w+)\] `(?P<before>.*)` -> `(?P<after>.*)`(?: \(occurrence (?P<n>\d+)\))?: (?P<why>.+)$")


def equivalents() -> dict[tuple[str, str, str, int], str]:
    out = {}
    for n, line in enumerate(EQUIVALENTS.read_text().splitlines() if EQUIVALENTS.exists() else [], 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = _EQ.match(line)
        if not m:
            raise SystemExit(f"{_rel(EQUIVALENTS)}:{n}: expected [exercise] `line` -> `mutated line`: reason")
        out[(m["ex"], m["before"], m["after"], int(m["n"] or 1))] = m["why"]
    return out


# --- the report ----------------------------------------------------------------------------------------------------

@dataclass
class Score:
    exercise: str
    counts: dict[str, int] = field(default_factory=dict)
    survivors: list[Mutant] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def caught(self) -> int:
        return self.counts.get("killed", 0) + self.counts.get("timeout", 0)

    @property
    def judged(self) -> int:
        return self.caught + self.counts.get("survived", 0)

    @property
    def ratio(self) -> float:
        return self.caught / self.judged if self.judged else 1.0


def run_exercise(lesson: int, exercise: str, ref: str, folder: Path, eq: dict, sample: int | None,
                 quiet: bool) -> Score:
    t = target(exercise, ref)
    score = Score(exercise)
    t0 = time.perf_counter()
    verdict, why, base = judge(lesson, t, t.source, 600, folder)   # the unmutated copy must pass, through the patch
    if verdict != "survived":
        print(f"  ERROR {exercise}: the reference itself does not pass its checks as a patch ({verdict}: {why})")
        score.counts["error"] = 1
        return score
    timeout = max(30.0, 5 * base + 10)
    ms = mutants(t)
    if not ms:          # nothing to judge is not a score: a wrapper around the real work, say (DELEGATES)
        print(f"  ERROR {exercise}: {t.name} gave no mutants (if it only wraps a helper, name that in DELEGATES)")
        score.counts["error"] = 1
        return score
    if sample is not None and len(ms) > sample:   # an even spread over the definition, the same on every run
        ms = [ms[round(i * (len(ms) - 1) / (sample - 1))] for i in range(sample)] if sample > 1 else ms[:1]
    for m in ms:
        if m.key in eq:
            out_of_scope = eq[m.key].startswith(OUT_OF_SCOPE)
            m.verdict, m.why = ("out of scope" if out_of_scope else "equivalent"), eq[m.key]
        else:
            m.verdict, m.why, _ = judge(lesson, t, m.source, timeout, folder)
            if m.verdict == "error":
                m.verdict = "killed"
        score.counts[m.verdict] = score.counts.get(m.verdict, 0) + 1
        if m.verdict == "survived":
            score.survivors.append(m)
        if not quiet:
            print(f"    {m.verdict:<10} {_rel(t.path)}:{m.line} {m.before!r} -> {m.after!r}  {m.why[:80]}", flush=True)
    score.seconds = time.perf_counter() - t0
    return score


def print_score(lesson: int, s: Score, diffs: bool = True) -> None:
    c = s.counts
    print(f"  lesson {lesson} {s.exercise:<22} killed {c.get('killed', 0):>3}  survived {c.get('survived', 0):>3}  "
          f"timed out {c.get('timeout', 0):>2}  equivalent {c.get('equivalent', 0):>2}  "
          f"outside {c.get('out of scope', 0):>2}   "
          f"{100 * s.ratio:5.1f} % caught  {'ok ' if s.ratio >= BAR else 'LOW'} ({s.seconds:.0f} s)", flush=True)
    if diffs:
        for m in s.survivors:
            print(textwrap.indent(f"survived ({m.operator}):\n{m.diff}", "        "))


def main() -> int:
    os.environ.pop("TINYSERVE_SOLUTION", None)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("lesson", help="lesson number, comma-separated numbers, or 'all'")
    p.add_argument("--ex", default=None, help="one exercise only")
    p.add_argument("--sample", type=int, default=None, help="at most this many mutants per exercise (evenly spread)")
    p.add_argument("--ci", action="store_true", help="the bounded CI run: --sample 12 and exit 1 below the bar")
    p.add_argument("-v", "--verbose", action="store_true", help="print every mutant's verdict as it comes")
    p.add_argument("--json", default=None, help="also write the verdicts to this file")
    args = p.parse_args()
    have = check.lessons_with_tests()
    lessons = have if args.lesson == "all" else [int(x) for x in args.lesson.split(",")]
    sample = 12 if args.ci and args.sample is None else args.sample
    eq = equivalents()
    t0 = time.perf_counter()
    scores, low = [], []
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        for lesson in lessons:
            table = exercise_table(lesson)
            names = [args.ex] if args.ex else list(table)
            for name in names:
                s = run_exercise(lesson, name, table[name], Path(tmp), eq, sample, quiet=not args.verbose)
                print_score(lesson, s)
                scores.append((lesson, s))
                if s.ratio < BAR or s.counts.get("error"):
                    low.append(f"lesson {lesson} {name}")
    total = sum(s.judged for _, s in scores)
    caught = sum(s.caught for _, s in scores)
    print(f"\n{caught} of {total} non-equivalent mutants caught ({100 * caught / max(total, 1):.1f} %), "
          f"{sum(s.counts.get('equivalent', 0) for _, s in scores)} judged equivalent "
          f"({_rel(EQUIVALENTS)}); {len(scores) - len(low)} of {len(scores)} exercises at >= {BAR:.0%} "
          f"({time.perf_counter() - t0:.0f} s)")
    if low:
        print("below the bar: " + ", ".join(low))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {f"{n}:{s.exercise}": {"counts": s.counts, "survivors": [m.diff for m in s.survivors]} for n, s in scores},
            indent=1))
    return 1 if (args.ci and low) else 0


if __name__ == "__main__":
    sys.exit(main())

"""walk_trie stops descending at the first node that ends a token: 't' is found, 'tr' and 'true' below it never are."""
from tinyserve.constrained.automaton import DEAD

CAUGHT_BY = "walk_trie"


def walk_trie(root, automaton, sid, out):
    todo = [(root, sid)]
    while todo:
        (ids, children), s = todo.pop()
        if ids:
            out.extend(ids)
            continue
        for b, child in children.items():
            t = automaton.next(s, b)
            if t != DEAD:
                todo.append((child, t))

"""walk_trie collects the ids of leaves only: a token that is a prefix of another ('t' of 'true') is lost."""

CAUGHT_BY = "walk_trie"


def walk_trie(root, automaton, sid, out):
    todo = [(root, sid)]
    while todo:
        (ids, children), s = todo.pop()
        if not children:
            out.extend(ids)
        for b, child in children.items():
            t = automaton.next(s, b)
            if t != -1:
                todo.append((child, t))

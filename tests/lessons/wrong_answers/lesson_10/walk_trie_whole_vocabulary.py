"""walk_trie lists every token of the trie and checks each with automaton.walk: right answer, no pruning at all."""

CAUGHT_BY = "walk_trie"


def walk_trie(root, automaton, sid, out):
    def tokens(node, prefix):
        ids, children = node
        for i in ids:
            yield i, prefix
        for b, child in children.items():
            yield from tokens(child, prefix + bytes((b,)))

    for i, data in tokens(root, b""):
        if automaton.walk(sid, data) != -1:
            out.append(i)

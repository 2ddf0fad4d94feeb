"""walk_trie checks a token's first byte and takes the whole subtree below it: '{"' passes where only '{' may."""

CAUGHT_BY = "walk_trie"


def walk_trie(root, automaton, sid, out):
    def collect(node):
        ids, children = node
        out.extend(ids)
        for child in children.values():
            collect(child)

    for b, child in root[1].items():
        if automaton.next(sid, b) != -1:
            collect(child)

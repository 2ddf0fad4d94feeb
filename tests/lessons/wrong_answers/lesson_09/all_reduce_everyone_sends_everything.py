"""all_reduce sends every device's whole array to every other device: right sums, P / 2 times the ring's traffic."""
CAUGHT_BY = "all_reduce"


def all_reduce(parts, link):
    P = len(parts)
    out = []
    for d in range(P):
        total = parts[d].copy()
        for e in range(P):
            if e != d:
                total = total + link.send(parts[e])
        out.append(total)
    return out

"""matrix_bytes adds each block's scale but not its minimum: right for Q8_0 and Q4_0, short for Q4_1 and the tiles."""
CAUGHT_BY = "matrix_bytes"


def matrix_bytes(rows, cols, fmt):
    if cols % fmt.block:
        raise ValueError(f"a row of {cols} is not whole blocks of {fmt.block}")
    return rows * (cols // fmt.block) * (fmt.block * fmt.bits // 8 + fmt.scale_bytes)

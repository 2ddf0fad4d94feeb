"""matrix_bytes puts one scale and minimum on a whole row instead of one on every block of it."""
CAUGHT_BY = "matrix_bytes"


def matrix_bytes(rows, cols, fmt):
    if cols % fmt.block:
        raise ValueError(f"a row of {cols} is not whole blocks of {fmt.block}")
    return rows * (cols * fmt.bits // 8 + fmt.scale_bytes + fmt.min_bytes)

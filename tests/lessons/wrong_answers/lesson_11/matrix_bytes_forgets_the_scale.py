"""matrix_bytes counts the integers only: a 4-bit format at 4 bits a weight, forgetting each block's scale and minimum."""
CAUGHT_BY = "matrix_bytes"


def matrix_bytes(rows, cols, fmt):
    if cols % fmt.block:
        raise ValueError(f"a row of {cols} is not whole blocks of {fmt.block}")
    return rows * cols * fmt.bits // 8

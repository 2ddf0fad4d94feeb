"""BlockAllocator.incref accepts a free block: it gets a refcount while still on the free list (handed out twice)."""
from tinyserve.paged import BlockAllocator as _Reference

CAUGHT_BY = "BlockAllocator"


class BlockAllocator(_Reference):
    def incref(self, block: int) -> None:
        self.refcount[block] += 1

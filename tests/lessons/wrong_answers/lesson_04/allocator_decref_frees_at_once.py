"""BlockAllocator.decref puts the block back on the free list at the first decref, even if another owner holds it."""
from tinyserve.paged import BlockAllocator as _Reference

CAUGHT_BY = "BlockAllocator"


class BlockAllocator(_Reference):
    def decref(self, block: int) -> bool:
        assert self.refcount[block] > 0
        self.refcount[block] = 0
        self._free.append(block)
        return True

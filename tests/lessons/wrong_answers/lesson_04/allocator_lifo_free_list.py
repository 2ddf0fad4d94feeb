"""BlockAllocator reuses the most recently freed block first (LIFO); a freed block must be reused as late as possible."""
from tinyserve.paged import BlockAllocator as _Reference

CAUGHT_BY = "BlockAllocator"


class BlockAllocator(_Reference):
    def decref(self, block: int) -> bool:
        assert self.refcount[block] > 0
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._free.appendleft(block)      # the mistake: to the front of the queue
            return True
        return False

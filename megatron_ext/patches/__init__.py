"""The runtime patches, in the order they are applied."""

from ..patching import Patch
from .matched_block_writes import MatchedBlockWritesPatch
from .release_refcount import ReleaseRefCountPatch

#: One instance per patch for the whole process: each remembers what it replaced.
ALL_PATCHES: tuple[Patch, ...] = (ReleaseRefCountPatch(), MatchedBlockWritesPatch())

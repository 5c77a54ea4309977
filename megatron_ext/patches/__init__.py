"""The runtime patches, in the order they are applied (and reverted last-first)."""

from ..patching import Patch
from .deregister_own_hash import DeregisterOwnHashPatch
from .lru_leaf_first_eviction import LruLeafFirstEvictionPatch
from .lru_pin_before_allocate import LruPinBeforeAllocatePatch
from .lru_register_once import LruRegisterOncePatch
from .lru_resume_evictable import LruResumeEvictablePatch
from .mamba_aligned_chunks import MambaAlignedChunksPatch
from .mamba_chunk_size import MambaChunkSizePatch
from .mamba_clamp_restore import MambaClampRestorePatch
from .mamba_continuation_skip import MambaContinuationSkipPatch
from .mamba_conv_carry import MambaConvCarryPatch
from .mamba_decode_a_cache import MambaDecodeACachePatch
from .mamba_decode_no_dummy import MambaDecodeNoDummyPatch
from .mamba_match_in_chunk import MambaMatchInChunkPatch
from .mamba_slot_exhaustion import MambaSlotExhaustionPatch
from .mamba_snapshot_offsets import MambaSnapshotOffsetsPatch
from .matched_block_writes import MatchedBlockWritesPatch
from .mla_absorbed_weights import MlaAbsorbedWeightsPatch
from .mla_decode_flag import MlaDecodeFlagPatch
from .release_refcount import ReleaseRefcountPatch
from .routing_evicted_requests import RoutingEvictedRequestsPatch
from .routing_finished_blocks import RoutingFinishedBlocksPatch
from .routing_per_block import RoutingPerBlockPatch
from .spec_block_ids_after_eviction import SpecBlockIdsAfterEvictionPatch
from .weight_update_invalidation import WeightUpdateInvalidationPatch
from .top_n_prefill_chunks import TopNPrefillChunksPatch

#: One instance per patch for the whole process: each remembers what it replaced.
ALL_PATCHES: tuple[Patch, ...] = (
    ReleaseRefcountPatch(),
    LruLeafFirstEvictionPatch(),
    LruRegisterOncePatch(),
    LruPinBeforeAllocatePatch(),
    MatchedBlockWritesPatch(),
    LruResumeEvictablePatch(),
    WeightUpdateInvalidationPatch(),
    TopNPrefillChunksPatch(),
    DeregisterOwnHashPatch(),
    RoutingPerBlockPatch(),
    RoutingFinishedBlocksPatch(),
    RoutingEvictedRequestsPatch(),
    MlaDecodeFlagPatch(),
    MlaAbsorbedWeightsPatch(),
    MambaChunkSizePatch(),
    MambaSnapshotOffsetsPatch(),
    MambaSlotExhaustionPatch(),
    MambaMatchInChunkPatch(),
    MambaClampRestorePatch(),
    MambaConvCarryPatch(),
    MambaContinuationSkipPatch(),
    MambaAlignedChunksPatch(),
    MambaDecodeNoDummyPatch(),
    MambaDecodeACachePatch(),
    SpecBlockIdsAfterEvictionPatch(),
)

"""The routed experts' products on wgmma (Hopper, sm_90a): experts_tc.py's staged kernels with the tensor core's
asynchronous warpgroup mma in place of each warp's mma.sync (read experts_tc.py first: plan, K order, K split,
work items and outputs are its own).

A block is one warpgroup (WgmmaConfig). Per stage of chunks_per_stage 32-column chunks it copies, by cp.async, its
8 weight tiles (fragment_layout, 1 KB a tile a chunk, as the staged kernels do) and its pass's ``tokens`` tokens
into one slot of shared memory. Warp w owns two weight tiles, tile w and tile 4 + w of the slot (gate_up: gate rows
16 w .. of the block's 64 and the matching up rows; down: output rows 32 w .. 32 w + 15 and the 16 after them):
each k-step its lanes load their A fragments from the slot (as a staged warp does) and the warpgroup issues two
wgmma m64nNk16 (N = tokens), A from those registers, B the pass's tokens straight from shared memory. The tensor
core runs them while the warps go on; the warps wait for them once a stage, before the slot is refilled. With
WgmmaConfig.overlap they wait only for the stage before (wgmma.wait_group 1): a stage's products run on while the
block waits for the next stage's copies and loads its fragments into a second set of registers, so the slot
refilled is the one read two stages back (stages - 2 copied ahead, not stages - 1).

The tokens' layout. A wgmma reads B as core matrices, 8 tokens x 16 contiguous bytes along K, where the staged
kernels give lane (g, tq) of k-step j the columns 8 tq + 4 j .. 8 tq + 4 j + 3 (logical k 2tq, 2tq + 1 and 2tq + 8,
2tq + 9). So the tokens are stored in transposed_word's order (x by _round_to_bf16, act by the wgmma gate_up): the
chunk's quarter 2 j + h is then row h of k-step j's core matrices, and a slot holds, per chunk and quarter, the
pass's tokens in order, 16 bytes each. A k-step's descriptor points at quarter 2 j: the next quarter (k 8..15) is
``tokens`` x 16 bytes on, the next 8 tokens 128 bytes on. Two neighbouring lanes copy a token's two quarters of one
32-byte sector, a warp 16 tokens: each sector crosses L2 once, and the warp's stores fill every bank.

Bits: each k-step gives every token the products and the order of the staged kernels' mma.sync (wgmma.py: the same
bits), the K_SPLIT shares sum in fresh accumulators and fold in share order, so a token gets FEW_PAIRS_CONFIG's bits
here too: DDTree stays equal to AR with this kernel in the verify. Accumulator register 4 m + c of a tile is mma.sync's
C entry c of token tile m, so experts_tc.store_functions stores them. With WgmmaConfig.shared_totals the running
totals live in shared memory after the slots (float32 [2 N / 2, 128]: a thread's own column, so no barrier), and
the last share's fold leaves the totals in the accumulators to store: half the registers for the same sums.
"""
from __future__ import annotations

import functools

from numba import cuda, float32, int32, int64, uint32, uint64

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.intrinsics import at, at_put
from kdspec.numba_kernels.mma import (BF16_SCRATCH_PER_WARP, WARP, address_units, copy16_at, copy_commit, copy_wait,
                                      global_address, shared_address)
from kdspec.numba_kernels.moe.experts_tc import (STAGE_ALIGNMENT, STEP_WORDS, TILE_ROWS, TILE_WORDS, WgmmaConfig,
                                                 fold_share, load_fragment, locate_pass, share_stages, store_functions,
                                                 zero_accumulator)
from kdspec.numba_kernels.runtime import INLINE_DEVICE, ON_SIMULATOR, device_function, static_for
from kdspec.numba_kernels.wgmma import (CORE_BYTES, CORE_ROW_BYTES, descriptor_base, fence_function,
                                        fence_shared_for_wgmma, mma_function, wait_function)


def token_piece(piece: int, n_tokens: int) -> tuple[int, int]:
    """(token, quarter) of a stage's 16-byte token copy ``piece`` (quarter: the stage's chunk quarter // 4, its quarter
    quarter % 4). The copies go quarter pair by quarter pair, so that two neighbouring lanes read a token's 32-byte
    sector whole (a lane a sector would move each sector through L2 twice) and a warp's 16 tokens fill every bank of
    the slot, which holds quarter by quarter, token by token: piece quarter * n_tokens + token."""
    return piece // 2 % n_tokens, piece // (2 * n_tokens) * 2 + piece % 2


def token_piece_offset(tid: int, i: int, n_tokens: int, threads: int) -> int:
    """Where thread tid's token copy i (piece tid + i * threads) lands in the slot's tokens, in pieces from the
    thread's own first piece: i * threads - token + (tid % 2) * (n_tokens - 1), computed at each copy (i a constant
    there) rather than held in a register a copy."""
    token = (tid // 2 + (i * threads // 2) % n_tokens) % n_tokens
    return i * threads - token + (tid % 2) * (n_tokens - 1)


_token_piece = device_function(**INLINE_DEVICE)(token_piece)
_token_piece_offset = device_function(**INLINE_DEVICE)(token_piece_offset)


@functools.lru_cache(maxsize=None)
def wgmma_kernels(config: WgmmaConfig):
    """(gate_up, down) kernels for one WgmmaConfig, with experts_tc's staged kernels' arguments (tokens in
    transposed_word's order; gate_up writes act in it too)."""
    n_tokens, stages, per_stage = config.tokens, config.stages, config.chunks_per_stage
    threads, staged_tiles = config.threads, config.staged_tiles
    tile_words = TILE_WORDS * per_stage           # uint64 of one weight tile's stage
    weight_words = tile_words * staged_tiles      # a slot's weight tiles; its tokens follow
    slot_words = weight_words + 8 * per_stage * n_tokens
    half = n_tokens // 2                          # accumulators a tile: a wgmma's N / 2
    acc_size = 2 * half
    a_words = 16 * per_stage                      # uint32 a lane: 2 tiles x 2 k-steps x 4 per chunk
    tile_pieces = tile_words // 2                 # 16-byte copies of a tile's stage
    weight_pieces = tile_pieces * staged_tiles
    token_pieces = 4 * per_stage * n_tokens
    weight_copies = -(-weight_pieces // threads)  # 16-byte copies a thread a stage
    token_copies = -(-token_pieces // threads)
    scratch_size = threads // WARP * BF16_SCRATCH_PER_WARP if ON_SIMULATOR else 1
    lead_bytes = n_tokens * CORE_ROW_BYTES        # from a k-step's k 0..7 to its k 8..15
    mma = mma_function(n_tokens, lead_bytes, CORE_BYTES)
    descriptor_high = descriptor_base(lead_bytes, CORE_BYTES)
    fence = fence_function(a_words, acc_size)
    overlap = config.overlap
    lead = stages - 2 if overlap else stages - 1  # stages copied ahead of the one computed
    wait_issued = wait_function(1 if overlap else 0, acc_size)  # overlap: the last stage's wgmma runs on
    wait_running = wait_function(0, acc_size, commit=False)
    wait_for_stage = copy_wait(lead - 1)
    word = address_units(8)
    piece_step = 2 * word * threads

    def copy_weight_piece(i, args):
        slots, slot_at, w, weight_from, stage_offset = args
        if (i + 1) * threads <= weight_pieces or cuda.threadIdx.x + i * threads < weight_pieces:
            copy16_at(slots, slot_at + i * piece_step, w, weight_from[i] + stage_offset)

    def copy_token_piece(i, args):
        """Token copy i: none past the pass's tokens (token_valid bit i), whose columns reach only outputs never
        stored (each output column of a wgmma is its own token's)."""
        slots, slot_at, tokens, token_from, tid, stage_offset, token_valid = args
        if (token_valid >> i) & 1:
            copy16_at(slots, slot_at + 2 * word * _token_piece_offset(tid, i, n_tokens, threads), tokens,
                      token_from[i] + stage_offset)

    copy_weight_pieces = static_for(weight_copies, device_function(**INLINE_DEVICE)(copy_weight_piece))
    copy_token_pieces = static_for(token_copies, device_function(**INLINE_DEVICE)(copy_token_piece))

    @device_function(**INLINE_DEVICE)
    def copy_stage(slots, slot_at, stage, w, weight_from, tokens, token_from, token_valid):
        tid = cuda.threadIdx.x
        copy_weight_pieces((slots, slot_at, w, weight_from, int64(stage) * (tile_words * word)))
        copy_token_pieces((slots, slot_at + weight_words * word, tokens, token_from, tid,
                           int64(stage) * (8 * per_stage * word), token_valid))

    def load_fragments(i, args):
        """The lane's A fragment of k-step j = i % 2 of tile t = i // 2 % 2 of chunk u = i // 4 of the slot at words
        ``at`` into a[4 i ..] (tile t is slot tile warp + 4 t)."""
        slots, at, a = args
        u, t, j = i // 4, i // 2 % 2, i % 2
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        load_fragment(slots, at + tile_words * (warp + 4 * t) + TILE_WORDS * u + STEP_WORDS * j + 2 * lane, True, a,
                      4 * i)

    def tile_mma(i, args):
        """Tile t = i % 2's wgmma of k-step j = i // 2 % 2 of chunk u = i // 4 (k-step order, both tiles a step)."""
        acc, a, slots, tokens_at, scratch = args
        u, j, t = i // 4, i // 2 % 2, i % 2
        at = 4 * (4 * u + 2 * t + j)
        b_at = tokens_at + (4 * u + 2 * j) * (n_tokens * 2 * word)
        mma(acc, half * t, a[at], a[at + 1], a[at + 2], a[at + 3], slots, b_at, descriptor_high, scratch)

    load_stage_fragments = static_for(4 * per_stage, device_function(**INLINE_DEVICE)(load_fragments))
    stage_mma = static_for(4 * per_stage, device_function(**INLINE_DEVICE)(tile_mma))

    @device_function(**INLINE_DEVICE)
    def stage_products(slots, slot_words_at, slot_address, acc, a, scratch):
        """The stage in the slot at words slot_words_at (shared address slot_address): issued, then waited for (with
        overlap, the stage before it: this one runs on while the next stage's fragments load into the other a)."""
        load_stage_fragments((slots, slot_words_at, a))
        fence(a, acc)
        stage_mma((acc, a, slots, slot_address + weight_words * word, scratch))
        wait_issued(acc)

    fold_all = static_for(acc_size, fold_share)
    zero_all = static_for(acc_size, zero_accumulator)
    shared_totals = config.shared_totals
    totals_at = stages * slot_words * 2  # float32 index of the shared totals: after the slots, [acc_size, threads]

    def fold_to_shared(o, args):
        """fold_share with total[o] in shared memory (a later share follows)."""
        acc, totals, first = args
        index = totals_at + o * threads + cuda.threadIdx.x
        at_put(totals, index, acc[o] if first else at(totals, index) + acc[o])  # (no wraparound test an element)
        acc[o] = float32(0.0)

    def fold_last(o, args):
        """The last share: acc[o] = the total (the same sum fold_share's total would hold), in registers to store."""
        acc, totals, first = args
        if not first:
            acc[o] = at(totals, totals_at + o * threads + cuda.threadIdx.x) + acc[o]

    fold_all_to_shared = static_for(acc_size, device_function(**INLINE_DEVICE)(fold_to_shared))
    fold_all_last = static_for(acc_size, device_function(**INLINE_DEVICE)(fold_last))

    @device_function(**INLINE_DEVICE)
    def walk_stage(stage, state, walk, acc, a, total, totals, scratch):
        """Stage ``stage`` of a pass: wait for its copies, copy stage + lead into the slot read lead stages ago,
        issue its products (fragments in ``a``), fold a share that ends here; returns the next state (slot,
        fill_slot, share_left, first_share)."""
        slot, fill_slot, share_left, first_share = state
        slots, slots_address, first_slot_at, w, weight_from, tokens, token_from, token_valid, k_stages, share, \
            n_stages = walk
        wait_for_stage()
        fence_shared_for_wgmma()  # this thread's landed copies visible to the wgmma of every warp
        # every copy of the stage landed; the slot refilled next was read, its wgmma waited for (with overlap, by
        # the last stage's wait for all but one group)
        cuda.syncthreads()
        if int32(stage + lead) < k_stages:
            copy_stage(slots, first_slot_at + fill_slot * (slot_words * word), int32(stage + lead), w, weight_from,
                       tokens, token_from, token_valid)
        copy_commit()
        fill_slot = int32(0) if fill_slot == stages - 1 else int32(fill_slot + 1)
        if stage < k_stages:  # a share padded past K skips its stages there
            stage_products(slots, int32(slot * slot_words), slots_address + slot * (slot_words * word), acc, a,
                           scratch)
        slot = int32(0) if slot == stages - 1 else int32(slot + 1)
        share_left = int32(share_left - 1)
        if share_left == 0:
            if overlap:
                wait_running(acc)  # the stage still running
            if not shared_totals:
                fold_all((acc, total, first_share))
            elif stage < n_stages - 1:
                fold_all_to_shared((acc, totals, first_share))
            else:
                fold_all_last((acc, totals, first_share))
            first_share, share_left = False, int32(share)
        return slot, fill_slot, share_left, first_share

    def make_kernel(gate_up: bool):
        rows_per_block = config.rows_per_block(gate_up)
        store_act_all, store_down_all = store_functions(2, n_tokens // 8, transposed=gate_up)

        @kernel_cache.jit
        def kernel(tokens, w, w_tiles, n_chunks, f, k, expert_offsets, sorted_pairs, active_experts, n_active,
                   out):
            """Arguments and output as experts_tc's staged kernels; grid (ceil(f / 64) (gate_up) or ceil(d / 128)
            (down), row_blocks(work_items(...))); 128 threads."""
            slots = cuda.shared.array(0, uint64, alignment=STAGE_ALIGNMENT)  # [stages, slot_words], dynamic
            scratch = cuda.shared.array(scratch_size, float32)
            item_passes = cuda.shared.array(threads, int32)
            item_found = cuda.shared.array(2, int32)
            totals = cuda.shared.array(0, float32)  # the slots' memory; the shared totals after them
            acc = cuda.local.array(acc_size, float32)
            total = cuda.local.array(1 if shared_totals else acc_size, float32)
            a = cuda.local.array(a_words, uint32)
            a_next = cuda.local.array(a_words, uint32)  # overlap: every other stage's fragments
            weight_from = cuda.local.array(weight_copies, int64)  # the stage-0 address of each copy
            token_from = cuda.local.array(token_copies, int64)
            tid = cuda.threadIdx.x
            first_slot_at = shared_address(slots, 2 * tid)   # this thread's first piece of slot 0
            slots_address = shared_address(slots, 0)
            warp = tid // WARP
            first_row = cuda.blockIdx.x * rows_per_block
            first_tile = first_row // TILE_ROWS
            warp_column = first_row + (TILE_ROWS if gate_up else 2 * TILE_ROWS) * warp
            token_words = tokens.shape[2]
            k_stages, share, n_stages = share_stages(n_chunks, per_stage)
            item = cuda.blockIdx.y
            actives = n_active[0]
            while True:  # block-uniform: the block syncs
                expert, base, end = locate_pass(item, actives, expert_offsets, active_experts, n_tokens, item_passes,
                                                item_found)
                if expert < 0:
                    break
                for i in range(weight_copies):
                    piece = tid + i * threads
                    staged = piece // tile_pieces % staged_tiles  # slot tile: warp staged % 4's tile staged // 4
                    owner, second = staged % 4, staged // 4
                    if gate_up:  # gate tile first_tile + owner, its up tile f / 16 on
                        valid = first_tile + owner < f // TILE_ROWS
                        source = first_tile + owner + (f // TILE_ROWS if second else 0)
                    else:  # output rows 32 owner + 16 second ..
                        source = first_tile + 2 * owner + second
                        valid = source < w_tiles
                    if not valid:
                        # a tile past f or d copies the block's first tile again (from L2): its rows reach only
                        # outputs never stored
                        source = first_tile
                    weight_from[i] = global_address(w, (int64(expert) * w_tiles + source) * n_chunks * TILE_WORDS
                                                    + 2 * (piece % tile_pieces))
                token_valid = int32(0)
                for i in range(token_copies):
                    piece = tid + i * threads
                    token, quarter = _token_piece(piece, n_tokens)
                    pair = min(base + token, end - 1)
                    row = sorted_pairs[pair] // k if gate_up else pair
                    token_from[i] = global_address(tokens, row * token_words + 8 * (quarter // 4)
                                                   + 2 * (quarter % 4))
                    if piece < token_pieces and base + token < end:
                        token_valid |= int32(1) << i
                for stage in range(lead):  # prologue: lead stages in flight
                    if stage < k_stages:
                        copy_stage(slots, first_slot_at + stage * (slot_words * word), int32(stage), w, weight_from,
                                   tokens, token_from, token_valid)
                    copy_commit()
                zero_all(acc)
                walk = (slots, slots_address, first_slot_at, w, weight_from, tokens, token_from, token_valid, k_stages,
                        share, n_stages)
                state = (int32(0), int32(lead), int32(share), True)  # slot, fill_slot, share_left, first_share
                stage = int32(0)
                while stage < n_stages:
                    state = walk_stage(stage, state, walk, acc, a, total, totals, scratch)
                    if overlap and stage + 1 < n_stages:  # the next stage's fragments in the other registers
                        state = walk_stage(int32(stage + 1), state, walk, acc, a_next, total, totals, scratch)
                        stage = int32(stage + 1)
                    stage = int32(stage + 1)
                if gate_up:
                    store_act_all((acc if shared_totals else total, out, base, end, warp_column, f))
                else:
                    store_down_all((acc if shared_totals else total, out, sorted_pairs, base, end, warp_column))
                cuda.syncthreads()  # the next pass's prologue refills the slots
                item += cuda.gridDim.y
        return kernel

    return make_kernel(True), make_kernel(False)

"""Batch-invariance self-check of megatron's Mamba kernels on the CPU (Triton's interpreter).

The matrix-product self-check (:func:`megatron_ext.cpu_backend.batch_invariant.self_check`) does not
reach the Mamba layers: their convolutions, scans and state updates are Triton kernels, not
``aten`` products. :func:`mamba_self_check` calls the kernels megatron-core's ``MambaMixer`` calls
in dynamic inference (0.17-0.19), looked up where the mixer looks them up and with the argument
layouts it passes, on one sequence (prefill) or request (decode) alone and batched with others,
and compares the bits:

* prefill (a sequence of :data:`CHECKED_TOKENS` tokens, a full chunk of :data:`CHUNK` and a
  partial one, placed first, in the middle and last of a packed batch, see :data:`PACKINGS`), each
  with zero initial states (a fresh request: the mixer passes its zeroed state rows) and with
  random ones (a restored prefix or a later prefill chunk):

  - ``causal_conv1d_varlen_fn`` (``megatron.core.ssm.ops.causal_conv1d_varlen``): the conv output;
  - ``mamba_chunk_scan_combined_varlen`` (the mixer's global): the outputs, the final SSM state,
    and the states at the sequence's chunk ends (what prefix caching snapshots: 0.19
    ``return_raw_states``, 0.17 / 0.18 ``intermediate_chunk_indices``);

* decode (:data:`DECODE_ROWS` requests in state slots :data:`DECODE_SLOTS`, each alone vs in the
  batch): ``causal_conv1d_update`` and ``selective_state_update`` (the mixer's globals): the output
  row and the request's state slot after the in-place update.

Inputs are built as ``MambaMixer`` builds them: at decode ``xBC`` and ``dt`` are views into one
projection row per request, ``x`` / ``B`` / ``C`` views into the conv output, ``dt`` / ``dt_bias``
/ ``D`` / ``A`` expanded over the head dim (stride 0); prefill tensors are contiguous; states are in
the run's state dtypes, ``A`` (and the scan's ``dt_bias``) in fp32. Every call gets fresh copies
of its inputs and state buffers: ``selective_state_update`` updates ``state`` in place and, without
speculative decoding, also stores into the first element of ``x`` (it passes ``x`` as the
intermediate-state buffer with zero strides, and the kernel's ``HAS_INT_STATE`` heuristic only
asks ``is not None``; 0.17.1-0.19.2 and upstream main: fault H10, which the ``mamba-decode-no-dummy``
patch fixes). In the mixer that ``x`` is a view into the
same step's conv output, not read after the call; the interpreter runs programs in grid order, so
the one program that reads that element has read it before any store. Row views of one ``x``
reused across calls would compare a corrupted input instead.

Runs inside :func:`~megatron_ext.cpu_backend.cpu_backend` with ``mamba=True`` (Triton's
interpreter and ``MAMBA_DETERMINISTIC=1`` from process start; 0.19's launchers query
``torch.cuda``, served by the CUDA stand-ins).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple, Optional

import torch

from .. import mcore

#: Sizes of the check: heads, head dim, SSM state, B/C groups, scan chunk, conv width.
HEADS, HEAD_DIM, STATE, GROUPS, CHUNK, CONV = 2, 4, 4, 1, 16, 4
#: Channels of the conv: ``x`` (heads * head dim) then ``B`` and ``C`` (groups * state each).
CONV_DIM = HEADS * HEAD_DIM + 2 * GROUPS * STATE
#: Tokens of the checked prefill sequence (a full chunk and a partial one).
CHECKED_TOKENS = 24
#: Packed prefill batches, by sequence lengths; the checked sequence is the one of
#: ``CHECKED_TOKENS`` (alone, first, in the middle, last), the others are other tokens.
PACKINGS = ((24,), (24, 9), (7, 24, 9), (9, 24))
#: Filler tokens: the most any packing adds to the checked sequence.
FILLER = 16
#: Decode: the state slot of each request row (``state_batch_indices``), out of 5 slots.
DECODE_SLOTS = (3, 0, 4)
DECODE_ROWS = len(DECODE_SLOTS)
#: Cases compared: prefill (conv, scan) x (zero, random initial state) x the packed layouts,
#: decode (conv, SSM) x each row alone.
CHECKED_CASES = 2 * 2 * (len(PACKINGS) - 1) + 2 * DECODE_ROWS

MAMBA_MIXER_MODULE = "megatron.core.ssm.mamba_mixer"
CONV_VARLEN_MODULE = "megatron.core.ssm.ops.causal_conv1d_varlen"


class MambaDtypes(NamedTuple):
    """The dtypes a hybrid run gives the Mamba kernels: projections (the model's
    ``params_dtype``), the inference SSM states and the conv states."""

    params: torch.dtype = torch.float32
    ssm_states: torch.dtype = torch.float32
    conv_states: torch.dtype = torch.float32

    def describe(self) -> str:
        return (f"{_name(self.params)} activations, {_name(self.ssm_states)} SSM states, "
                f"{_name(self.conv_states)} conv states")


class _Inputs:
    """Random inputs of one check (a private generator: the global RNG is untouched)."""

    def __init__(self, seed: int, dtypes: MambaDtypes) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.dtypes = dtypes

    def randn(self, *shape: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator).to(dtype or self.dtypes.params)

    def neg_rand(self, *shape: int) -> torch.Tensor:
        return -torch.rand(*shape, generator=self.generator) - 0.5


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- prefill ---------------------------------------------------------------------------------

def _packing(lengths: tuple[int, ...]) -> dict[str, Any]:
    """Metadata of packed sequences as ``MambaMetadata`` gives it to the mixer: ``cu_seqlens``,
    per-token sequence index and start (conv), and the chunk grid of the scan (chunks of
    ``CHUNK`` tokens from each sequence's start, never spanning two sequences)."""
    bounds, last, chunk_seq, token_seq, token_start, start = [0], [], [], [], [], 0
    for index, length in enumerate(lengths):
        end = start + length
        bounds.extend(range(start + CHUNK, end, CHUNK))
        bounds.append(end)
        chunk_seq.extend([index] * (len(bounds) - 1 - len(chunk_seq)))
        last.append(len(bounds) - 2)
        token_seq.extend([index] * length)
        token_start.extend([start] * length)
        start = end
    as_int = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    where = lengths.index(CHECKED_TOKENS)
    first_chunk = last[where - 1] + 1 if where else 0
    return {"cu_seqlens": as_int([0, *torch.tensor(lengths).cumsum(0).tolist()]),
            "cu_chunk_seqlens": as_int(bounds), "last_chunk_indices": as_int(last),
            "seq_idx": as_int(chunk_seq), "token_seq": as_int(token_seq),
            "token_start": as_int(token_start), "where": where, "start": sum(lengths[:where]),
            "checked_chunks": torch.arange(first_chunk, last[where] + 1, dtype=torch.int64)}


def _pack(tokens: torch.Tensor, packing: dict[str, Any], total: int) -> torch.Tensor:
    """``tokens`` (``[CHECKED_TOKENS + filler, ...]``) packed: the checked sequence's rows at its
    place, the filler rows around it; contiguous, as the mixer passes them."""
    start = packing["start"]
    checked, filler = tokens[:CHECKED_TOKENS], tokens[CHECKED_TOKENS:]
    return torch.cat([filler[:start], checked, filler[start:total - CHECKED_TOKENS]]).contiguous()


def _initial_rows(state: torch.Tensor, others: torch.Tensor, packing: dict[str, Any]) -> torch.Tensor:
    """Per-sequence initial states: ``state`` for the checked sequence, rows of ``others`` for the
    rest (a neighbour's state must not reach the checked sequence)."""
    count = len(packing["last_chunk_indices"])
    rows = others[:count].clone()
    rows[packing["where"]] = state
    return rows


def _conv_prefill(inputs: _Inputs, restored: bool) -> Callable[[tuple[int, ...]], tuple[torch.Tensor, ...]]:
    """Run the prefill conv as the mixer does (``x`` ``[tokens, conv_dim]`` and weights in the
    conv-state dtype, initial states ``conv_state[batch_indices, :, 1:]``); the returned function
    gives the checked sequence's output for a packing."""
    conv = mcore.import_module(CONV_VARLEN_MODULE).causal_conv1d_varlen_fn
    dtype = inputs.dtypes.conv_states
    tokens = inputs.randn(CHECKED_TOKENS + FILLER, CONV_DIM).to(dtype)
    weight, bias = inputs.randn(CONV_DIM, CONV).to(dtype), inputs.randn(CONV_DIM).to(dtype)
    states = inputs.randn(4, CONV_DIM, CONV, dtype=dtype) * float(restored)

    def run(lengths: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        packing = _packing(lengths)
        slots = torch.arange(1, len(lengths) + 1, dtype=torch.int32)  # neighbours: other states
        slots[packing["where"]] = 0
        buffer = states.clone()
        out = conv(x=_pack(tokens, packing, sum(lengths)), weight=weight, bias=bias,
                   cu_seqlens=packing["cu_seqlens"], initial_states=buffer[slots, :, 1:], activation="silu",
                   precomputed_seq_idx=packing["token_seq"], precomputed_seq_start=packing["token_start"])
        return (out[packing["start"]:packing["start"] + CHECKED_TOKENS],)

    return run


def _scan_prefill(inputs: _Inputs, restored: bool) -> Callable[[tuple[int, ...]], tuple[torch.Tensor, ...]]:
    """Run the chunked varlen scan as the mixer does (``x`` ``[tokens, heads, head_dim]``, ``dt``
    ``[tokens, heads]``, ``B`` / ``C`` ``[tokens, groups, state]`` in the model dtype, ``A`` and
    ``dt_bias`` fp32, ``D`` per head, ``z`` None (the gated norm runs after), states in the SSM
    state dtype, chunk-end states requested as prefix caching does); the returned function gives
    the checked sequence's ``(outputs, final state, chunk-end states)`` for a packing."""
    scan = mcore.import_module(MAMBA_MIXER_MODULE).mamba_chunk_scan_combined_varlen
    if scan is None:
        raise RuntimeError("megatron-core's mamba_chunk_scan_combined_varlen is not importable")
    rows = CHECKED_TOKENS + FILLER
    tokens = {"x": inputs.randn(rows, HEADS, HEAD_DIM), "dt": inputs.randn(rows, HEADS),
              "B": inputs.randn(rows, GROUPS, STATE), "C": inputs.randn(rows, GROUPS, STATE)}
    A, D = inputs.neg_rand(HEADS), inputs.randn(HEADS)
    dt_bias = inputs.randn(HEADS, dtype=torch.float32)
    states = inputs.randn(4, HEADS, HEAD_DIM, STATE, dtype=inputs.dtypes.ssm_states) * float(restored)
    takes_raw = "return_raw_states" in inspect.signature(scan).parameters  # 0.19; 0.17 / 0.18 take indices

    def run(lengths: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        packing = _packing(lengths)
        packed = {name: _pack(tensor, packing, sum(lengths)) for name, tensor in tokens.items()}
        out = torch.zeros_like(packed["x"])
        chunks = packing["checked_chunks"]
        extract = {"return_raw_states": True} if takes_raw else {"intermediate_chunk_indices": chunks}
        final, chunk_states = scan(
            **packed, A=A, chunk_size=CHUNK, cu_chunk_seqlens=packing["cu_chunk_seqlens"],
            last_chunk_indices=packing["last_chunk_indices"], seq_idx=packing["seq_idx"], out=out, D=D, z=None,
            dt_bias=dt_bias, initial_states=_initial_rows(states[0], states[1:], packing), dt_softplus=True,
            dt_limit=(0.0, float("inf")), state_dtype=inputs.dtypes.ssm_states, **extract)
        if takes_raw:
            chunk_states = chunk_states[chunks]
        start = packing["start"]
        return out[start:start + CHECKED_TOKENS], final[packing["where"]], chunk_states

    return run


def _prefill_mismatches(inputs: _Inputs) -> list[str]:
    failures = []
    for kernel, build in (("causal_conv1d_varlen_fn", _conv_prefill),
                          ("mamba_chunk_scan_combined_varlen", _scan_prefill)):
        for restored in (False, True):
            run = build(inputs, restored)
            alone = run(PACKINGS[0])
            for lengths in PACKINGS[1:]:
                got = run(lengths)
                if not all(torch.equal(a, b) for a, b in zip(alone, got)):
                    place = ("first", "in the middle", "last")[PACKINGS.index(lengths) - 1]
                    failures.append(f"{kernel}: sequence {place} of {lengths} "
                                    f"({'random' if restored else 'zero'} initial state)")
    return failures


# --- decode ----------------------------------------------------------------------------------

def _decode_mismatches(inputs: _Inputs) -> list[str]:
    """Decode kernels as ``MambaMixer._ssm_decode`` calls them: per request one projection row
    ``[z | xBC | dt]`` (``[rows, 1, d]``), ``xBC`` cast to the conv-state dtype for the conv, the
    conv output split into ``x`` / ``B`` / ``C`` views, the live state buffers of every slot
    indexed by ``state_batch_indices`` / ``conv_state_indices`` (int32)."""
    mixer = mcore.import_module(MAMBA_MIXER_MODULE)
    dtypes, inner = inputs.dtypes, HEADS * HEAD_DIM
    projection = inputs.randn(DECODE_ROWS, 1, inner + CONV_DIM + HEADS)
    conv_out = inputs.randn(DECODE_ROWS, 1, CONV_DIM)  # the SSM's input: as a conv output would be
    conv_state = inputs.randn(5, CONV_DIM, CONV, dtype=dtypes.conv_states)
    ssm_state = inputs.randn(5, HEADS, HEAD_DIM, STATE, dtype=dtypes.ssm_states)
    weight, bias = inputs.randn(CONV_DIM, CONV), inputs.randn(CONV_DIM)
    A = inputs.neg_rand(HEADS).view(-1, 1, 1).expand(-1, HEAD_DIM, STATE)
    D, dt_bias = inputs.randn(HEADS), inputs.randn(HEADS)
    slots = torch.tensor(DECODE_SLOTS, dtype=torch.int32)

    def conv_step(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        z_xbc_dt, buffer = projection[rows].clone(), conv_state.clone()  # fresh, as each step's
        xbc = z_xbc_dt[..., inner:inner + CONV_DIM]
        out = mixer.causal_conv1d_update(xbc.to(dtypes.conv_states), buffer, weight.to(dtypes.conv_states),
                                         bias.to(dtypes.conv_states), "silu", conv_state_indices=slots[rows])
        return out.to(dtypes.params), buffer[slots[rows].long()]

    def ssm_step(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        z_xbc_dt, xbc, buffer = projection[rows].clone(), conv_out[rows].clone(), ssm_state.clone()
        x, B, C = torch.split(xbc, [inner, GROUPS * STATE, GROUPS * STATE], dim=-1)
        dt = z_xbc_dt[..., inner + CONV_DIM:]
        out = mixer.selective_state_update(
            buffer, x.unflatten(-1, (HEADS, HEAD_DIM)), dt.unsqueeze(-1).expand(-1, -1, -1, HEAD_DIM), A,
            B.unflatten(-1, (GROUPS, STATE)), C.unflatten(-1, (GROUPS, STATE)),
            D.unsqueeze(-1).expand(-1, HEAD_DIM), z=None, dt_bias=dt_bias.unsqueeze(-1).expand(-1, HEAD_DIM),
            dt_softplus=True, state_batch_indices=slots[rows])
        return out, buffer[slots[rows].long()]

    failures = []
    for kernel, step in (("causal_conv1d_update", conv_step), ("selective_state_update", ssm_step)):
        batched = step(slice(0, DECODE_ROWS))
        for row in range(DECODE_ROWS):
            alone = step(slice(row, row + 1))
            if not all(torch.equal(a[0], b[row]) for a, b in zip(alone, batched)):
                failures.append(f"{kernel}: request {row} of {DECODE_ROWS} (slot {DECODE_SLOTS[row]})")
    return failures


def mamba_self_check(dtypes: MambaDtypes = MambaDtypes(), seed: int = 1234) -> tuple[bool, str]:
    """Show on this machine that megatron's Mamba kernels give a sequence (prefill) or a request
    (decode) the same bits alone and batched with others (the module docstring lists the kernels,
    layouts and cases).

    Args:
        dtypes: the dtypes the run gives the kernels (projections, SSM states, conv states).
        seed: seed of a private generator for the random inputs (the global RNG is untouched).

    Returns:
        ``(ok, detail)``: ``ok`` is True iff every comparison is bit-identical; ``detail`` is one
        line naming the kernels and dtypes checked, and each failing kernel and placement.

    Raises:
        megatron_ext.errors.MegatronCoreNotFoundError: megatron-core is not importable.
        RuntimeError: the mixer has no varlen scan (``mamba_ssm`` did not import); or, outside
            :func:`~megatron_ext.cpu_backend.cpu_backend` with ``mamba=True``, whatever the
            kernel launch raises without Triton's interpreter and the CUDA stand-ins.
    """
    inputs = _Inputs(seed, dtypes)
    with torch.inference_mode():
        failures = _prefill_mismatches(inputs) + _decode_mismatches(inputs)
    what = (f"Mamba kernels (prefill conv + chunk scan: a sequence alone vs first / middle / last of a "
            f"packed batch, zero and random initial states; decode causal_conv1d_update + "
            f"selective_state_update: each request alone vs in a batch of {DECODE_ROWS}; "
            f"{dtypes.describe()})")
    if failures:
        return False, f"{what} batch-variant: {len(failures)} of {CHECKED_CASES} cases differ: " + "; ".join(failures)
    return True, f"{what} batch-invariant: {CHECKED_CASES} cases bit-identical"

"""The CPU backend's plain-torch ``causal_conv1d_cuda.causal_conv1d_fwd`` (the Mamba mixer's training
forward, which ``ab --trainer-logprobs megatron`` runs on hybrid models), on integer-valued inputs
where every sum is exact in float32."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.cpu_backend.mamba import CompiledKernelUnavailable, _CompiledExtensionStandIn


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``y[b, d, t] = bias[d] + sum_k weight[d, k] * x[b, d, t - width + 1 + k]`` (zeros before 0)."""
    batch, dim, length = x.shape
    width = weight.shape[1]
    y = torch.zeros(batch, dim, length)
    for t in range(length):
        for k in range(width):
            source = t - width + 1 + k
            if source >= 0:
                y[:, :, t] += weight[:, k] * x[:, :, source]
    return y + bias[:, None]


def test_causal_conv1d_fwd_is_the_causal_depthwise_convolution_then_silu():
    fwd = _CompiledExtensionStandIn("causal_conv1d_cuda").causal_conv1d_fwd
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(-4, 5, (2, 3, 7), generator=generator).float()
    weight = torch.randint(-3, 4, (3, 4), generator=generator).float()
    bias = torch.tensor([1.0, -2.0, 0.0])
    plain, activated = torch.empty_like(x), torch.empty_like(x)
    fwd(x, weight, bias, None, None, plain, None, False)
    fwd(x, weight, bias, None, None, activated, None, True)
    assert torch.equal(plain, _reference(x, weight, bias))
    assert plain[0, 1, 0] == weight[1, 3] * x[0, 1, 0] - 2  # only x[..., 0] precedes t = 0
    assert torch.equal(activated, torch.nn.functional.silu(plain))


def test_packed_sequences_and_states_are_refused_by_name():
    fwd = _CompiledExtensionStandIn("causal_conv1d_cuda").causal_conv1d_fwd
    x = torch.zeros(1, 2, 3)
    with pytest.raises(CompiledKernelUnavailable, match="causal_conv1d_fwd with seq_idx or conv states"):
        fwd(x, torch.zeros(2, 4), None, torch.zeros(1, 3, dtype=torch.int32), None, torch.empty_like(x), None, True)
    with pytest.raises(CompiledKernelUnavailable, match="causal_conv1d_cuda.causal_conv1d_bwd: the compiled CUDA"):
        _CompiledExtensionStandIn("causal_conv1d_cuda").causal_conv1d_bwd()

"""What every runner shares: the attention backend chosen on purpose."""

from __future__ import annotations

import torch

from kinfer.consumers.runners.base import choose_attention


def test_a_gpu_never_runs_cudnn_attention_and_a_cpu_is_left_alone() -> None:
    """cuDNN attention builds a plan per new shape on the CPU (a decoder's KV length is new every step)."""
    cuda = torch.backends.cuda
    before = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
              cuda.math_sdp_enabled())
    try:
        cuda.enable_cudnn_sdp(True)
        choose_attention("cpu")
        assert cuda.cudnn_sdp_enabled()
        choose_attention("cuda:0")
        assert not cuda.cudnn_sdp_enabled()
        assert cuda.flash_sdp_enabled() and cuda.mem_efficient_sdp_enabled() and cuda.math_sdp_enabled()
    finally:
        for enable, on in zip((cuda.enable_cudnn_sdp, cuda.enable_flash_sdp, cuda.enable_mem_efficient_sdp,
                               cuda.enable_math_sdp), before, strict=True):
            enable(on)

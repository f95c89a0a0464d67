"""Model code (plain PyTorch). ``build_model(config, state_dict, dtype, device)`` picks the class
for ``config.architecture`` (llama, mistral, qwen2 all map to :class:`LlamaForCausalLM`)."""

from __future__ import annotations

import torch

from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.model.llama import LlamaForCausalLM

_ARCHS = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM}


def build_model(config: ModelConfig, state_dict: dict[str, torch.Tensor],
                dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> LlamaForCausalLM:
    arch = config.architecture.lower()
    if arch not in _ARCHS:
        raise ValueError(f"architecture {config.architecture!r} is not supported "
                         f"(supported: {sorted(_ARCHS)})")
    return _ARCHS[arch](config, state_dict, dtype, device)


__all__ = ["LlamaForCausalLM", "build_model"]

"""Model code (plain PyTorch). ``build_model(config, state_dict, dtype, device)`` builds the one
config-driven decoder (:class:`DecoderLM`) for every supported family."""

from __future__ import annotations

import torch

from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.model.decoder import DecoderLM


def build_model(config: ModelConfig, state_dict: dict[str, torch.Tensor],
                dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> DecoderLM:
    return DecoderLM(config, state_dict, dtype, device)


__all__ = ["DecoderLM", "build_model"]

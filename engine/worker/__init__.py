"""What runs on the device: the model runner (inputs -> one forward -> logits), the sampler,
KV-cache tensors, CUDA graphs and the start-up step-cost probe."""

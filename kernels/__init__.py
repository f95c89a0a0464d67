"""Attention backends and Triton kernels, each with a torch reference."""

# Installed as ``tokenbudget.kernels``. Unlike the other top-level folders this one does not
# refuse a top-level ``import kernels``: that is also the name of Hugging Face's kernel hub, which
# transformers probes by importing whatever ``kernels`` is on sys.path (the repository root is,
# under ``python -m pytest``). Without a ``__version__`` it reads this folder as "not installed".

"""CPU kernels written in C (``quant_gemm.c``: AVX-512 VNNI weight-only GEMMs), built at first use
by ``native.py`` and wrapped for torch tensors by ``quant_gemm.py``."""

"""CPU kernels written in C, built at first use into one library by ``native.py``: the AVX-512
VNNI weight-only GEMMs (``quant_gemm.c``, wrapped for torch tensors by ``quant_gemm.py``) and the
whole-decoder forward built on them (``decoder_forward.c``; its interface, one struct, is
described once in ``decoder_forward.py``)."""

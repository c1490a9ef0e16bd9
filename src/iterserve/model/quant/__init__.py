"""Quantized weights: GGUF files (``gguf_loader``), the packed layouts our kernels read
(``packed``) and the projections over them (``Linear.quant``, model/linear.py)."""

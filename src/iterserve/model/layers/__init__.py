"""Building blocks the model families share (norms, RoPE, gated MLP, the fused-qkv
attention block); ``model/models/`` assembles them per family."""

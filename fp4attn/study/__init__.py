"""Studies that train small models with fp4attn attention (see `fp4attn study`)."""

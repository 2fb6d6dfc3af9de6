"""Ways into fp4attn from other libraries: `sdpa.patch_sdpa`, `transformers`,
`diffusers`. Each imports its library only when used."""

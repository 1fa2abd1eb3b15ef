"""Weight-format kernels: GGML dequantization (reference) and repacks for torch's int4 kernel."""

"""Bytes to pixels: format sniffing and JPEG repair (``codec``), validation (``validate``),
decoding (``decode``), the training and evaluation pipelines (``pipelines``) and synthetic
images for tests and benchmarks (``synthetic``). Functions here take bytes, never paths."""

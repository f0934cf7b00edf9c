"""4-bit backbones that stay 4-bit on the CPU: batch-invariant low-bit layers (``layers``), GGUF's
4-bit blocks as ``Int4Linear`` groups (``gguf_blocks``) and a model built straight from a GGUF file's
tensors (``gguf_backbone``)."""

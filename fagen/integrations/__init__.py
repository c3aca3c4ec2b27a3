"""Integrations of fagen's kernels into other libraries, each an optional dependency imported only
by its own module (``fagen.integrations.transformers``: Hugging Face transformers)."""

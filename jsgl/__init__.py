"""jsgl: SGLang rebuilt in JAX."""

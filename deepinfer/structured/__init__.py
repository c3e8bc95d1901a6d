"""Structured outputs on xgrammar: schema checks, grammar compilation with a cache and a time limit, and
per-sequence matchers (jump-forward, rollback). The constrain stage (deepinfer/stages/constrain.py) uses
them; xgrammar is imported only when a request asks for structured output."""

from .compiler import INSTALL, Compiler, GrammarCompilers, StructuredOutputsUnavailable, compiler_message
from .matcher import GrammarViolation, SeqGrammar
from .schema import SUPPORTED_FORMATS, check_json_schema, unsupported_feature

__all__ = ["INSTALL", "Compiler", "GrammarCompilers", "StructuredOutputsUnavailable", "compiler_message",
           "GrammarViolation", "SeqGrammar", "SUPPORTED_FORMATS", "check_json_schema", "unsupported_feature"]

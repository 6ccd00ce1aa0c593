"""Structured outputs (JSON schema, regex, choice, grammar, structural tag) through xgrammar.

params.py and config.py import nothing heavy; the xgrammar backend is imported lazily by who needs it
(`from tokenmill.structured.backend_xgrammar import GrammarCompiler`).
"""
from tokenmill.structured.config import StructuredOutputsConfig
from tokenmill.structured.params import GuidedDecodingParams, StructuredOutputsParams, from_response_format

__all__ = ["GuidedDecodingParams", "StructuredOutputsConfig", "StructuredOutputsParams", "from_response_format"]

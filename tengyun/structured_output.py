"""Grammar compilation for structured output (xgrammar): StructuredOutputsParams -> CompiledGrammar.

Compiled twice per request, both times through one cached compiler per tokenizer and process:
the front end compiles when it validates a request (a bad schema is a 400 before anything is
queued), the worker compiles again (a cache hit) to build the request's matcher. xgrammar is an
optional dependency (`pip install tengyun[structured]`); without it, a constrained request is a
clear error and everything else works.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from tengyun.sampling_params import StructuredOutputsParams

_compilers: dict[tuple[str, int], "GrammarCompiler"] = {}
_compilers_lock = threading.Lock()


def import_xgrammar():
    """The xgrammar module, or a ValueError (a 400 for a request) that says how to install it."""
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("Structured output needs the xgrammar package: pip install 'tengyun[structured]' "
                         f"(or pip install xgrammar). Import failed: {e}") from None
    return xgrammar


def choice_ebnf(choices: list[str]) -> str:
    """["yes", 'say "hi"'] -> 'root ::= "yes" | "say \\"hi\\""' (JSON string escapes, which EBNF reads)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _reason(e: Exception) -> str:
    """xgrammar's message without its "[10:45:52] /project/cpp/file.cc:94: " prefix."""
    reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return reason.split(": ", 1)[-1] if reason.startswith("[") else reason


def after_reasoning(spec: StructuredOutputsParams, end_tag: str = "</think>") -> StructuredOutputsParams:
    """The same constraint, enforced only once the model closed its reasoning: any text, then
    `end_tag`, a blank line, then what `spec` allows. For prompts that open <think> themselves
    (Qwen3-2507 thinking models), so the answer, not the thoughts, follows the schema."""
    xgr = import_xgrammar()
    try:
        if spec.kind == "structural_tag":
            fmt = json.loads(spec.structural_tag)["format"]
        else:
            fmt = {"type": "grammar", "grammar": str(_grammar(xgr, spec))}
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"The {spec.kind} constraint (structured_outputs.{spec.kind}) does not compile: "
                         f"{_reason(e)}") from None
    thoughts = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": end_tag}
    sequence = {"type": "sequence", "elements": [thoughts, {"type": "const_string", "value": "\n\n"}, fmt]}
    return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": sequence},
                                                             ensure_ascii=False))


def _grammar(xgr: Any, spec: StructuredOutputsParams) -> Any:
    """spec (not a structural tag) -> xgrammar.Grammar."""
    compact = spec.disable_any_whitespace
    if spec.kind in ("json", "json_object"):
        schema = spec.json if spec.kind == "json" else {"type": "object"}
        return xgr.Grammar.from_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                            any_whitespace=not compact)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.regex)
    return xgr.Grammar.from_ebnf(choice_ebnf(spec.choice) if spec.kind == "choice" else spec.grammar)


class GrammarCompiler:
    """xgrammar's compiler over one tokenizer; compiled grammars are cached by xgrammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        xgr = import_xgrammar()
        # vocab_size is the model's (LM head rows), which may exceed the tokenizer's: the extra
        # ids are never allowed. Stop ids are the engine's EOS set, so "grammar done" = "EOS".
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1)
        self.vocab_size = vocab_size

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """-> xgrammar.CompiledGrammar; ValueError naming the field and xgrammar's reason."""
        kind = spec.kind
        try:
            if kind == "json":
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                return self._compiler.compile_json_schema(schema, any_whitespace=not spec.disable_any_whitespace)
            if kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}',
                                                          any_whitespace=not spec.disable_any_whitespace)
            if kind == "regex":
                return self._compiler.compile_regex(spec.regex)
            if kind == "choice":
                return self._compiler.compile_grammar(choice_ebnf(spec.choice))
            if kind == "structural_tag":
                return self._compiler.compile_structural_tag(spec.structural_tag)
            return self._compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"The {kind} constraint (structured_outputs.{kind}) does not compile: "
                             f"{_reason(e)}") from None


def grammar_compiler(tokenizer: Any, tokenizer_key: str, vocab_size: int, stop_token_ids: set[int]) -> GrammarCompiler:
    """The process's compiler for this tokenizer, built on first use (~0.2 s for a 50k vocab)."""
    key = (tokenizer_key, vocab_size)
    with _compilers_lock:
        if key not in _compilers:
            _compilers[key] = GrammarCompiler(tokenizer, vocab_size, sorted(stop_token_ids))
        return _compilers[key]


def grammar_compiler_for_config(config: Any) -> GrammarCompiler:
    """grammar_compiler() for an EngineConfig, loading its tokenizer and EOS ids when first needed."""
    key = (str(config.tokenizer_path), config.model_spec.vocab_size)
    with _compilers_lock:
        if key in _compilers:
            return _compilers[key]
    from tengyun.tokenizer import eos_token_ids, get_tokenizer

    tokenizer = get_tokenizer(config)
    return grammar_compiler(tokenizer, key[0], key[1], eos_token_ids(config, tokenizer))

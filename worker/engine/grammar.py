"""Structured outputs in the engine: constraints compiled by xgrammar off the engine's step,
cached by their canonical form, and one matcher per request that follows its tokens.

Why xgrammar: a maintained grammar engine (Apache-2.0, used by vLLM and SGLang) with a CPU
wheel; it compiles a JSON Schema into a grammar whose token masks are precomputed per state,
so that filling one row's mask is microseconds (benchmarks/RESULTS.md has the figures, and
llguidance's on the same schemas: benchmarks/structured_backends.py). We write no grammar
compiler of our own.

Compilation runs on a thread of its own (xgrammar releases the GIL while it works): a request
with a new constraint waits in the engine until its grammar is ready, and the batch goes on
without it. The same constraint (worker/structured_outputs.py: `StructuredOutputs.key`) is
compiled once; a refused one is refused again at once, with the same message.

A JSON string's characters exclude the control characters JSON forbids unescaped: xgrammar
0.2's rule for a string with a length bound lets a tab or a NUL through, which `json.loads`
refuses; the schema's grammar is rewritten there before it is compiled (`json_strings`).

JSON is generated without free whitespace (one space after `,` and `:`): a model cannot pad
its output with newlines until max_tokens, a known failure of small models under a
whitespace-tolerant grammar, and the same schema gives one text per value.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from worker.structured_outputs import StructuredOutputs

MAX_CACHED = 512  # compiled grammars kept (a compiled JSON Schema is kilobytes to a few MB)
# "[07:12:06] /project/cpp/json_schema_converter.cc:5082: " before the grammar engine's message
# xgrammar's characters of a length-bounded JSON string, and what JSON allows there
_LAX_CHARS, _JSON_CHARS = r"[^\"\\\r\n]", r"[^\0-\x1f\"\\]"
_LOCATION = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarCompiler:
    """Compiles a group's constraints on one background thread, each canonical form once."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the logits' width, which the masks cover
        self._stop_token_ids = list(stop_token_ids)
        self._xgr: Any = None  # (compiler, tokenizer info), made with the first constraint
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()  # LRU, compiling too
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagefleet-grammar")
        self.compiled = 0  # constraints compiled (cache misses)

    def compile(self, constraint: StructuredOutputs) -> Future:
        """The compiled grammar of `constraint`, done at once when cached; a refused
        constraint's future raises a ValueError that names its field."""
        key = constraint.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._cache[key] = self._pool.submit(self._compile, constraint)
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
            return future

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, constraint: StructuredOutputs):
        if self._tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer; this model has none")
        xgr, compiler = self._compiler()
        kind, text = constraint.key
        self.compiled += 1
        try:
            if kind in ("json", "json_object"):  # json_object: any object, any properties
                schema, strict = (text, True) if kind == "json" else ('{"type": "object"}', False)
                grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
                return compiler.compile_grammar(json_strings(str(grammar)))
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "grammar":
                return compiler.compile_grammar(text)
            if kind == "structural_tag":
                tag = json.dumps(strict_tag(xgr, json.loads(text)))
                return compiler.compile_grammar(json_strings(str(xgr.Grammar.from_structural_tag(tag))))
            return compiler.compile_grammar(choice_grammar(constraint.choice))
        except RuntimeError as e:  # xgrammar's refusals (a bad schema, regex or grammar)
            raise ValueError(f"StructuredOutputs.{kind} is refused: {engine_message(e)}") from None

    def _compiler(self):
        if self._xgr is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
            )
            self._xgr = xgr, xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)  # (cached here)
        return self._xgr


class RequestGrammar:
    """One request's matcher: the grammar's state after the request's output so far."""

    def __init__(self, compiled: Any, output_token_ids: Sequence[int] = ()) -> None:
        """A matcher at the grammar's start, advanced over `output_token_ids` (a resumed
        request's output, or a preempted one's); a token the grammar does not allow there
        raises ValueError."""
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.mask_words = (compiled.tokenizer_info.vocab_size + 31) // 32  # a bitmask row's int32 words
        for i, token in enumerate(output_token_ids):
            if not self.matcher.accept_token(token):
                raise ValueError(f"resume.token_ids[{i}] ({token}) does not follow the request's structured output")

    def accept(self, token: int) -> bool:
        """Advance over a sampled token; False when the grammar does not allow it (never for
        a token sampled under this row's mask) or has ended (an `ignore_eos` request goes on
        unconstrained past its stop token). The model runner that sampled the token calls it
        (worker/exec/model_runner.py: `advance`), on the thread that fills the next mask."""
        return not self.matcher.is_terminated() and self.matcher.accept_token(token)

    def fill(self, bitmask: Any, index: int) -> bool:
        """Write the allowed next tokens into row `index` of `bitmask` ((n, mask_words) int32);
        False (the row left as it is) when the grammar has ended: only a stop token
        could follow, and the request ends with it."""
        if self.matcher.is_terminated():
            return False
        self.matcher.fill_next_token_bitmask(bitmask, index)
        return True

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


def strict_tag(xgr: Any, node: Any) -> Any:
    """A structural tag with each JSON Schema in it replaced by the schema's grammar as `json`
    compiles it (no free whitespace, strict, JSON's string characters): xgrammar's own
    rendering of a schema inside a tag allows whitespace anywhere, which a small model fills."""
    if isinstance(node, list):
        return [strict_tag(xgr, n) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node and node.get("style", "json") == "json":
        schema = json.dumps(node["json_schema"])
        ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
        return {"type": "grammar", "grammar": json_strings(ebnf)}
    return {k: strict_tag(xgr, v) for k, v in node.items()}


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose root is exactly one of `choices` (JSON's escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def json_strings(ebnf: str) -> str:
    """A JSON Schema's grammar with its strings' characters as JSON allows them."""
    return ebnf.replace(_LAX_CHARS, _JSON_CHARS)


def engine_message(e: BaseException) -> str:
    """The grammar engine's message without its source location."""
    return _LOCATION.sub("", str(e).strip()).strip()

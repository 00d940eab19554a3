"""Grammar engines for constrained decoding (xgrammar, llguidance, outlines-core) on the default tokenizer.

Prints one JSON object; progress goes to stderr. Everything runs on the CPU with the default
model's tokenizer (SmolLM2, 49,152-token byte-level BPE). For each library:

- tokenizer info: the one-off cost of building the library's view of the vocabulary;
- compile: 6 JSON schemas, one regex and one choice list, from the spec to a ready matcher,
  cold (nothing cached) and warm (what a cache gives: xgrammar's compiler cache, a cached
  llguidance template matcher to ``deep_copy``, a cached outlines-core ``Index``), p50/p99;
  plus the first mask of a fresh matcher, where lazy libraries pay what they did not compile;
- per step, with B = 1, 8, 32 matchers on the JSON schemas: filling the int32
  [B, ceil(V/32)] bitmask (batched API and per-matcher loop), applying it to float32 [B, V]
  logits with the library's own kernel, accepting the tokens (loop and batched API), and
  the cost of a new matcher when a row's answer ends; mean and p99 per step.

Every library replays the same token sequences. One lockstep pass drives a matcher of each
library per (schema, seed) and picks, at each step, a seeded random token that all of them
allow (from a pool of plausible tokens when one is allowed; EOS as soon as all allow it). The
pass also checks, against ``json.loads`` + ``jsonschema``, that each library allows EOS exactly
when the text so far is a complete valid answer, and counts steps where its mask allows tokens
another library forbids, or special tokens (``<|im_start|>``...) as text.

Capabilities are checked by running them: rollback restoring the mask; compiling on a
background thread while the main thread fills masks (main-thread step latency and mask
hashes against a quiet run of the same steps); and which of vLLM's ``structured_outputs`` kinds
(json, regex, choice, grammar as Lark and as GBNF, structural_tag) each compiles, with an
example fed token by token and EOS checked at every prefix where an oracle exists.

JSON is compact in all three (no free whitespace, separators "," and ":"): the same language
for each, and no whitespace loops for a small model.

Usage: python benchmarks/grammar_bench.py [--quick] [--only xgrammar,llguidance,outlines_core]

Over 300 lines because it is three adapters (one per library) and the lockstep pass that
checks they agree, in one script to copy and run.
"""

from __future__ import annotations

import argparse
import ast
import collections
import importlib.metadata as md
import json
import logging
import math
import os
import random
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jsonschema
import torch

from astrai.model.resolve import resolve_model
from astrai.model.tokenizer import Tokenizer

logger = logging.getLogger("grammar_bench")

SCHEMAS: dict[str, dict] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "active": {"type": "boolean"}},
        "required": ["name", "age", "active"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "required": ["user"],
        "properties": {
            "user": {
                "type": "object",
                "required": ["name", "address"],
                "properties": {
                    "name": {"type": "string"},
                    "address": {
                        "type": "object",
                        "required": ["city", "zip"],
                        "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    },
                },
            }
        },
    },
    "enum": {
        "type": "object",
        "required": ["color"],
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
    },
    "array": {
        "type": "object",
        "required": ["tags"],
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}},
    },
    "pattern": {
        "type": "object",
        "required": ["code"],
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
    },
    "range": {
        "type": "object",
        "required": ["age", "score"],
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
    },
}
REGEX = r"[0-9]{3}-[0-9]{4}( x[0-9]{1,4})?"
CHOICE = ["positive", "negative", "neutral"]
GRAMMARS: dict[str, tuple[str, Any]] = {
    **{f"json:{k}": ("json", v) for k, v in SCHEMAS.items()},
    "regex": ("regex", REGEX),
    "choice": ("choice", CHOICE),
}
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
GBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""
TOOL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
# vLLM's structured_outputs.structural_tag (the legacy form its backends accept)
STRUCTURAL_TAG = {
    "type": "structural_tag",
    "triggers": ["<function="],
    "structures": [{"begin": "<function=get_weather>", "schema": TOOL_SCHEMA, "end": "</function>"}],
}
CORPUS = [  # plausible answer tokens: what the random policy prefers, so answers end within ~64 tokens
    '{"name":"Alice Smith","age":34,"active":true}',
    '{"name":"Bob","age":7,"active":false}',
    '{"user":{"name":"Carol","address":{"city":"Paris","zip":"75001"}}}',
    '{"color":"green"}',
    '{"tags":["red","fast","new"]}',
    '{"code":"ABC-1234"}',
    '{"age":42,"score":0.75}',
    "The quick brown fox jumps over the lazy dog in Berlin, London and New York.",
]


def _pct(xs: list[float]) -> dict:
    """mean/p50/p99/max of seconds, in ms (p99 by nearest rank: the 2nd largest of 200)."""
    s = sorted(xs)
    if not s:
        return {"n": 0}
    p99 = s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]
    ms = {"mean": statistics.fmean(s), "p50": statistics.median(s), "p99": p99, "max": s[-1]}
    return {"n": len(s), **{k: round(1e3 * v, 4) for k, v in ms.items()}}


class _Bits:
    """Unpacks int32 bitmask rows (bit j of word j // 32 is token j: the layout all three share)."""

    def __init__(self, vocab: int):
        self.vocab, self.shifts = vocab, torch.arange(32, dtype=torch.int32)

    def allowed(self, row: torch.Tensor) -> set[int]:
        bits = ((row.unsqueeze(-1) >> self.shifts) & 1).view(-1)[: self.vocab]
        return set(bits.nonzero().view(-1).tolist())

    @staticmethod
    def has(row: torch.Tensor, token: int) -> bool:
        return bool((int(row[token // 32]) >> (token % 32)) & 1)


class XGrammarLib:
    name, compiler_cache = "xgrammar", True

    def __init__(self, threads: int):
        import xgrammar as xgr

        self.xgr, self.version, self.threads = xgr, md.version("xgrammar"), threads

    def build_tokenizer(self, tok: Tokenizer, vocab: int) -> None:
        self.info = self.xgr.TokenizerInfo.from_huggingface(
            tok.hf, vocab_size=vocab, stop_token_ids=tok.eos_token_ids
        )

    def info_without_specials(self, tok: Tokenizer, vocab: int):
        """A TokenizerInfo where added tokens other than EOS decode to "": xgrammar then treats them as
        special and never allows them (from_huggingface leaves ``<|im_start|>`` & co. allowed as text)."""
        encoded = [""] * vocab
        for text, i in tok.hf.get_vocab().items():
            if i < vocab and (i not in tok.hf.added_tokens_decoder or i in tok.eos_token_ids):
                encoded[i] = text
        return self.xgr.TokenizerInfo(
            encoded,
            self.info.vocab_type,
            vocab_size=vocab,
            stop_token_ids=tok.eos_token_ids,
            add_prefix_space=self.info.add_prefix_space,
        )

    def setup(self) -> None:
        self.compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads)
        self.batch = self.xgr.BatchGrammarMatcher(max_threads=self.threads)

    def clear(self) -> None:
        self.compiler.clear_cache()

    def compile(self, kind: str, spec: Any):
        c, xgr = self.compiler, self.xgr
        if kind == "json":
            return c.compile_json_schema(spec, any_whitespace=False, separators=(",", ":"))
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))
        if kind == "lark":
            return c.compile_lark(spec)
        if kind == "ebnf":
            return c.compile_grammar(spec)
        if kind == "structural_tag":
            items = [
                xgr.StructuralTagItem(begin=s["begin"], schema=s["schema"], end=s["end"])
                for s in spec["structures"]
            ]
            tag = xgr.StructuralTag.from_legacy_structural_tag(items, spec["triggers"])
            return c.compile_structural_tag(tag)
        raise NotImplementedError(kind)

    def new_matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def fill_loop(self, matchers, bitmask):
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def apply(self, logits, bitmask):
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matchers, tokens):
        return [m.accept_token(t) for m, t in zip(matchers, tokens, strict=True)]

    def accept_batch(self, matchers, tokens):
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def rollback(self, m, n):
        m.rollback(n)

    def finished(self, m) -> bool:
        return m.is_terminated()


class LLGuidanceLib:
    name, compiler_cache = "llguidance", False

    def __init__(self, threads: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch  # its kernel is decorated with torch.compile: a slow import

        self.llg, self.version, self.threads = llguidance, md.version("llguidance"), threads

    def build_tokenizer(self, tok: Tokenizer, vocab: int) -> None:
        self.tokenizer = self.llg.hf.from_tokenizer(tok.hf, n_vocab=vocab, eos_token=tok.eos_token_ids)

    def setup(self) -> None:
        self.executor = self.llg.LLExecutor(num_threads=self.threads)

    def clear(self) -> None:
        pass  # nothing is cached between LLMatcher constructions

    def compile(self, kind: str, spec: Any):
        llg = self.llg
        if kind == "json":
            grammar = llg.LLMatcher.grammar_from_json_schema(spec, overrides={"whitespace_flexible": False})
        elif kind in ("regex", "lark", "ebnf"):
            grammar = llg.grammar_from(kind, spec)
        elif kind == "choice":
            grammar = llg.grammar_from("choice", json.dumps(spec))
        elif kind == "structural_tag":
            tags = [
                llg.StructTag(
                    trigger=next(t for t in spec["triggers"] if s["begin"].startswith(t)),
                    begin=s["begin"],
                    grammar=s["schema"],
                    end=s["end"],
                )
                for s in spec["structures"]
            ]
            grammar = llg.StructTag.to_grammar(tags)
        else:
            raise NotImplementedError(kind)
        m = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def new_matcher(self, template):
        return template.deep_copy()

    def fill(self, matchers, bitmask):
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.llg.torch.fill_next_token_bitmask_par(self.executor, pairs, bitmask)

    def fill_loop(self, matchers, bitmask):
        for i, m in enumerate(matchers):
            self.llg.torch.fill_next_token_bitmask(m, bitmask, i)

    def apply(self, logits, bitmask):
        self.llg.torch.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matchers, tokens):
        return [m.consume_token(t) for m, t in zip(matchers, tokens, strict=True)]

    def accept_batch(self, matchers, tokens):
        return self.llg.torch.consume_token_par(self.executor, list(zip(matchers, tokens, strict=True)))

    def rollback(self, m, n):
        if not m.rollback(n):
            raise RuntimeError(m.get_error())

    def finished(self, m) -> bool:
        return m.is_stopped()


class OutlinesCoreLib:
    """JSON schema -> regex (``json_schema.build_regex_from_schema``) -> token DFA (``Index``): regex only.

    No batched fill or accept; EOS is allowed where ``is_finished()``, but ``advance(EOS)`` raises
    (the Index has no transition on it), so accepting EOS is not advancing."""

    name, compiler_cache = "outlines_core", False

    def __init__(self, threads: int):
        import outlines_core
        import outlines_core.kernels.torch

        self.oc, self.version = outlines_core, md.version("outlines-core")

    def build_tokenizer(self, tok: Tokenizer, vocab: int) -> None:
        fresh = Tokenizer(tok.hf)  # its own token_bytes memo: the timing includes reading the vocabulary
        specials = set(tok.hf.added_tokens_decoder) | set(tok.eos_token_ids)
        words: dict[bytes, list[int]] = {}
        for i in range(vocab):
            if i not in specials:
                words.setdefault(fresh.token_bytes(i), []).append(i)
        self.eos = tok.eos_token_ids[0]
        self.vocabulary = self.oc.Vocabulary(self.eos, words)

    def setup(self) -> None:
        pass

    def clear(self) -> None:
        pass

    def compile(self, kind: str, spec: Any):
        if kind == "json":
            regex = self.oc.json_schema.build_regex_from_schema(json.dumps(spec), whitespace_pattern="")
        elif kind == "regex":
            regex = spec
        elif kind == "choice":
            regex = "(" + "|".join(re.escape(s) for s in spec) + ")"
        else:
            raise NotImplementedError(f"outlines-core compiles regular expressions only, not {kind}")
        return self.oc.Index(regex, self.vocabulary)

    def new_matcher(self, index):
        return self.oc.Guide(index)

    fill = None  # no batched fill

    def fill_loop(self, matchers, bitmask):
        width = bitmask.shape[1]
        for i, g in enumerate(matchers):
            g.write_mask_into(bitmask[i].data_ptr(), width, 4)

    def apply(self, logits, bitmask):
        self.oc.kernels.torch.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matchers, tokens):
        out = []
        for g, t in zip(matchers, tokens, strict=True):
            if t == self.eos:  # the Index has no transition on EOS: the answer just ends
                out.append(g.is_finished())
                continue
            try:
                g.advance(t, return_tokens=False)
                out.append(True)
            except ValueError:
                out.append(False)
        return out

    accept_batch = None

    def rollback(self, m, n):
        m.rollback_state(n)

    def finished(self, m) -> bool:
        return m.is_finished()


LIBS = {cls.name: cls for cls in (XGrammarLib, LLGuidanceLib, OutlinesCoreLib)}


def _complete_json(text: bytes, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text.decode("utf-8")), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def _complete_expr(text: bytes) -> bool:
    try:
        ast.parse(text.decode(), mode="eval")
        return text.strip() != b""
    except (SyntaxError, ValueError):
        return False


def _plausible(tok: Tokenizer) -> set[int]:
    """Tokens of CORPUS, every digit and capital letter: a few hundred (the policy adds a bias to
    tokens that close a string, array or object, so answers end in tens of tokens)."""
    return {i for text in CORPUS + list("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ") for i in tok.encode(text)}


# -------------------------------------------------------------------------------------------- compile


def bench_compile(lib, bits: _Bits, cold_n: int, warm_n: int, budget_s: float) -> tuple[dict, dict, dict]:
    """Per grammar: the first compile in the process, cold and warm spec -> ready matcher, first mask.

    Returns (per grammar, all grammars' samples pooled, each grammar's compiled handle: cached in
    xgrammar's compiler, kept as the template otherwise)."""
    out, handles, pooled = {}, {}, {"first": [], "cold": [], "warm": [], "first_mask": []}
    row = torch.zeros(1, math.ceil(bits.vocab / 32), dtype=torch.int32)
    for gname, (kind, spec) in GRAMMARS.items():
        logger.info("%s: compiling %s", lib.name, gname)
        first, cold, first_mask, spent = 0.0, [], [], 0.0
        for r in range(cold_n + 1):  # r == 0: the first compile of this grammar in the process
            lib.clear()
            t0 = time.perf_counter()
            m = lib.new_matcher(lib.compile(kind, spec))
            t1 = time.perf_counter()
            lib.fill_loop([m], row)
            t2 = time.perf_counter()
            if r == 0:
                first = t1 - t0
            else:
                cold.append(t1 - t0)
            first_mask.append(t2 - t1)
            spent += t2 - t0
            if r >= 3 and spent > budget_s:  # slow builds (outlines-core's Index): fewer repeats
                break
        handle = lib.compile(kind, spec)  # now cached (xgrammar) or kept (the others)
        warm = []
        for _ in range(warm_n):
            t0 = time.perf_counter()
            lib.new_matcher(lib.compile(kind, spec) if lib.compiler_cache else handle)
            warm.append(time.perf_counter() - t0)
        out[gname] = {
            "first_ms": round(1e3 * first, 3),
            "cold": _pct(cold),
            "warm": _pct(warm),
            "first_mask": _pct(first_mask),
        }
        handles[gname] = handle
        for key, xs in (("first", [first]), ("cold", cold), ("warm", warm), ("first_mask", first_mask)):
            pooled[key] += xs
    return out, {k: _pct(v) for k, v in pooled.items()}, handles


# ----------------------------------------------------------------------------------------- trajectories


def make_trajectories(libs: list, handles: dict, tok: Tokenizer, bits: _Bits, seeds: int, max_len: int):
    """Token sequences every library accepts: one per (schema, seed), with agreement statistics."""
    eos, specials = tok.eos_token_ids[0], set(tok.hf.added_tokens_decoder) - set(tok.eos_token_ids)
    plausible = _plausible(tok)
    width = math.ceil(bits.vocab / 32)
    trajs: dict[tuple[str, int], list[int]] = {}
    stats = {
        lib.name: {
            "steps": 0,
            "eos_allowed_incomplete": 0,
            "eos_denied_complete": 0,
            "looser_steps": 0,
            "special_tokens_allowed_steps": 0,
            "allowed_mean": 0.0,
            "finished_after_eos": 0,
            "looser_examples": {},
            "extra_tokens_top": collections.Counter(),
        }
        for lib in libs
    }
    agree = {
        "trajectories": 0,
        "ended_with_eos": 0,
        "valid_answers": 0,
        "diverged": 0,
        "mask_equal_steps": 0,
        "steps": 0,
        "lengths": [],
    }
    for sname, schema in SCHEMAS.items():
        for seed in range(seeds):
            rng = random.Random(f"{sname}/{seed}")
            ms = [lib.new_matcher(handles[lib.name][f"json:{sname}"]) for lib in libs]
            row = torch.zeros(1, width, dtype=torch.int32)
            tokens, text = [], b""
            while len(tokens) < max_len:
                sets = []
                complete = _complete_json(text, schema)
                for lib, m in zip(libs, ms, strict=True):
                    lib.fill_loop([m], row)
                    sets.append(bits.allowed(row[0]))
                common = set.intersection(*sets)
                agree["steps"] += 1
                agree["mask_equal_steps"] += all(s == sets[0] for s in sets)
                for lib, s in zip(libs, sets, strict=True):
                    st = stats[lib.name]
                    st["steps"] += 1
                    st["allowed_mean"] += len(s)
                    extra = s - common - specials
                    st["looser_steps"] += bool(extra)
                    st["extra_tokens_top"].update(tok.token_text(t) for t in extra)
                    if extra and sname not in st["looser_examples"]:  # one per schema
                        st["looser_examples"][sname] = {
                            "after": text.decode(errors="replace")[-40:],
                            "extra": len(extra),
                            "e.g.": [tok.token_text(t) for t in sorted(extra)[:4]],
                        }
                    st["special_tokens_allowed_steps"] += bool(s & specials)
                    st["eos_allowed_incomplete"] += (eos in s) and not complete
                    st["eos_denied_complete"] += (eos not in s) and complete
                if eos in common:
                    choice = eos
                else:
                    pool = sorted((common & plausible) - {eos}) or sorted(common - {eos})
                    if not pool:
                        agree["diverged"] += 1
                        break
                    closers = [t for t in pool if any(c in tok.token_bytes(t) for c in b'"]},')]
                    choice = rng.choice(closers if closers and rng.random() < 0.25 else pool)
                for lib, m in zip(libs, ms, strict=True):
                    if not lib.accept([m], [choice])[0]:
                        raise RuntimeError(
                            f"{lib.name} rejected {choice}, allowed by its mask ({sname}/{seed})"
                        )
                tokens.append(choice)
                if choice == eos:
                    agree["ended_with_eos"] += 1
                    for lib, m in zip(libs, ms, strict=True):
                        stats[lib.name]["finished_after_eos"] += lib.finished(m)
                    break
                text += tok.token_bytes(choice)
            agree["trajectories"] += 1
            agree["valid_answers"] += _complete_json(text, schema)
            agree["lengths"].append(len(tokens))
            trajs[(sname, seed)] = tokens
            if seed == 0:
                logger.info("answer %s/0 (%d tokens): %s", sname, len(tokens), text.decode(errors="replace"))
    for st in stats.values():
        st["allowed_mean"] = round(st["allowed_mean"] / max(1, st["steps"]), 1)
        st["extra_tokens_top"] = st["extra_tokens_top"].most_common(10)  # allowed where another forbids
    lengths = agree.pop("lengths")
    agree["length_mean"] = round(statistics.fmean(lengths), 1)
    agree["length_max"] = max(lengths)
    return trajs, stats, agree


# ---------------------------------------------------------------------------------------------- steps


class _Rows:
    """B rows replaying trajectories; a row whose answer ends gets a new matcher (a new request)."""

    def __init__(self, lib, handles: dict, trajs: dict, batch: int):
        names = list(SCHEMAS)
        self.lib = lib
        self.keys = [(names[r % len(names)], r // len(names)) for r in range(batch)]
        self.seqs = [trajs[k] for k in self.keys]
        self.handles = [handles[f"json:{k[0]}"] for k in self.keys]
        self.matchers = [lib.new_matcher(h) for h in self.handles]
        self.pos = [0] * batch
        self.new_matcher_s: list[float] = []

    def tokens(self) -> list[int]:
        return [s[p] for s, p in zip(self.seqs, self.pos, strict=True)]

    def advance(self) -> None:
        for r, s in enumerate(self.seqs):
            self.pos[r] += 1
            if self.pos[r] == len(s):
                t0 = time.perf_counter()
                self.matchers[r] = self.lib.new_matcher(self.handles[r])
                self.new_matcher_s.append(time.perf_counter() - t0)
                self.pos[r] = 0


def _check_step(lib, bitmask, logits, tokens) -> None:
    for r, t in enumerate(tokens):
        if not _Bits.has(bitmask[r], t):
            raise RuntimeError(f"{lib.name}: row {r} mask forbids token {t} of its own accepted answer")
        if logits is not None and logits[r, t] == float("-inf"):
            raise RuntimeError(f"{lib.name}: apply masked the allowed token {t} in row {r}")


def bench_steps(lib, handles: dict, trajs: dict, vocab: int, batch: int, steps: int, runs: int) -> dict:
    """Per step (fill, then apply, then accept, as a decode step does), in up to three passes:

    A: batched fill (the loop where there is none), apply, loop accept; B: loop fill, apply,
    batched accept; C: batched fill and loop accept with no apply in between (torch's OpenMP
    threads spin after a kernel and compete with a fill thread pool: C shows that share)."""
    width = math.ceil(vocab / 32)
    bitmask = torch.full((batch, width), -1, dtype=torch.int32)
    base = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch))
    logits = base.clone()
    t0 = time.perf_counter()
    lib.apply(logits, bitmask)  # torch.compile kernels compile on their first call (per shape class)
    apply_first = time.perf_counter() - t0
    passes = [("fill", "accept", lib.fill or lib.fill_loop, lib.accept, True)]
    if lib.fill is not None or lib.accept_batch is not None:
        passes.append(("fill_loop", "accept_batch", lib.fill_loop, lib.accept_batch or lib.accept, True))
    if lib.fill is not None:
        passes.append(("fill_without_apply", None, lib.fill, lib.accept, False))
    times: dict[str, list[float]] = {"apply": []}
    new_matcher: list[float] = []
    for fill_key, accept_key, fill, accept, with_apply in passes:
        for _ in range(runs):
            rows = _Rows(lib, handles, trajs, batch)
            for _ in range(steps):
                logits.copy_(base)
                toks = rows.tokens()
                t0 = time.perf_counter()
                fill(rows.matchers, bitmask)
                t1 = time.perf_counter()
                if with_apply:
                    lib.apply(logits, bitmask)
                t2 = time.perf_counter()
                ok = accept(rows.matchers, toks)
                t3 = time.perf_counter()
                if not all(ok):
                    raise RuntimeError(f"{lib.name}: B={batch} rejected {toks} ({ok})")
                _check_step(lib, bitmask, logits if with_apply else None, toks)
                times.setdefault(fill_key, []).append(t1 - t0)
                if with_apply:
                    times["apply"].append(t2 - t1)
                if accept_key:
                    times.setdefault(accept_key, []).append(t3 - t2)
                rows.advance()
            new_matcher += rows.new_matcher_s
    if lib.fill is None:
        times["fill_loop"] = times["fill"]  # the same calls: there is no batched fill
    out = {k: _pct(v) for k, v in times.items()}
    out["new_matcher"] = _pct(new_matcher)
    out["apply_first_call_s"] = round(apply_first, 3)
    return out


def _apply_eager(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The plain-PyTorch apply astrai could own: unpack the bits, masked_fill (no torch.compile)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    keep = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, : logits.shape[1]]
    logits.masked_fill_(keep == 0, float("-inf"))


def bench_apply_kernels(libs: list, vocab: int, batches, repeats: int) -> dict:
    """Every library's apply kernel on the same random bitmask (the layout is shared), and the eager one."""
    kernels = {lib.name: lib.apply for lib in libs} | {"torch_eager": _apply_eager}
    out: dict = {}
    for b in batches:
        gen = torch.Generator().manual_seed(b)
        shape = (b, math.ceil(vocab / 32))
        bitmask = torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=gen)
        base = torch.randn(b, vocab, generator=gen)
        want = base.clone()
        _apply_eager(want, bitmask)
        row = {}
        for name, kernel in kernels.items():
            logits = base.clone()
            kernel(logits, bitmask)  # warm-up (and compile)
            same = torch.equal(torch.isinf(logits), torch.isinf(want))
            ts = []
            for _ in range(repeats):
                logits.copy_(base)
                t0 = time.perf_counter()
                kernel(logits, bitmask)
                ts.append(time.perf_counter() - t0)
            row[name] = {**_pct(ts), "same_result_as_eager": same}
        out[f"B={b}"] = row
    return out


# ------------------------------------------------------------------------------------------ capabilities


def check_rollback(lib, handles: dict, trajs: dict, width: int) -> dict:
    seq = trajs[("flat", 0)]
    k, j = max(1, min(6, len(seq) - 5)), 3
    m = lib.new_matcher(handles["json:flat"])
    a, b = torch.zeros(1, width, dtype=torch.int32), torch.zeros(1, width, dtype=torch.int32)
    try:
        if not all(lib.accept([m] * k, seq[:k])):
            raise RuntimeError("prefix rejected")
        lib.fill_loop([m], a)
        if not all(lib.accept([m] * j, seq[k : k + j])):
            raise RuntimeError("continuation rejected")
        lib.rollback(m, j)
        lib.fill_loop([m], b)
        restored = bool(torch.equal(a, b))
        reaccept = all(lib.accept([m] * (len(seq) - k), seq[k:]))
        return {
            "supported": True,
            "rolled_back_tokens": j,
            "mask_restored": restored,
            "reaccept_to_eos": reaccept and lib.finished(m),
        }
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        return {"supported": False, "error": f"{type(e).__name__}: {e}"}


def _replay_hashes(lib, handles, trajs, batch: int, until: Callable[[int], bool]):
    """Fill + accept steps on ``batch`` rows until ``until(step)``; step times and a hash of each bitmask."""
    bitmask = torch.full((batch, math.ceil(trajs["vocab"] / 32)), -1, dtype=torch.int32)
    rows = _Rows(lib, handles, trajs, batch)
    times, hashes, step = [], [], 0
    while not until(step):
        toks = rows.tokens()
        t0 = time.perf_counter()
        lib.fill_loop(rows.matchers, bitmask)  # one native call per row, so a compile holding the GIL shows
        lib.accept(rows.matchers, toks)
        times.append(time.perf_counter() - t0)
        hashes.append(hash(bitmask.numpy().tobytes()))
        rows.advance()
        step += 1
    return times, hashes


def check_background_compile(lib, handles: dict, trajs: dict, min_s: float) -> dict:
    """Compile every grammar cold on a thread while the main thread steps 8 rows; then those steps quietly."""
    done = threading.Event()
    compiled, errors = [], []

    def worker():
        t_end = time.perf_counter() + min_s
        try:
            while True:
                for kind, spec in GRAMMARS.values():
                    lib.clear()
                    t0 = time.perf_counter()
                    lib.new_matcher(lib.compile(kind, spec))
                    compiled.append(time.perf_counter() - t0)
                if time.perf_counter() >= t_end:
                    break
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(f"{type(e).__name__}: {e}")
        finally:
            done.set()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    busy_t, busy_h = _replay_hashes(lib, handles, trajs, 8, lambda step: done.is_set() and step >= 64)
    thread.join()
    quiet_t, quiet_h = _replay_hashes(lib, handles, trajs, 8, lambda step: step >= len(busy_h))
    return {
        "compiles_on_thread": len(compiled),
        "errors": errors,
        "masks_identical": busy_h == quiet_h,
        "compile_on_thread": _pct(compiled),
        "main_step_busy": _pct(busy_t),
        "main_step_quiet": _pct(quiet_t),
    }


def check_special_tokens(lib, tok: Tokenizer, bits: _Bits) -> dict:
    """Inside a JSON string, which added tokens but EOS (``<|im_start|>``...) does the mask allow as text?"""
    specials = set(tok.hf.added_tokens_decoder) - set(tok.eos_token_ids)
    prefix = tok.encode('{"name":"Ad')
    row = torch.zeros(1, math.ceil(bits.vocab / 32), dtype=torch.int32)

    def probe(some_lib) -> list[str]:
        m = some_lib.new_matcher(some_lib.compile("json", SCHEMAS["flat"]))
        if not all(some_lib.accept([m] * len(prefix), prefix)):
            raise RuntimeError(f"{some_lib.name} rejected {prefix}")
        some_lib.fill_loop([m], row)
        return [tok.token_text(t) for t in sorted(bits.allowed(row[0]) & specials)]

    out: dict = {"allowed_in_string": probe(lib)}
    if isinstance(lib, XGrammarLib):
        fixed = XGrammarLib(lib.threads)
        t0 = time.perf_counter()
        fixed.info = lib.info_without_specials(tok, bits.vocab)
        out["info_without_specials_s"] = round(time.perf_counter() - t0, 3)
        fixed.setup()
        out["allowed_in_string_with_info_without_specials"] = probe(fixed)
    return out


def check_formats(lib, tok: Tokenizer, bits: _Bits) -> dict:
    """Which structured_outputs kinds compile; an example fed token by token, EOS checked by an oracle."""
    eos = tok.eos_token_ids[0]
    cases = {
        "json": (
            "json",
            SCHEMAS["flat"],
            '{"name":"Ada","age":36,"active":true}',
            lambda b: _complete_json(b, SCHEMAS["flat"]),
        ),
        "regex": ("regex", REGEX, "555-1234 x12", lambda b: re.fullmatch(REGEX, b.decode()) is not None),
        "choice": ("choice", CHOICE, "neutral", lambda b: b.decode() in CHOICE),
        "grammar_lark": ("lark", LARK, "(1+2)*34", _complete_expr),
        "grammar_gbnf": ("ebnf", GBNF, "(1+2)*34", _complete_expr),
        "structural_tag": (
            "structural_tag",
            STRUCTURAL_TAG,
            'Let me check. <function=get_weather>{"city":"Paris"}</function>',
            None,
        ),
    }
    row = torch.zeros(1, math.ceil(bits.vocab / 32), dtype=torch.int32)
    out = {}
    for name, (kind, spec, example, oracle) in cases.items():
        try:
            m = lib.new_matcher(lib.compile(kind, spec))
        except Exception as e:  # noqa: BLE001 - the answer is "not supported"
            out[name] = {"supported": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        ids, text, eos_wrong, rejected = tok.encode(example), b"", [], None
        for i, t in enumerate(ids + [eos]):
            lib.fill_loop([m], row)
            if oracle is not None and _Bits.has(row[0], eos) != oracle(text):
                eos_wrong.append(text.decode(errors="replace"))
            if not _Bits.has(row[0], t) or not lib.accept([m], [t])[0]:
                rejected = f"token {i} ({tok.token_bytes(t)!r}) after {text!r}"
                break
            text += tok.token_bytes(t) if t != eos else b""
        out[name] = {
            "supported": True,
            "example_accepted_then_eos": rejected is None and lib.finished(m),
            "rejected": rejected,
            "eos_oracle_checked": oracle is not None,
            "eos_wrong_at_prefixes": eos_wrong,
        }
    return out


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="few repeats and steps (smoke run)")
    ap.add_argument("--only", default=",".join(LIBS), help="comma-separated libraries")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    cold_n, warm_n, budget, steps, runs = (2, 5, 5.0, 16, 1) if args.quick else (20, 100, 30.0, 64, 5)
    batches = (1, 8) if args.quick else (1, 8, 32)
    threads = os.cpu_count() or 1

    path = resolve_model(None)[1]
    tok = Tokenizer.from_gguf(path)
    vocab = tok.vocab_size
    bits = _Bits(vocab)
    result: dict = {
        "config": {
            "model": path.name,
            "vocab": vocab,
            "eos": tok.eos_token_ids,
            "cores": threads,
            "torch_threads": torch.get_num_threads(),
            "batches": batches,
            "steps": steps,
            "runs": runs,
            "cold_repeats": cold_n,
            "warm_repeats": warm_n,
            "grammars": list(GRAMMARS),
            "quick": args.quick,
            "loadavg_at_start": os.getloadavg(),
            "versions": {},
        },
        "import_s": {},
        "tokenizer_info_s": {},
        "compile_all_grammars": {},
        "compile": {},
        "steps_ms": {},
        "apply_kernels_ms": {},
        "agreement": {},
        "capabilities": {},
    }

    libs, handles = [], {}
    for name in args.only.split(","):
        cls = LIBS[name]
        logger.info("%s: import, then tokenizer info", name)
        t0 = time.perf_counter()
        lib = cls(threads)
        t1 = time.perf_counter()
        lib.build_tokenizer(tok, vocab)
        result["import_s"][name] = round(t1 - t0, 3)
        result["tokenizer_info_s"][name] = round(time.perf_counter() - t1, 3)
        lib.setup()
        libs.append(lib)
        result["config"]["versions"][name] = lib.version
    for lib in libs:
        per_grammar, pooled, handles[lib.name] = bench_compile(lib, bits, cold_n, warm_n, budget)
        result["compile"][lib.name], result["compile_all_grammars"][lib.name] = per_grammar, pooled

    logger.info("lockstep pass: answers every library accepts")
    seeds = math.ceil(max(batches) / len(SCHEMAS))
    trajs, per_lib, agree = make_trajectories(libs, handles, tok, bits, seeds, max_len=80)
    result["agreement"] = {"overall": agree, **per_lib}
    trajs["vocab"] = vocab  # for _replay_hashes

    for lib in libs:
        result["steps_ms"][lib.name] = {}
        for b in batches:
            logger.info("%s: steps at B=%d", lib.name, b)
            result["steps_ms"][lib.name][f"B={b}"] = bench_steps(
                lib, handles[lib.name], trajs, vocab, b, steps, runs
            )
        logger.info("%s: capabilities", lib.name)
        result["capabilities"][lib.name] = {
            "rollback": check_rollback(lib, handles[lib.name], trajs, math.ceil(vocab / 32)),
            "background_compile": check_background_compile(
                lib, handles[lib.name], trajs, 1.0 if args.quick else 3.0
            ),
            "formats": check_formats(lib, tok, bits),
            "special_tokens": check_special_tokens(lib, tok, bits),
        }
    logger.info("apply kernels side by side")
    result["apply_kernels_ms"] = bench_apply_kernels(libs, vocab, batches, 20 if args.quick else 200)
    result["config"]["loadavg_at_end"] = os.getloadavg()  # other work on the machine skews every number
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Constrained decoding in the engine: specs, the compile cache, and a grammar backend plugin's masks in a
step."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from astrai.errors import RequestRejected
from astrai.grammar import GrammarBackend, GrammarCache, GrammarMatcher, GrammarSpec
from astrai.request import FinishReason
from astrai.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_specs_are_canonical_and_checked():
    assert GrammarSpec.of("json_schema", {"type": "object"}) == GrammarSpec.of(
        "json_schema", '{"type": "object"}'
    )
    assert GrammarSpec.of("json_schema", {"b": 1, "a": 2}).value == '{"b":1,"a":2}'  # property order is kept
    assert GrammarSpec.of("choice", ["x", "y"]).value == '["x", "y"]'
    for kind, value in (
        ("yaml", "x"),
        ("choice", []),
        ("choice", "x"),
        ("regex", ""),
        ("json_schema", "{nope"),
        ("json_schema", [1]),
    ):
        with pytest.raises(RequestRejected) as err:
            GrammarSpec.of(kind, value)
        assert err.value.param == "grammar"
    with pytest.raises(RequestRejected, match="min_tokens"):
        SamplingParams(grammar=GrammarSpec.of("regex", "a"), min_tokens=2)
    assert not SamplingParams(temperature=0, grammar=GrammarSpec.of("regex", "a")).plain_greedy


class SequenceMatcher(GrammarMatcher):
    """Allows exactly ``tokens`` in order, then the stop tokens."""

    def __init__(self, tokens: list[int], stops: tuple[int, ...]) -> None:
        self.tokens, self.stops, self.at, self.done = tokens, stops, 0, False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        allowed = [self.tokens[self.at]] if self.at < len(self.tokens) else list(self.stops)
        bitmask[row] = False
        bitmask[row, allowed] = True

    def accept(self, token_id: int) -> bool:
        if self.at < len(self.tokens):
            ok = token_id == self.tokens[self.at]
            self.at += ok
            return ok
        self.done = token_id in self.stops
        return self.done

    def is_terminated(self) -> bool:
        return self.done


class SequenceBackend(GrammarBackend):
    """A grammar plugin: a "regex" spec is a literal string, the tiny tokenizer's ids of it."""

    name = "sequence"
    compiles = 0

    def compile(self, spec: GrammarSpec) -> Any:
        if spec.kind != "regex":
            raise RequestRejected(
                f"the sequence backend compiles literal strings, not {spec.kind}", param="grammar"
            )
        type(self).compiles += 1
        time.sleep(0.05)  # slow enough for concurrent callers to overlap
        return self.tokenizer.encode(spec.value)

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return SequenceMatcher(list(compiled), self.stop_token_ids)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return torch.ones(rows, self.vocab_size, dtype=torch.bool)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        idx = torch.tensor(rows)
        logits[idx] = logits[idx].masked_fill(~bitmask[idx], float("-inf"))


@pytest.fixture
def constrained_engine(tiny_engine, monkeypatch):
    def make(**config):
        engine = tiny_engine(**config)
        cache = engine.grammars
        monkeypatch.setattr(cache, "_backend", SequenceBackend(*cache._args))
        return engine

    return make


def _run(engine, prompt, **params):
    r = engine.submit(prompt, SamplingParams(**params))
    r.wait_completion()
    r.raise_for_error()
    return r


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_backend_plugin_forces_the_output(constrained_engine, tiny_tokenizer, temperature):
    engine = constrained_engine()
    prompt = tiny_tokenizer.encode("hello", add_special_tokens=True)
    want = "the answer"
    spec = GrammarSpec.of("regex", want)
    free = _run(engine, prompt, temperature=temperature, seed=1, max_tokens=12, ignore_eos=True)
    got = [
        _run(engine, prompt, temperature=temperature, seed=s, max_tokens=40, grammar=spec, logprobs=1)
        for s in range(3)
    ]
    for r in got:
        assert r.text == want and r.finish_reason is FinishReason.STOP  # ended by the grammar's stop token
        assert r.output_ids[-1] in tiny_tokenizer.eos_token_ids and len(r.logprobs) == len(r.output_ids)
    assert free.text != want
    # mixed batch: constrained and free rows together; the free row is what it is alone
    both = [
        engine.submit(
            prompt, SamplingParams(temperature=temperature, seed=1, max_tokens=12, ignore_eos=True)
        ),
        engine.submit(prompt, SamplingParams(temperature=temperature, seed=2, max_tokens=40, grammar=spec)),
    ]
    for r in both:
        r.wait_completion()
    assert both[0].text == free.text and both[1].text == want


def test_max_tokens_before_the_grammar_completes_is_length(constrained_engine, tiny_tokenizer):
    engine = constrained_engine()
    r = _run(
        engine,
        tiny_tokenizer.encode("hi", add_special_tokens=True),
        temperature=0.0,
        max_tokens=3,
        grammar=GrammarSpec.of("regex", "a longer answer"),
    )
    assert r.finish_reason is FinishReason.LENGTH and len(r.output_ids) == 3


def test_the_cache_compiles_each_spec_once_even_concurrently(constrained_engine):
    engine = constrained_engine()
    cache: GrammarCache = engine.grammars
    SequenceBackend.compiles = 0
    spec = GrammarSpec.of("regex", "abc")
    threads = [threading.Thread(target=cache.compile, args=(spec,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert SequenceBackend.compiles == 1
    with pytest.raises(RequestRejected, match="literal strings"):
        engine.submit([0, 5], SamplingParams(grammar=GrammarSpec.of("choice", ["a"])))


def test_xgrammar_is_the_default_backend_and_reports_the_reason(real_model):
    from astrai.grammar.xgrammar_backend import XGrammarBackend

    model, tokenizer = real_model
    cache = GrammarCache(tokenizer, model.config.vocab_size, tokenizer.eos_token_ids)
    assert isinstance(cache.backend, XGrammarBackend)
    with pytest.raises(
        RequestRejected, match='cannot compile the json_schema: Unsupported type "objectx"'
    ) as err:
        cache.compile(GrammarSpec.of("json_schema", {"type": "objectx"}))
    assert err.value.param == "grammar"
    assert cache.compile(GrammarSpec.of("regex", "[a-z]+")) is cache.compile(
        GrammarSpec.of("regex", "[a-z]+")
    )


def test_constrained_requests_survive_preemption_and_aborts(constrained_engine, tiny_tokenizer):
    """A pool too small for all: preempted constrained requests recompute their KV, keep their matcher
    (it never rewinds: their tokens stay accepted) and still end exactly on their grammar."""
    engine = constrained_engine(n_tokens=40, page_size=4, max_batch_size=4, max_prefill_tokens=16)
    answers = [
        "the tall tree is here and there it is",
        "a short one in the rain on the hill",
        "another tall one that is on the rise",
        "ok then this is it and that is all",
    ]
    prompts = [tiny_tokenizer.encode(f"q{i}", add_special_tokens=True) for i in range(4)]
    for a in answers:  # compiled first, so that the four arrive together
        engine.grammars.compile(GrammarSpec.of("regex", a))
    results = [
        engine.submit(
            p, SamplingParams(temperature=1.0, seed=i, max_tokens=34, grammar=GrammarSpec.of("regex", a))
        )
        for i, (p, a) in enumerate(zip(prompts, answers, strict=True))
    ]
    aborted = engine.submit(
        prompts[0], SamplingParams(max_tokens=34, grammar=GrammarSpec.of("regex", answers[2]))
    )
    engine.abort(aborted.request_id)
    for r, a in zip(results, answers, strict=True):
        r.wait_completion()
        r.raise_for_error()
        assert (r.text, r.finish_reason) == (a, FinishReason.STOP)
    aborted.wait_completion()
    assert aborted.finish_reason in (FinishReason.ABORT, FinishReason.STOP)
    assert engine.get_stats()["preemptions"] > 0


def test_xgrammar_sees_every_token_as_the_tokenizer_spells_it_but_special_ones(real_model):
    """The vocabulary xgrammar masks over is the tokenizer's (an earlier rebuild re-decoded decoded bytes and
    garbled 110 tokens, so a few constrained answers broke their schema); added special tokens are empty."""
    import xgrammar as xgr

    from astrai.grammar.xgrammar_backend import XGrammarBackend

    model, tokenizer = real_model
    stops = tokenizer.eos_token_ids
    backend = XGrammarBackend(tokenizer, model.config.vocab_size, stops)
    reference = xgr.TokenizerInfo.from_huggingface(
        tokenizer.hf, vocab_size=model.config.vocab_size, stop_token_ids=stops
    )
    special = {i for i in tokenizer.hf.added_tokens_decoder if i not in stops}
    got, want = backend.tokenizer_info.decoded_vocab, reference.decoded_vocab
    assert special and all(got[i] == b"" for i in special)
    assert [i for i in range(len(want)) if got[i] != want[i] and i not in special] == []


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [1, 3], [4]])
@pytest.mark.parametrize(("vocab", "width"), [(49152, 49152), (1000, 1000), (1000, 1024)])
def test_the_cpu_bitmask_apply_matches_xgrammars_kernel(rows, vocab, width):
    """The byte-table apply gives exactly xgrammar's result: allowed logits untouched, the rest -inf, rows
    outside ``rows`` untouched, and (a padded logits row) columns past the vocabulary disallowed."""
    import xgrammar as xgr

    from astrai.grammar.xgrammar_backend import apply_bitmask_cpu

    gen = torch.Generator().manual_seed(vocab + len(rows))
    bitmask = xgr.allocate_token_bitmask(5, vocab)
    bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=gen, dtype=torch.int32))
    logits = torch.randn(5, width, generator=gen)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab, indices=rows)
    want[rows, vocab:] = float("-inf")
    got = logits.clone()
    apply_bitmask_cpu(got, bitmask, rows, vocab)
    assert torch.equal(got, want)
    others = [i for i in range(5) if i not in rows]
    assert torch.equal(got[others], logits[others])
    assert torch.isinf(got[rows]).sum() > 0


def test_json_object_mode_allows_any_object_and_nothing_else(real_model):
    """OpenAI's JSON mode is an object: xgrammar's builtin JSON grammar also takes ``[false]`` or ``"x"``."""
    from astrai.grammar.xgrammar_backend import XGrammarBackend

    model, tokenizer = real_model
    backend = XGrammarBackend(tokenizer, model.config.vocab_size, tokenizer.eos_token_ids)
    compiled = backend.compile(GrammarSpec.of("json_object", ""))

    def accepts(text: str) -> bool:
        matcher = backend.matcher(compiled)
        return all(matcher.accept(t) for t in tokenizer.encode(text)) and matcher.accept(
            tokenizer.eos_token_ids[0]
        )

    assert accepts('{"a": 1, "b": [1, {"c": null}]}') and accepts("{}")
    assert not accepts("[false]") and not accepts('"x"') and not accepts("1")

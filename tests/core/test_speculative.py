"""N-gram speculative decoding (issue 19, part 2): greedy output is decoding's, token for token.

The engine tests run the real default model in bfloat16 and float32, each with one engine with
speculation and one without for the module (the KV pool's invariants are checked after every
test, and nothing may be held once a test's requests are done); the KV pressure test has its
own small-pool engine. The proposer and the draft rollback are tested without a model.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from helpers import Stopper

from astrai.batching import BatchPolicy
from astrai.engine import EngineConfig, GenerateResult, InferenceEngine
from astrai.kvcache import KVConfig, PagePool, assert_nothing_held, check_pool_invariants
from astrai.request import FinishReason, Request
from astrai.sampling import SamplingParams
from astrai.speculative import NgramProposer, NgramState
from astrai.step import StepResult

TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow."
)
TYPOS = TEXT.replace("quick", "quikc").replace("box", "bx")
REWRITE = f"Rewrite the following text exactly, fixing the typos: {TYPOS}\nRewritten text:"
CODE = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "# The same two functions, add renamed to plus:\n"
)
PROMPTS = [REWRITE, CODE, "Roses are red,", "1, 2, 3, 4,"]
GREEDY = {"temperature": 0.0}


# ------------------------------------------------------------------ the proposer


def brute_force(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The draft by definition: the longest suffix n-gram's most recent earlier occurrence."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_the_incremental_index_proposes_what_a_search_of_the_whole_history_finds() -> None:
    rng = random.Random(0)
    proposer = NgramProposer(k=3, n_min=2, n_max=4)
    for _ in range(20):
        tokens, state = [rng.randrange(6) for _ in range(5)], NgramState()
        for _ in range(60):  # the table catches up on each call with the tokens added since
            assert proposer.propose(state, tokens, 3) == brute_force(tokens, 3, 2, 4), tokens
            tokens.extend(rng.randrange(6) for _ in range(rng.randrange(1, 3)))


def test_the_longest_match_wins_and_the_limit_bounds_the_draft() -> None:
    proposer = NgramProposer(k=4, n_min=1, n_max=3)
    tokens = [1, 2, 3, 9, 9, 7, 2, 3, 5, 6, 1, 2, 3]  # "2 3" last followed by 5, "1 2 3" by 9
    assert proposer.propose(NgramState(), tokens, 4) == [9, 9, 7, 2]
    assert proposer.propose(NgramState(), tokens, 2) == [9, 9]
    assert NgramProposer(k=4, n_min=4, n_max=4).propose(NgramState(), tokens, 4) == []


def test_a_rejected_draft_cools_the_request_down_and_an_accepted_one_resets_it() -> None:
    proposer, state, tokens = NgramProposer(k=2, n_min=1, n_max=1), NgramState(), [1, 2, 1]
    proposer.observe(state, 2, 0)
    assert state.cooldown == 0 and state.backoff == 1
    proposer.observe(state, 2, 0)
    assert (state.cooldown, state.backoff) == (1, 2)
    assert proposer.propose(state, tokens, 2) == [] and proposer.propose(state, tokens, 2) == [2, 1]
    proposer.observe(state, 2, 2)
    assert state.backoff == 0 and state.rate > 0.5


def test_a_step_is_verified_only_when_the_drafts_pay_for_it() -> None:
    sure, unsure = NgramState(rate=1.0), NgramState(rate=0.05)
    assert NgramProposer.worth(1, [(sure, 4)])
    assert not NgramProposer.worth(1, [(unsure, 4)])
    assert NgramProposer.worth(8, [(sure, 4)] * 8)
    half = NgramState(rate=0.3)  # drafts pay at batch 1, where a step is mostly streaming the weights ...
    assert NgramProposer.worth(1, [(half, 4)])
    assert not NgramProposer.worth(8, [(half, 4)] * 8)  # ... not at batch 8, where each row costs its share
    assert not NgramProposer.worth(8, [(half, 4), (unsure, 8)])


@pytest.mark.parametrize(
    "bad",
    [
        {"num_speculative_tokens": 0},
        {"num_speculative_tokens": 16},
        {"ngram_min": 0},
        {"ngram_min": 5, "ngram_max": 4},
        {"speculative": "eagle"},
    ],
)
def test_engine_config_refuses_bad_speculative_settings(bad: dict) -> None:
    with pytest.raises(ValueError):
        EngineConfig(**{"speculative": "ngram", **bad})


# ------------------------------------------------------------------ rollback, without a model


class Always(NgramProposer):
    """Drafts ``draft`` for every row, every step."""

    def __init__(self, draft: list[int]) -> None:
        super().__init__(k=len(draft), n_min=1, n_max=1)
        self.draft = draft

    def propose(self, state: NgramState, tokens, limit: int) -> list[int]:
        return self.draft[:limit]

    @staticmethod
    def worth(*args, **kwargs) -> bool:
        return True


def test_rejected_drafts_give_their_pages_back_and_never_reach_the_radix(pool_guard) -> None:
    pool = PagePool(1, 1, 1, 2, KVConfig(4, 128, 4, 64))
    pool_guard(pool)
    policy = BatchPolicy(pool, eos_token_ids={1}, proposer=Always([20, 21, 22, 23, 24, 25, 26]))
    req = Request(
        "r",
        list(range(10, 17)),
        SamplingParams(max_tokens=20, temperature=0.0),
        GenerateResult("r", 7),
        Stopper(),
    )
    req.arrival = 0
    policy.add(req)
    plan = policy.schedule()  # the prompt: no drafts on a prefill row
    assert not plan.drafts
    policy.update(plan, StepResult([20]))
    plan = policy.schedule()  # 7 prompt tokens computed; the decode token at 7 and 7 drafts at 8..14
    assert plan.drafts == (7,) and plan.q_lens == (8,) and plan.input_ids == (20, 20, 21, 22, 23, 24, 25, 26)
    assert pool.req_len(req.req_idx) == 15 and len(pool.req_pages(req.req_idx)) == 4
    free = pool.allocator.num_free
    policy.update(plan, StepResult([[20, 21, 99]]))  # drafts 20 and 21 confirmed, then the model's own 99
    check_pool_invariants(pool)
    assert req.output_ids == [20, 20, 21, 99] and req.num_computed == 10 == pool.req_len(req.req_idx)
    assert len(pool.req_pages(req.req_idx)) == 3 and pool.allocator.num_free == free + 1
    assert policy.counters["spec_draft_tokens"] == 7 and policy.counters["spec_accepted_tokens"] == 2
    req.finish(FinishReason.ABORT)
    policy.schedule()  # cleanup records the computed tokens only
    assert (
        len(pool.radix.match([*range(10, 17), 20, 20, 21, 22, 23, 24, 25, 26], 5)) == 2
    )  # 10 computed: 2 pages
    policy.drain()


def test_a_stop_token_inside_the_confirmed_drafts_ends_the_request_there(pool_guard) -> None:
    pool = PagePool(1, 1, 1, 2, KVConfig(4, 128, 4, 64))
    pool_guard(pool)
    policy = BatchPolicy(pool, eos_token_ids={1}, proposer=Always([5, 1, 6]))
    req = Request(
        "r", [10, 11, 12], SamplingParams(max_tokens=20, temperature=0.0), GenerateResult("r", 3), Stopper()
    )
    req.arrival = 0
    policy.add(req)
    policy.update(policy.schedule(), StepResult([5]))
    plan = policy.schedule()
    assert plan.drafts == (3,)
    policy.update(
        plan, StepResult([[5, 1, 6, 7]])
    )  # EOS (1) confirmed as the second token: 6 and 7 never count
    assert req.output_ids == [5, 5, 1] and req.finish_reason is FinishReason.STOP
    assert pool.req_len(req.req_idx) == req.num_computed == 5
    policy.schedule()
    policy.drain()


# ------------------------------------------------------------------ the real model


@pytest.fixture(scope="module")
def bf16_model(default_model_path):
    """The default model in bfloat16, loaded once for the module."""
    from astrai.model import load_model

    return load_model(str(default_model_path), dtype=torch.bfloat16)


def engine_pair(model, tokenizer):
    config = {"max_batch_size": 8, "max_seq_len": 512, "n_tokens": 4096}
    return [
        InferenceEngine(model, tokenizer, EngineConfig(**config, **extra))
        for extra in ({"speculative": "ngram"}, {})
    ]


@pytest.fixture(scope="module")
def engines(bf16_model):
    """``(with speculation, without)`` on the default model in bfloat16."""
    pair = engine_pair(*bf16_model)
    yield pair
    for engine in pair:
        engine.shutdown()


@pytest.fixture(scope="module")
def f32_engines(real_model):
    """The same in float32."""
    pair = engine_pair(*real_model)
    yield pair
    for engine in pair:
        engine.shutdown()


@pytest.fixture(autouse=True)
def pools_clean(request):
    """After each engine test: the pools' invariants hold and no request holds KV."""
    yield
    for name in ("engines", "f32_engines"):
        if name in request.fixturenames:
            for engine in request.getfixturevalue(name):
                check_pool_invariants(engine.pool)
                assert_nothing_held(engine.pool)


def run(engine: InferenceEngine, prompts: list[str], **sampling) -> list[GenerateResult]:
    params = SamplingParams(**{**GREEDY, **sampling})
    results = [engine.submit(engine.tokenizer.encode(p, add_special_tokens=True), params) for p in prompts]
    for r in results:
        r.wait_completion()
        r.raise_for_error()
    return results


def accepted(engine: InferenceEngine) -> int:
    return engine.get_stats()["spec_accepted_tokens"]


@pytest.mark.parametrize("pair", ["engines", "f32_engines"], ids=["bfloat16", "float32"])
def test_greedy_output_is_token_identical_with_speculation(pair, request) -> None:
    """Each prompt alone (a batch's steps depend on when its requests arrive, and in bf16 a prefill
    chunk beside decode rows may flip a near-tie with or without speculation; the next test
    compares mixed steps logit for logit)."""
    spec, plain = request.getfixturevalue(pair)
    before = accepted(spec)
    for prompt in PROMPTS[:3]:
        assert (
            run(spec, [prompt], max_tokens=40)[0].output_ids
            == run(plain, [prompt], max_tokens=40)[0].output_ids
        ), prompt
    stats = spec.get_stats()
    assert stats["spec_accepted_tokens"] - before > 10 and 0 < stats["spec_acceptance_rate"] <= 1
    assert stats["spec_drafts"] and stats["spec_accepted_per_step"] > 0
    assert plain.get_stats()["spec_drafts"] == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_a_verify_row_beside_decode_rows_gives_decoding_logits_bit_for_bit(
    dtype, real_model, bf16_model
) -> None:
    """Four requests: five steps of four decode rows against one step where the first verifies four
    drafts beside three decode rows: every logit equal (the CPU backend's verify rows attend token
    by token on the decode kernel; the linears compute each row on its own)."""
    from astrai.extension.backend.policy import load_backends
    from astrai.runner import ModelRunner
    from astrai.step import StepPlan

    load_backends()
    model, tokenizer = real_model if dtype == torch.float32 else bf16_model
    c = model.config
    pool = PagePool(
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        KVConfig(8, 256, 16, 2048),
        dtype,
    )
    runner = ModelRunner(model, pool)
    prompts = [
        tokenizer.encode(p, add_special_tokens=True)
        for p in (REWRITE, CODE, "1, 2, 3, 4, 5, 6, 7,", "Roses are red, violets are")
    ]
    starts = [len(p) - 5 for p in prompts]

    def prefilled() -> list[int]:
        rows = []
        for p, start in zip(prompts, starts, strict=True):
            rows.append(pool.task_alloc())
            pool.extend(rows[-1], start + 5)
            runner.forward(StepPlan(("p",), (rows[-1],), (0,), (start,), (True,), tuple(p[:start])))
        return rows

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # this thread is not the scheduler's: one thread keeps it quick
    try:
        with torch.inference_mode():
            rows, ids = prefilled(), "abcd"
            decoded = [
                runner.forward(
                    StepPlan(
                        tuple(ids),
                        tuple(rows),
                        tuple(s + i for s in starts),
                        (1,) * 4,
                        (True,) * 4,
                        tuple(p[s + i] for p, s in zip(prompts, starts, strict=True)),
                    )
                )
                for i in range(5)
            ]
            first = tuple(prompts[0][starts[0] : starts[0] + 5])
            rest = tuple(p[s] for p, s in zip(prompts[1:], starts[1:], strict=True))
            verified = runner.forward(
                StepPlan(
                    tuple(ids),
                    tuple(prefilled()),
                    tuple(starts),
                    (5, 1, 1, 1),
                    (True,) * 4,
                    first + rest,
                    drafts=(4, 0, 0, 0),
                )
            )
    finally:
        torch.set_num_threads(before)
        for row in pool.req_to_token_pool.live_rows():
            pool.task_free(row)
    assert torch.equal(verified[:4], decoded[0])  # each row's decode token
    assert torch.equal(
        verified[4:], torch.stack([d[0] for d in decoded[1:]])
    )  # the drafts: later decode steps
    check_pool_invariants(pool)


def test_max_tokens_stop_strings_and_stop_tokens_end_where_decoding_ends(engines) -> None:
    spec, plain = engines
    reference = run(plain, [REWRITE], max_tokens=40)[0]
    before = accepted(spec)
    lengths = [
        run(spec, [REWRITE], max_tokens=n)[0] for n in (9, 14, 19)
    ]  # one of them ends inside a confirmed run
    for n, r in zip((9, 14, 19), lengths, strict=True):
        assert r.output_ids == reference.output_ids[:n] and r.finish_reason == FinishReason.LENGTH
    word = "liquor" if "liquor" in reference.text else reference.text.split()[-2]
    stop_s = [run(engine, [REWRITE], max_tokens=40, stop=[word])[0] for engine in engines]
    assert stop_s[0].text == stop_s[1].text and stop_s[0].finish_reason == FinishReason.STOP_SEQUENCE
    assert stop_s[0].output_ids == stop_s[1].output_ids and word not in stop_s[0].text
    token = reference.output_ids[20]  # a stop token id ends a request as EOS does
    stop_t = [run(engine, [REWRITE], max_tokens=40, stop_token_ids=[token])[0] for engine in engines]
    assert stop_t[0].output_ids == stop_t[1].output_ids and stop_t[0].finish_reason == FinishReason.STOP
    assert stop_t[0].output_ids[-1] == token
    assert accepted(spec) > before


def test_prefix_cache_hits_and_seeded_sampling_are_unchanged(engines) -> None:
    spec, plain = engines
    hits = spec.get_stats()["prefix_hit_tokens"]
    first, again = (run(spec, [REWRITE], max_tokens=24)[0] for _ in range(2))
    assert spec.get_stats()["prefix_hit_tokens"] > hits and again.output_ids == first.output_ids
    sampled = {"temperature": 0.8, "seed": 7, "max_tokens": 24}
    drafts = spec.get_stats()["spec_drafts"]
    texts = [run(engine, [REWRITE], **sampled)[0].output_ids for engine in engines]
    assert texts[0] == texts[1] and spec.get_stats()["spec_drafts"] == drafts  # sampled rows never draft


def test_an_abort_in_the_middle_of_a_speculative_run_frees_everything(engines) -> None:
    spec, _ = engines
    started = threading.Event()
    ids = spec.tokenizer.encode(REWRITE, add_special_tokens=True)
    r = spec.submit(
        ids, SamplingParams(max_tokens=400, ignore_eos=True, **GREEDY), on_piece=lambda _: started.set()
    )
    assert started.wait(60)
    spec.abort(r.request_id)
    assert r.wait_completion(60) and r.finish_reason == FinishReason.ABORT and len(r.output_ids) < 400


def test_preemption_and_chunked_prefill_under_a_small_pool(real_model) -> None:
    """float32 (bf16 text may change with the chunking, speculation or not): three rewrites (two
    alike: a prefix hit) on a pool smaller than their outputs need, prompts prefilled 32 tokens a
    step beside the verify rows: preempted, recomputed, the same text as a roomy pool's."""
    model, tokenizer = real_model
    prompts = [REWRITE, CODE, REWRITE]
    outs = []
    for extra in ({"speculative": "ngram", "n_tokens": 160, "max_prefill_tokens": 32}, {"n_tokens": 4096}):
        engine = InferenceEngine(model, tokenizer, EngineConfig(max_batch_size=4, max_seq_len=512, **extra))
        try:
            outs.append([r.output_ids for r in run(engine, prompts, max_tokens=40, ignore_eos=True)])
            stats = engine.get_stats()
        finally:
            engine.shutdown()
        check_pool_invariants(engine.pool)
        assert_nothing_held(engine.pool)
        if "speculative" in extra:
            assert (
                stats["preemptions"] > 0
                and stats["prefix_hit_tokens"] > 0
                and stats["spec_accepted_tokens"] > 0
            ), stats
    assert outs[0] == outs[1]

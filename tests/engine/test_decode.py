"""engine.decode / records / api on the float64 reference backend: AR and DDTree against the golden AR run."""
from dataclasses import replace

import numpy as np
import pytest

from kdspec.engine.decode import api
from kdspec.engine.decode.config import DecodeConfig
from kdspec.engine.decode.drafters import NoisyOracleDrafter, OracleDrafter
from kdspec.engine.decode.loop import ReferenceTreeOps, generate
from kdspec.engine.decode.records import EXTRA_FIELDS
from kdspec.engine.golden.model import ReferenceModel, decode
from kdspec.engine.model.checkpoint import load_model
from kdspec.traces.schema import DERIVED_FIELDS, STAGES, STEP_FIELDS

PRESETS = ("tiny", "small")
PROMPT = np.array([3, 14, 15, 92, 65, 35], dtype=np.int64)
NEW = 24
# A record's keys: the schema's fields minus those the writer derives (AR records have no draft fields).
RECORD_FIELDS = tuple(f.name for f in STEP_FIELDS if f.name not in DERIVED_FIELDS)


@pytest.fixture(scope="module", params=PRESETS)
def setup(request):
    cfg, weights = load_model(request.param, seed=0)
    model = ReferenceModel(cfg, weights)
    golden = decode(model, PROMPT, NEW + 8)  # 8 more: the oracle covers the last step's overshoot
    sequence = np.concatenate([PROMPT, golden.tokens])
    return model, golden, sequence


class CacheCheckingModel:
    """The reference model, checking after every commit / compact that the cache equals the golden AR cache."""

    def __init__(self, model, golden):
        self.model, self.golden, self.cfg = model, golden, model.cfg
        self.checks, self.worst = 0, 0.0

    def new_cache(self, capacity):
        return self.model.new_cache(capacity)

    def forward(self, cache, tokens, positions, visibility=None):
        return self.model.forward(cache, tokens, positions, visibility)

    def _check(self, cache):
        rows = min(cache.length, self.golden.cache.length)
        for ours, theirs in zip(cache.c + cache.k_pe, self.golden.cache.c + self.golden.cache.k_pe):
            self.worst = max(self.worst, float(np.abs(ours[:rows] - theirs[:rows]).max()))
        self.checks += 1

    def commit(self, cache, s):
        self.model.commit(cache, s)
        self._check(cache)

    def compact(self, cache, accepted):
        self.model.compact(cache, accepted)
        self._check(cache)


def test_ar_equals_golden(setup):
    model, golden, _ = setup
    records = []
    result = generate(model, PROMPT, DecodeConfig(NEW, mode="ar"), golden=golden, on_step=records.append)
    np.testing.assert_array_equal(result.tokens, golden.tokens[:NEW])
    assert result.golden_match and result.steps == NEW - 1 == len(records) and result.taus == [1] * (NEW - 1)
    for i, r in enumerate(records):
        assert set(RECORD_FIELDS) - {"draft_ids", "draft_logprobs"} == set(r)
        assert r["prefix_len"] == len(PROMPT) + i and r["root_token"] == golden.tokens[i]
        assert r["tree_tokens"].tolist() == [golden.tokens[i]] and r["tree_parents"].tolist() == [-1]
        assert r["accepted_nodes"].tolist() == [0] and r["target_topk_ids"].shape == (1, 8)
        assert r["committed_tokens"].tolist() == r["golden_tokens"].tolist() == [golden.tokens[i + 1]]
        assert r["logit_max_abs_diff"][0] == 0.0  # the same float64 computation as the golden
        assert r["cache_len_after"] == r["cache_len_before"] + 1


@pytest.mark.parametrize("drafter_kind", ["oracle", "noisy"])
def test_ddtree_equals_golden_and_cache_equals_golden_after_every_step(setup, drafter_kind):
    model, golden, sequence = setup
    vocab = model.cfg.vocab_size
    drafter = OracleDrafter(sequence, 7, 7, vocab) if drafter_kind == "oracle" else \
        NoisyOracleDrafter(sequence, 0.6, 0, 7, 7, vocab)
    checking = CacheCheckingModel(model, golden)
    records = []
    result = generate(checking, PROMPT, DecodeConfig(NEW, mode="ddtree", block_size=8, budget=7), drafter,
                      golden=golden, on_step=records.append)
    np.testing.assert_array_equal(result.tokens, golden.tokens[:NEW])
    assert result.golden_match
    if drafter_kind == "oracle":
        assert result.taus == [8, 8, 8] and f"{result.mean_tau:.2f}" == "8.00" and result.steps == 3
    else:
        assert 1 < result.mean_tau < 8 and min(result.taus) >= 1
    # prefill + one check per step; rows equal to float64 rounding (tree verify sums in another order)
    assert checking.checks == result.steps + 1 and checking.worst < 1e-10
    produced = [int(golden.tokens[0])]
    for r in records:
        p, tau = r["prefix_len"], len(r["accepted_nodes"])
        assert set(RECORD_FIELDS) == set(r)
        assert p == len(PROMPT) + len(produced) - 1 and r["root_token"] == produced[-1]
        assert r["cache_len_verify"] == p + len(r["tree_tokens"]) and r["cache_len_after"] == p + tau
        np.testing.assert_array_equal(r["compact_src"], p + r["accepted_nodes"])
        np.testing.assert_array_equal(r["compact_dst"], p + np.arange(tau))
        np.testing.assert_array_equal(r["committed_tokens"], r["golden_tokens"])
        assert r["bonus_token"] == r["committed_tokens"][-1] == r["target_choice"][r["accepted_nodes"][-1]]
        assert np.nanmax(r["logit_max_abs_diff"]) < 1e-9 and r["cache_max_abs_diff"] < 1e-10
        assert r["target_topk_ids"].shape == (len(r["tree_tokens"]), 8)
        assert (r["target_margin"] >= 0).all()
        assert all(r[f"time_{s}"] >= 0 for s in STAGES)
        produced += r["committed_tokens"].tolist()
    assert produced[:NEW] == golden.tokens[:NEW].tolist() and len(produced) >= NEW


def test_node_choice_equals_argmax_of_its_path_run_as_a_plain_sequence(setup):
    model, golden, sequence = setup
    drafter = NoisyOracleDrafter(sequence, 0.5, 1, 7, 15, model.cfg.vocab_size)
    records = []
    generate(model, PROMPT, DecodeConfig(16, mode="ddtree", budget=15), drafter=drafter, on_step=records.append)
    branched = [r for r in records if (r["tree_depths"] < np.arange(len(r["tree_depths"]))).any()]
    assert branched, "the noisy drafter should give some non-chain trees"
    for r in (records[0], branched[0], records[-1]):
        p = r["prefix_len"]
        for node in range(len(r["tree_tokens"])):
            path = []
            i = node
            while i >= 0:
                path.append(int(r["tree_tokens"][i]))
                i = int(r["tree_parents"][i])
            tokens = np.concatenate([sequence[:p], path[::-1]])
            cache = model.new_cache(len(tokens))
            logits = model.forward(cache, tokens, np.arange(len(tokens)))  # causal, no tree
            assert int(np.argmax(logits[-1])) == r["target_choice"][node]
            assert abs(r["target_topk_logits"][node, 0] - logits[-1].max()) < 1e-5


@pytest.mark.parametrize("drafter_kind", ["noisy-sampled", "oracle-greedy"])
def test_ddtree_at_temperature_equals_ar_at_temperature(setup, drafter_kind):
    model, golden, _ = setup
    seed, temperature = 7, 1.0
    sampled = decode(model, PROMPT, NEW + 8, temperature=temperature, seed=seed)
    assert (sampled.tokens[:NEW] != golden.tokens[:NEW]).sum() >= 4, "T=1 should not be the greedy output"
    ar = generate(model, PROMPT, DecodeConfig(NEW, mode="ar", temperature=temperature, seed=seed))
    np.testing.assert_array_equal(ar.tokens, sampled.tokens[:NEW])
    vocab = model.cfg.vocab_size
    # a drafter that follows the sampled run (noisily) and one that follows the greedy run (mostly rejected)
    drafter = NoisyOracleDrafter(np.concatenate([PROMPT, sampled.tokens]), 0.7, 2, 7, 7, vocab) \
        if drafter_kind == "noisy-sampled" else OracleDrafter(np.concatenate([PROMPT, golden.tokens]), 7, 7, vocab)
    tree = generate(model, PROMPT, DecodeConfig(NEW, mode="ddtree", temperature=temperature, seed=seed), drafter)
    np.testing.assert_array_equal(tree.tokens, ar.tokens)
    assert tree.steps < NEW - 1 if drafter_kind == "noisy-sampled" else tree.steps >= 1
    other_seed = generate(model, PROMPT, DecodeConfig(NEW, mode="ar", temperature=temperature, seed=seed + 1))
    assert not np.array_equal(other_seed.tokens, ar.tokens)


def test_truncation_and_single_token(setup):
    model, golden, sequence = setup
    drafter = OracleDrafter(sequence, 7, 7, model.cfg.vocab_size)
    result = generate(model, PROMPT, DecodeConfig(10, mode="ddtree"), drafter=drafter)
    assert result.taus == [8, 8] and len(result.tokens) == 10
    np.testing.assert_array_equal(result.tokens, golden.tokens[:10])
    one = generate(model, PROMPT, DecodeConfig(1, mode="ddtree"), drafter=drafter)
    assert one.steps == 0 and one.mean_tau == 0.0 and one.tokens.tolist() == [golden.tokens[0]]


def test_ddtree_up_to_max_position_embeddings():
    # the last trees are cut to the positions and cache rows that exist; output still equals the golden
    cfg, weights = load_model("tiny", seed=1)
    model = ReferenceModel(cfg, weights)
    prompt = np.arange(cfg.max_position_embeddings - 20) % cfg.vocab_size
    golden = decode(model, prompt, 20)
    drafter = OracleDrafter(np.concatenate([prompt, golden.tokens]), 7, 7, cfg.vocab_size)
    result = generate(model, prompt, DecodeConfig(20, mode="ddtree"), drafter=drafter, golden=golden)
    np.testing.assert_array_equal(result.tokens, golden.tokens)
    assert result.taus == [8, 8, 4]


class CountingTreeOps(ReferenceTreeOps):
    def __init__(self):
        self.calls = {"choose_tokens": 0, "build_tree": 0, "accept": 0}

    def choose_tokens(self, *args):
        self.calls["choose_tokens"] += 1
        return super().choose_tokens(*args)

    def build_tree(self, *args):
        self.calls["build_tree"] += 1
        return super().build_tree(*args)

    def accept(self, *args):
        self.calls["accept"] += 1
        return super().accept(*args)


def test_tree_ops_seam_is_used(setup):
    model, golden, sequence = setup
    ops = CountingTreeOps()
    drafter = OracleDrafter(sequence, 7, 7, model.cfg.vocab_size)
    result = generate(model, PROMPT, DecodeConfig(NEW, mode="ddtree"), drafter, tree_ops=ops)
    assert ops.calls == {"choose_tokens": 1 + result.steps, "build_tree": result.steps, "accept": result.steps}


class NoWorkModel:
    """Fails the test if generate() touches the model before rejecting its arguments."""

    def __init__(self, cfg):
        self.cfg = cfg

    def new_cache(self, capacity):
        raise AssertionError("model work before validation")

    forward = commit = compact = new_cache


@pytest.mark.parametrize("kwargs,message", [
    (dict(budget=0), "budget must be an integer >= 1"),
    (dict(block_size=0), "block_size must be an integer >= 2"),  # a DDTree block drafts at least one depth
    (dict(topk=0), "topk must be an integer >= 1"),
    (dict(topk=10 ** 6), "topk must be at most the vocabulary size"),
    (dict(prompt_ids=[]), "prompt must be a non-empty"),
    (dict(prompt_ids=[1, 2, 10 ** 6]), "prompt token id 1000000 is outside the vocabulary"),
    (dict(prompt_ids=[1, -3]), "prompt token id -3 is outside the vocabulary"),
    (dict(prompt_ids=[1.5, 2.0]), "prompt token ids must be integers"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(max_new_tokens=10 ** 6), "exceeds max_position_embeddings"),
    (dict(mode="beam"), "mode must be one of ar, ddtree"),
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(seed=-2), "seed must be an integer >= 0"),
    (dict(mode="ddtree", drafter=None), "mode 'ddtree' needs a drafter"),
    (dict(mode="ddtree", block_size=4), "drafter drafts L=7 depths x K=7, but block_size 4"),
    (dict(budget=2000), "budget must be at most 1024"),
    (dict(block_size=64), "block_size must be at most 32"),
])
def test_bad_parameters_rejected_before_model_work(setup, kwargs, message):
    model, _, sequence = setup
    args = dict(prompt_ids=PROMPT, max_new_tokens=8, mode="ddtree",
                drafter=OracleDrafter(sequence, 7, 7, model.cfg.vocab_size)) | kwargs
    prompt, drafter = args.pop("prompt_ids"), args.pop("drafter")
    with pytest.raises(ValueError, match=message):
        generate(NoWorkModel(model.cfg), prompt, DecodeConfig(**args), drafter)


def test_model_cache_capacity_is_checked():
    cfg, weights = load_model("tiny", seed=0)
    model = NoWorkModel(cfg)
    model.max_cache_rows = 12
    with pytest.raises(ValueError, match="exceeds the model's cache capacity of 12 rows"):
        generate(model, PROMPT, DecodeConfig(8))


def test_api_reference_engine():
    engine = api.load("tiny", backend="reference", seed=0)
    assert engine.cfg.name == "tiny" and engine.backend == "reference"
    golden = engine.golden(PROMPT, NEW)
    assert np.array_equal(golden.tokens, decode(ReferenceModel(*load_model("tiny", 0)), PROMPT, NEW).tokens)
    records = []
    result = engine.generate(PROMPT, DecodeConfig(NEW, mode="ddtree", drafter="oracle"), on_step=records.append)
    np.testing.assert_array_equal(result.tokens, golden.tokens)
    assert result.taus == [8, 8, 8] and result.golden_match and result.meta["drafter"] == "oracle"
    assert records[0]["golden_tokens"].tolist() == records[0]["committed_tokens"].tolist()
    noisy = engine.generate(PROMPT, DecodeConfig(NEW, mode="ddtree", drafter="noisy:0.6", temperature=1.0, seed=4))
    ar = engine.generate(PROMPT, DecodeConfig(NEW, temperature=1.0, seed=4), golden=True)
    np.testing.assert_array_equal(noisy.tokens, ar.tokens)
    assert ar.golden_match and 1 < noisy.mean_tau < 8
    text = engine.generate("hi", DecodeConfig(4))
    assert len(text.tokens) == 4 and text.golden_match is None


from numba.cuda import config as _cuda_config  # noqa: E402

_UNAVAILABLE = ((dict(backend="cuda"), api.BackendUnavailable, "backend 'cuda' needs a CUDA GPU")
                if _cuda_config.ENABLE_CUDASIM else
                (dict(backend="sim"), api.BackendUnavailable, "backend 'sim' needs NUMBA_ENABLE_CUDASIM=1"))


@pytest.mark.parametrize("kwargs,error,message", [
    _UNAVAILABLE,
    (dict(backend="tpu"), ValueError, "backend must be one of"),
    (dict(seed=-1), ValueError, "seed must be an integer >= 0"),
    (dict(model="no-such-model"), ValueError, "unknown model"),
])
def test_api_load_rejects(kwargs, error, message):
    with pytest.raises(error, match=message):
        api.load(**({"model": "tiny"} | kwargs))


def test_api_rejects_drafter_name_in_ar_mode_and_bad_arguments_before_golden():
    engine = api.load("tiny")
    with pytest.raises(ValueError, match="only used in mode 'ddtree'"):
        engine.generate(PROMPT, DecodeConfig(8, mode="ar", drafter="oracle"))
    with pytest.raises(ValueError, match="budget must be an integer >= 1"):
        engine.generate(PROMPT, DecodeConfig(8, mode="ddtree", drafter="oracle", budget=0))
    with pytest.raises(ValueError, match="unknown drafter"):
        engine.generate(PROMPT, DecodeConfig(8, mode="ddtree", drafter="magic"))


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_records_fit_the_trace_writer(tmp_path, mode):
    # the contract with traces/: every record is accepted by the writer and reads back as written
    from kdspec.traces.reader import open_trace
    from kdspec.traces.writer import RunMetadata, TraceWriter
    engine = api.load("tiny")
    config = DecodeConfig(NEW, mode=mode, drafter="noisy:0.6" if mode == "ddtree" else None)
    path = tmp_path / f"{mode}.h5"
    records = []
    run = RunMetadata(config.resolved(engine.cfg.vocab_size).as_dict(), engine.cfg.to_hf_dict(), "reference", "cpu",
                      PROMPT)
    with TraceWriter(path, run) as writer:
        def on_step(record):
            records.append(record)
            writer.write_step(record)
        result = engine.generate(PROMPT, config, golden=True, on_step=on_step)
        writer.finish(result.tokens, result.meta["golden"].tokens[:NEW])
    with open_trace(path) as trace:
        assert trace.num_steps == result.steps == len(records)
        summary = trace.summary()
        assert summary.golden_match and abs(summary.mean_tau - result.mean_tau) < 1e-12
        last = trace.step(trace.num_steps - 1)
        np.testing.assert_array_equal(last.accepted_nodes, records[-1]["accepted_nodes"])
        np.testing.assert_array_equal(last.committed_tokens, records[-1]["committed_tokens"])


class _EventModel:
    """The reference model, logging each forward into ``events``."""

    def __init__(self, model, events):
        self.model, self.events, self.cfg = model, events, model.cfg

    def new_cache(self, capacity):
        return self.model.new_cache(capacity)

    def forward(self, cache, tokens, positions, visibility=None):
        self.events.append(("forward", int(cache.length)))
        return self.model.forward(cache, tokens, positions, visibility)

    def commit(self, cache, s):
        self.model.commit(cache, s)

    def compact(self, cache, accepted):
        self.model.compact(cache, accepted)


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_records_are_emitted_while_the_next_step_computes(setup, mode):
    """Without a golden run, step n's record reaches on_step after step n+1's forward was queued (overlap),
    the last one after the loop; every record arrives once, in order, equal to records emitted at once."""
    model, golden, sequence = setup
    events = []
    config = DecodeConfig(12, mode=mode, block_size=4, budget=4)

    def drafter():
        return NoisyOracleDrafter(sequence, 0.5, 1, 3, 4, model.cfg.vocab_size) if mode == "ddtree" else None

    late = []
    result = generate(_EventModel(model, events), PROMPT, config, drafter(),
                      on_step=lambda r: (events.append(("record", r["prefix_len"])), late.append(r)))
    forwards = [length for kind, length in events if kind == "forward"]
    records = [length for kind, length in events if kind == "record"]
    assert records == forwards[1:]  # one record per step (the prefill has none), in order
    for i, (kind, length) in enumerate(events[:-1]):
        if kind == "record":  # the forward just before it is the next step's
            previous_forward = max(j for j in range(i) if events[j][0] == "forward")
            assert events[previous_forward][1] > length
    assert events[-1][0] == "record"
    at_once = []
    generate(model, PROMPT, replace(config, record_logits=True), drafter(), on_step=at_once.append)  # at once
    assert len(at_once) == len(late) == result.steps
    keys = set(RECORD_FIELDS) - ({"draft_ids", "draft_logprobs"} if mode == "ar" else set())
    # no golden run here: the logits ride along, the golden's do not
    assert all(set(r) == keys for r in late) and all(set(r) == keys | {"logits"} for r in at_once)
    assert "golden_logits" in EXTRA_FIELDS
    for mine, theirs in zip(late, at_once):
        for key in mine:
            if not key.startswith("time_"):
                np.testing.assert_array_equal(mine[key], theirs[key], err_msg=key)


def test_committed_tokens_are_the_prompt_and_every_token_but_the_bonus():
    from kdspec.engine.decode.loop import _Run
    run = _Run(None, None, None, np.array([5, 6, 7]), None, None)
    tokens = [1]
    for step in range(60):  # steps committing 0..8 tokens, the buffer growing past its first size
        got = run.committed_tokens(tokens)
        assert np.array_equal(got, np.concatenate([run.prompt, np.asarray(tokens[:-1], dtype=np.int64)])), step
        assert not got.flags.writeable
        tokens.extend(range(100 + step, 100 + step + step % 9))

"""Trace format: write synthetic runs, read them back field by field, summaries vs independent numbers,
check(), and every kind of bad file. Records come from a generator that builds consistent random trees."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from kdspec.traces import (STEP_FIELDS, RunMetadata, TraceError, TraceWriter, check, info_json, info_text,
                           open_trace)
from kdspec.traces.schema import SCHEMA_VERSION, STAGES

DOCS = Path(__file__).resolve().parents[2] / "docs" / "trace-format.md"
MODEL_CONFIG = {"name": "tiny", "vocab_size": 64, "hidden_size": 32}


def make_run(seed, num_steps, block_size, budget, draft_topk, vocab=64, prompt_len=5, diverge_at=None,
             logits=False, golden_logits=()):
    """Consistent random DDTree (or AR when block_size == 1) records.

    Returns (records, output_tokens, golden_tokens); as the engine's, the output is the prefill's token
    (step 0's root) followed by every step's committed tokens. Trees: every node's parent is an earlier node of
    depth < L, its token the drafter's token at (depth, rank); the accepted path is a random root-down
    chain; committed = path tokens after the root + bonus. With diverge_at, the golden's first token at
    that step differs from the committed one. golden_logits: the steps whose records carry float64
    ``golden_logits`` [tau, V] (with logits=True).
    """
    rng = np.random.default_rng(seed)
    L, K, B = block_size - 1, draft_topk, budget
    prefix, root = prompt_len, int(rng.integers(vocab))
    records, output, golden_out = [], [root], [root]
    for step in range(num_steps):
        draft_ids = np.array([rng.permutation(vocab)[:K] for _ in range(L)], dtype=np.int32).reshape(L, K)
        draft_lp = -np.sort(rng.exponential(size=(L, K)), axis=1).astype(np.float32)
        tokens, parents, depths, ranks, scores = [root], [-1], [0], [0], [np.float32(0)]
        num_extra = int(rng.integers(0, B + 1)) if L and K else 0
        for _ in range(num_extra):
            candidates = [i for i in range(len(tokens)) if depths[i] < L]
            parent = int(rng.choice(candidates))
            depth, rank = depths[parent] + 1, int(rng.integers(K))
            tokens.append(int(draft_ids[depth - 1, rank]))
            parents.append(parent)
            depths.append(depth)
            ranks.append(rank)
            scores.append(np.float32(scores[parent] + draft_lp[depth - 1, rank]))
        n1 = len(tokens)
        children = {i: [j for j in range(n1) if parents[j] == i] for i in range(n1)}
        accepted = [0]
        while children[accepted[-1]] and rng.random() < 0.75:
            accepted.append(int(rng.choice(children[accepted[-1]])))
        child_tokens = {tokens[j] for j in children[accepted[-1]]}
        bonus = int(rng.choice([t for t in range(vocab) if t not in child_tokens]))
        choice = rng.integers(vocab, size=n1).astype(np.int32)
        for a, b in zip(accepted[:-1], accepted[1:]):
            choice[a] = tokens[b]
        choice[accepted[-1]] = bonus
        tau = len(accepted)
        committed = np.array([tokens[a] for a in accepted[1:]] + [bonus], dtype=np.int32)
        golden = committed.copy()
        if step == diverge_at:
            golden[0] = (golden[0] + 1) % vocab
        topk_logits = -np.sort(-rng.standard_normal((n1, 8)), axis=1).astype(np.float32)
        record = {
            "prefix_len": prefix, "root_token": root,
            "tree_tokens": np.array(tokens, np.int32), "tree_parents": np.array(parents, np.int32),
            "tree_depths": np.array(depths, np.int32), "tree_ranks": np.array(ranks, np.int32),
            "tree_scores": np.array(scores, np.float32), "target_choice": choice,
            "target_topk_ids": rng.integers(vocab, size=(n1, 8)).astype(np.int32),
            "target_topk_logits": topk_logits, "target_margin": topk_logits[:, 0] - topk_logits[:, 1],
            "accepted_nodes": np.array(accepted, np.int32), "bonus_token": bonus,
            "committed_tokens": committed, "golden_tokens": golden,
            "logit_max_abs_diff": rng.uniform(0, 1e-5, tau).astype(np.float32),
            "cache_len_before": prefix, "cache_len_verify": prefix + n1, "cache_len_after": prefix + tau,
            "compact_src": (prefix + np.array(accepted)).astype(np.int32),
            "compact_dst": (prefix + np.arange(tau)).astype(np.int32),
            "cache_max_abs_diff": np.float32(rng.uniform(0, 1e-6)),
            **{f"time_{s}": float(rng.uniform(1e-4, 1e-3)) for s in STAGES},
        }
        if L and K:
            record["draft_ids"], record["draft_logprobs"] = draft_ids, draft_lp
        if logits:
            record["logits"] = rng.standard_normal((tau, vocab)).astype(np.float32)
            if step in golden_logits:
                record["golden_logits"] = record["logits"] + rng.uniform(-1e-5, 1e-5, (tau, vocab))
        records.append(record)
        output.extend(committed.tolist())
        golden_out.extend(golden.tolist())
        prefix, root = prefix + tau, bonus
    return records, output, golden_out


def decode_config(block_size, budget, draft_topk, seed=7):
    """The decode_config dict a writer needs (as the engine's DecodeConfig.as_dict() gives it)."""
    return {"mode": "ar" if block_size == 1 else "ddtree", "block_size": block_size, "budget": budget,
            "topk": draft_topk, "seed": seed, "temperature": 0.0}


def write_run(path, records, output, golden, *, block_size, budget, draft_topk, finish=True, vocabulary=None,
              **kw):
    run = RunMetadata(decode_config(block_size, budget, draft_topk), MODEL_CONFIG, backend="reference",
                      device="cpu", prompt_tokens=[1, 2, 3, 4, 5], tokenizer="byte" if vocabulary is None else "bpe",
                      vocabulary=vocabulary)
    writer = TraceWriter(path, run, **kw)
    for record in records:
        writer.write_step(record)
    if finish:
        writer.finish(output, golden)
    else:
        writer.close()


def assert_one_line_error(excinfo, path):
    message = str(excinfo.value)
    assert "\n" not in message and str(path) in message, message


@pytest.mark.parametrize("block_size,budget,draft_topk", [(8, 7, 7), (4, 9, 3), (8, 3, 2), (2, 1, 1)])
def test_every_field_reads_back_as_written(tmp_path, block_size, budget, draft_topk):
    records, output, golden = make_run(1, 12, block_size, budget, draft_topk, logits=True, golden_logits=range(12))
    path = tmp_path / "run.h5"
    write_run(path, records, output, golden, block_size=block_size, budget=budget, draft_topk=draft_topk,
              save_logits=True)
    with open_trace(path) as r:
        assert r.num_steps == len(records) and r.is_complete
        meta = r.metadata
        assert meta["schema_version"] == SCHEMA_VERSION and meta["mode"] == "ddtree"
        assert meta["model_config"] == MODEL_CONFIG and meta["decode_config"]["budget"] == budget
        assert meta["backend"] == "reference" and meta["device"] == "cpu" and meta["seed"] == 7
        assert meta["start_time"] and meta["end_time"] and "h5py" in meta["versions"]
        np.testing.assert_array_equal(r.prompt_tokens, [1, 2, 3, 4, 5])
        np.testing.assert_array_equal(r.output_tokens, output)
        np.testing.assert_array_equal(r.golden_tokens, golden)
        for i, record in enumerate(records):
            step = r.step(i)
            assert step.index == i
            assert step.num_nodes == len(record["tree_tokens"]) and step.tau == len(record["accepted_nodes"])
            for name, value in record.items():
                got = getattr(step, name)
                if np.ndim(value) == 0:
                    assert got == pytest.approx(float(value), rel=0, abs=0), name
                else:
                    assert got.shape == np.shape(value), name
                    assert got.dtype == np.asarray(value).dtype or name == "logits", name
                    np.testing.assert_array_equal(got, value, err_msg=name)
            assert step.time_trace_write > 0 and math.isfinite(step.time_trace_write)
        assert r.step(-1).index == len(records) - 1
        with pytest.raises(IndexError):
            r.step(len(records))
        np.testing.assert_array_equal(r.column("tau"), [len(x["accepted_nodes"]) for x in records])
        np.testing.assert_array_equal(r.column("prefix_len"), [x["prefix_len"] for x in records])
        np.testing.assert_array_equal(r.column("time_verify"), [x["time_verify"] for x in records])
        with pytest.raises(KeyError):
            r.column("tree_tokens")


def test_ar_trace_is_one_node_per_step(tmp_path):
    records, output, golden = make_run(2, 9, block_size=1, budget=0, draft_topk=0)
    for record in records:  # an AR engine may leave out what it does not measure
        del record["time_draft"], record["time_build"]
    path = tmp_path / "ar.h5"
    write_run(path, records, output, golden, block_size=1, budget=0, draft_topk=0)
    with open_trace(path) as r:
        assert r.metadata["mode"] == "ar" and r.num_steps == 9
        for i, record in enumerate(records):
            step = r.step(i)
            assert step.tau == 1 and step.num_nodes == 1 and step.draft_ids.shape == (0, 0)
            assert step.committed_tokens.tolist() == [record["bonus_token"]]
            assert math.isnan(step.time_draft) and math.isnan(step.time_build)
            assert step.logits is None
        s = r.summary()
        assert s.mean_tau == 1.0 and s.tau_histogram == {1: 9} and s.per_depth_acceptance == {}
        assert s.golden_match and check(r)[0] == 0


def test_summary_matches_independent_computation(tmp_path):
    L = 5
    records, output, golden = make_run(3, 40, L + 1, 8, 3)
    path = tmp_path / "run.h5"
    write_run(path, records, output, golden, block_size=L + 1, budget=8, draft_topk=3)
    taus = [len(x["accepted_nodes"]) for x in records]
    worst, where = -1.0, None
    for i, x in enumerate(records):
        for j, v in enumerate(x["logit_max_abs_diff"]):
            if v > worst:
                worst, where = float(v), (i, j)
    with open_trace(path) as r:
        s = r.summary()
    assert s.num_steps == 40 and s.mean_tau == pytest.approx(sum(taus) / 40, abs=1e-12)
    assert s.tau_histogram == {t: taus.count(t) for t in range(1, L + 2)}
    assert sum(s.tau_histogram.values()) == 40
    for d in range(1, L + 1):
        assert s.per_depth_acceptance[d] == pytest.approx(sum(t - 1 >= d for t in taus) / 40, abs=1e-12)
    assert s.golden_match and s.first_divergence_step is None
    assert s.max_logit_diff == worst and s.max_logit_diff_at == where
    assert s.max_cache_diff == pytest.approx(max(float(x["cache_max_abs_diff"]) for x in records), abs=0)
    assert s.output_tokens.tolist() == output and s.golden_tokens.tolist() == golden
    for stage in STAGES:
        assert s.stage_time_totals[stage] == pytest.approx(sum(x[f"time_{stage}"] for x in records), rel=1e-12)
    assert s.stage_time_totals["trace_write"] > 0


def test_check_and_reports(tmp_path):
    records, output, golden = make_run(4, 10, 8, 7, 7)
    good = tmp_path / "good.h5"
    write_run(good, records, output, golden, block_size=8, budget=7, draft_topk=7)
    with open_trace(good) as r:
        code, message = check(r)
        assert code == 0 and "\n" not in message, message
        text = info_text(r)
        assert "tiny" in text and "reference" in text and "ddtree" in text and "tokens equal" in text
        info = info_json(r)
        json.dumps(info, allow_nan=False)
        assert info["num_steps"] == 10 and info["output_tokens"] == output and info["golden_tokens"] == golden
        assert info["golden_match"] is True and info["model"] == "tiny" and info["backend"] == "reference"
        assert info["schema_version"] == SCHEMA_VERSION
        assert info["mean_accept"] == pytest.approx(np.mean([len(x["accepted_nodes"]) for x in records]))
        assert info["max_logit_diff"] == pytest.approx(max(x["logit_max_abs_diff"].max() for x in records))

    records, output, golden = make_run(4, 10, 8, 7, 7, diverge_at=6)
    bad = tmp_path / "diverges.h5"
    write_run(bad, records, output, golden, block_size=8, budget=7, draft_topk=7)
    with open_trace(bad) as r:
        code, message = check(r)
        assert code == 1 and "step 6" in message, message
        assert r.summary().first_divergence_step == 6 and not r.summary().golden_match
        assert "DIVERGES at step 6" in info_text(r)

    # The last step may commit past max_new_tokens: an output cut inside the last step's tokens is fine.
    records, output, golden = make_run(4, 10, 8, 7, 7)
    while len(records[-1]["accepted_nodes"]) < 2:
        records, output, golden = make_run(int(records[0]["root_token"]) + 100, 10, 8, 7, 7)
    cut = tmp_path / "cut.h5"
    write_run(cut, records, output[:-1], golden[:-1], block_size=8, budget=7, draft_topk=7)
    with open_trace(cut) as r:
        assert check(r)[0] == 0, check(r)
    last_tau = len(records[-1]["accepted_nodes"])
    for name, wrong in [("short", output[:-last_tau]), ("changed", output[:3] + [output[3] + 1] + output[4:]),
                        ("long", output + [1])]:
        wrong_output = tmp_path / f"wrong_output_{name}.h5"
        write_run(wrong_output, records, wrong, golden, block_size=8, budget=7, draft_topk=7)
        with open_trace(wrong_output) as r:
            code, message = check(r)
            assert code == 1 and "differs from the steps' tokens" in message, (name, message)

    broken_path = tmp_path / "broken_path.h5"
    records[3]["committed_tokens"] = records[3]["committed_tokens"][::-1].copy() + 1
    write_run(broken_path, records, output, golden, block_size=8, budget=7, draft_topk=7)
    with open_trace(broken_path) as r:
        assert check(r) == (1, "step 3: committed tokens are not the accepted path's tokens followed by the bonus token")

    unfinished = tmp_path / "unfinished.h5"
    records, output, golden = make_run(4, 3, 8, 7, 7)
    write_run(unfinished, records, output, golden, block_size=8, budget=7, draft_topk=7, finish=False)
    with open_trace(unfinished) as r:
        assert not r.is_complete and r.metadata["status"] == "recording" and r.num_steps == 3
        assert check(r)[0] == 1
        assert math.isnan(r.column("time_trace_write")[-1]) and np.isfinite(r.column("time_trace_write")[:-1]).all()
        assert r.summary().output_tokens.tolist() == output


def test_no_overwrite_without_force(tmp_path):
    records, output, golden = make_run(5, 2, 8, 7, 7)
    path = tmp_path / "run.h5"
    write_run(path, records, output, golden, block_size=8, budget=7, draft_topk=7)
    before = path.read_bytes()
    with pytest.raises(TraceError) as excinfo:
        write_run(path, records[:1], output, golden, block_size=8, budget=7, draft_topk=7)
    assert_one_line_error(excinfo, path)
    assert "exists" in str(excinfo.value) and path.read_bytes() == before
    write_run(path, records[:1], output, golden, block_size=8, budget=7, draft_topk=7, force=True)
    with open_trace(path) as r:
        assert r.num_steps == 1


def test_bad_records_are_rejected(tmp_path):
    records, output, golden = make_run(6, 1, 4, 3, 2)
    writer = TraceWriter(tmp_path / "x.h5", RunMetadata(decode_config(4, 3, 2), {}, "b", "d", [1]))
    good = records[0]
    for change, needle in [({"tree_tokens": None}, "lacks"), ({"extra": 1}, "unknown"),
                           ({"draft_ids": np.zeros((3, 3), np.int32)}, "draft_ids"),
                           ({"accepted_nodes": np.zeros(5, np.int32)}, "accepted_nodes"),
                           ({"tree_tokens": np.zeros(5, np.int32)}, "tree_tokens"),
                           ({"tau": 99}, "tau")]:
        record = {**good, **change}
        if change.get("tree_tokens", 0) is None:
            del record["tree_tokens"]
        with pytest.raises(TraceError) as excinfo:
            writer.write_step(record)
        assert needle in str(excinfo.value) and "\n" not in str(excinfo.value)
    writer.write_step(good)
    writer.close()
    with open_trace(tmp_path / "x.h5") as r:
        assert r.num_steps == 1
    for bad, needle in (({**decode_config(8, 7, 0), "mode": "ar"}, "an AR trace has block_size 1 and budget 0"),
                        ({"mode": "ddtree", "block_size": 8}, "decode_config lacks ['budget', 'topk', 'seed']"),
                        ({**decode_config(8, 7, 7), "mode": "beam"}, "mode must be one of"),
                        (decode_config(8, -1, 7), "budget must be an integer >= 0")):
        with pytest.raises(TraceError) as excinfo:
            TraceWriter(tmp_path / "y.h5", RunMetadata(bad, {}, "b", "d", [1]))
        assert needle in str(excinfo.value) and "\n" not in str(excinfo.value)
        assert not (tmp_path / "y.h5").exists()


def _valid_trace(tmp_path, name="valid.h5", steps=30):
    records, output, golden = make_run(7, steps, 8, 7, 7)
    path = tmp_path / name
    write_run(path, records, output, golden, block_size=8, budget=7, draft_topk=7)
    return path


def _read_everything(path):
    with open_trace(path) as r:
        for i in range(r.num_steps):
            r.step(i)
        r.summary()
        check(r)


def test_bad_files_raise_one_line_trace_errors(tmp_path):
    cases = {}
    cases["missing"] = tmp_path / "nope.h5"
    cases["empty"] = tmp_path / "empty.h5"
    cases["empty"].write_bytes(b"")
    cases["garbage"] = tmp_path / "garbage.h5"
    cases["garbage"].write_bytes(np.random.default_rng(0).bytes(5000))
    valid = _valid_trace(tmp_path)
    data = valid.read_bytes()
    cases["truncated"] = tmp_path / "truncated.h5"
    cases["truncated"].write_bytes(data[:len(data) // 2])
    cases["foreign"] = tmp_path / "foreign.h5"
    with h5py.File(cases["foreign"], "w") as f:
        f["x"] = np.arange(3)
    cases["newer"] = _valid_trace(tmp_path, "newer.h5", steps=2)
    with h5py.File(cases["newer"], "r+") as f:
        f.attrs["schema_version"] = SCHEMA_VERSION + 1
    cases["no_steps"] = _valid_trace(tmp_path, "no_steps.h5", steps=2)
    with h5py.File(cases["no_steps"], "r+") as f:
        del f["steps"]
    for kind, path in cases.items():
        with pytest.raises(TraceError) as excinfo:
            _read_everything(path)
        assert_one_line_error(excinfo, path)
    assert "newer" in str(pytest.raises(TraceError, open_trace, cases["newer"]).value)
    assert "not a kdtree trace" in str(pytest.raises(TraceError, open_trace, cases["foreign"]).value)
    assert "'steps'" in str(pytest.raises(TraceError, open_trace, cases["no_steps"]).value)


def test_damaged_chunk_names_the_dataset(tmp_path):
    path = _valid_trace(tmp_path, steps=40)
    with h5py.File(path, "r") as f:
        offset = f["steps"].id.get_chunk_info(20).byte_offset
    with open(path, "r+b") as fh:   # scribble over one compressed step chunk
        fh.seek(offset)
        fh.write(b"\xff" * 64)
    with open_trace(path) as r:
        r.step(0)
        with pytest.raises(TraceError) as excinfo:
            r.step(20)
        assert_one_line_error(excinfo, path)
        assert "'steps'" in str(excinfo.value)


def test_same_records_give_same_contents(tmp_path):
    records, output, golden = make_run(8, 15, 8, 7, 7, logits=True)
    paths = [tmp_path / "a.h5", tmp_path / "b.h5"]
    for path in paths:
        write_run(path, records, output, golden, block_size=8, budget=7, draft_topk=7, save_logits=True)
    volatile = {"start_time", "end_time", "time_trace_write_last", "time_golden"}   # times, and NaN != NaN
    with open_trace(paths[0]) as a, open_trace(paths[1]) as b:
        meta_a = {k: v for k, v in a.metadata.items() if k not in volatile and k != "prompt_tokens"}
        meta_b = {k: v for k, v in b.metadata.items() if k not in volatile and k != "prompt_tokens"}
        assert meta_a == meta_b
        for name in a._steps.dtype.names:
            if name != "time_trace_write_prev":
                np.testing.assert_array_equal(a.field(name), b.field(name), err_msg=name)
        for i in range(a.num_steps):
            np.testing.assert_array_equal(a.step(i).logits, b.step(i).logits)
        np.testing.assert_array_equal(a.output_tokens, b.output_tokens)


def test_golden_logits_read_back_and_steps_without_them_take_no_space(tmp_path):
    """Records carrying golden_logits [tau, V] read back exactly (float64); a step without them reads as NaN
    [tau, V] and allocates no chunk of the dataset."""
    with_golden = {0, 3, 4, 9}
    records, output, golden = make_run(11, 10, 4, 6, 3, logits=True, golden_logits=with_golden)
    path = tmp_path / "golden.h5"
    write_run(path, records, output, golden, block_size=4, budget=6, draft_topk=3, save_logits=True)
    with open_trace(path) as r:
        for i, record in enumerate(records):
            step = r.step(i)
            tau = len(record["accepted_nodes"])
            assert step.golden_logits.shape == (tau, MODEL_CONFIG["vocab_size"])
            assert step.golden_logits.dtype == np.float64
            if i in with_golden:
                np.testing.assert_array_equal(step.golden_logits, record["golden_logits"])
            else:
                assert np.isnan(step.golden_logits).all()
            np.testing.assert_array_equal(step.logits, record["logits"])
    with h5py.File(path, "r") as f:
        assert f["golden_logits"].shape == (10, 4, MODEL_CONFIG["vocab_size"])
        assert f["golden_logits"].id.get_num_chunks() == len(with_golden)
        assert f["logits"].id.get_num_chunks() == 10


@pytest.mark.parametrize("compression", ["gzip", "lzf", None])
def test_golden_logits_with_every_compression(tmp_path, compression):
    records, output, golden = make_run(12, 3, 4, 6, 3, logits=True, golden_logits={1})
    path = tmp_path / "c.h5"
    write_run(path, records, output, golden, block_size=4, budget=6, draft_topk=3, save_logits=True,
              compression=compression)
    with open_trace(path) as r:
        np.testing.assert_array_equal(r.step(1).golden_logits, records[1]["golden_logits"])
        assert np.isnan(r.step(0).golden_logits).all() and np.isnan(r.step(2).golden_logits).all()


def test_traces_without_golden_logits_still_read(tmp_path):
    """A trace recorded before golden_logits existed (logits only) and one without save_logits read; golden_logits
    is None there. Without save_logits a record's golden_logits are not stored (as its logits)."""
    records, output, golden = make_run(13, 4, 4, 6, 3, logits=True, golden_logits={0, 1, 2, 3})
    older = tmp_path / "older.h5"
    write_run(older, records, output, golden, block_size=4, budget=6, draft_topk=3, save_logits=True)
    with h5py.File(older, "r+") as f:
        del f["golden_logits"]
    plain = tmp_path / "plain.h5"
    write_run(plain, records, output, golden, block_size=4, budget=6, draft_topk=3)
    with open_trace(older) as r:
        assert r.num_steps == 4 and check(r)[0] == 0
        for i, record in enumerate(records):
            step = r.step(i)
            assert step.golden_logits is None
            np.testing.assert_array_equal(step.logits, record["logits"])
    with open_trace(plain) as r:
        assert r.step(0).logits is None and r.step(0).golden_logits is None
    with h5py.File(plain, "r") as f:
        assert "golden_logits" not in f and "logits" not in f


def test_bad_golden_logits_are_rejected(tmp_path):
    records, _, _ = make_run(14, 1, 4, 6, 3, logits=True)
    good = records[0]
    tau = len(good["accepted_nodes"])
    run = RunMetadata(decode_config(4, 6, 3), MODEL_CONFIG, "b", "d", [1])
    with TraceWriter(tmp_path / "g.h5", run, save_logits=True) as writer:
        for bad, needle in ((np.zeros((tau + 1, 64)), "golden_logits must have shape"),
                            (np.zeros((tau, 63)), "golden_logits must have shape"),
                            (np.full((tau, 64), "x"), "golden_logits must hold numbers")):
            with pytest.raises(TraceError) as excinfo:
                writer.write_step({**good, "golden_logits": bad})
            assert needle in str(excinfo.value) and "\n" not in str(excinfo.value)
        writer.write_step({**good, "golden_logits": None})  # None: not recorded
    with open_trace(tmp_path / "g.h5") as r:
        assert r.num_steps == 1 and np.isnan(r.step(0).golden_logits).all()


def doc_table(heading: str) -> list[list[str]]:
    """The rows of the table under ``heading`` in docs/trace-format.md, cells stripped (backticks too)."""
    text = DOCS.read_text()
    section = text[text.index(heading) + len(heading):]
    section = section[:section.find("\n## ")] if "\n## " in section else section
    return [[cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| `")]


def test_docs_table_of_the_steps_row_is_the_schema():
    """Both ways: every schema field has its row (in row order) with its shape, dtype and unit, and every
    row is a schema field."""
    shapes = {"scalar": "scalar", "node": "[B+1]", "path": "[L+1]", "draft": "[L, K]", "topk": "[B+1, T]"}
    documented = [tuple(row[:4]) for row in doc_table("## The `steps` row")]
    schema = [(f.name, shapes[f.kind], str(np.dtype(f.dtype)), f.unit) for f in STEP_FIELDS]
    assert documented == schema


def test_docs_tables_of_attributes_and_datasets_are_the_files(tmp_path):
    """Both ways: every root attribute and dataset of a trace (one with logits too) has its row, and every
    row names one."""
    with h5py.File(_valid_trace(tmp_path, steps=1), "r") as f:
        attrs, datasets = set(f.attrs), set(f)
    records, output, golden = make_run(2, 1, 4, 3, 2, logits=True)
    write_run(tmp_path / "logits.h5", records, output, golden, block_size=4, budget=3, draft_topk=2,
              save_logits=True, vocabulary=[b"x"] * MODEL_CONFIG["vocab_size"])
    with h5py.File(tmp_path / "logits.h5", "r") as f:
        datasets |= set(f)
    assert {row[0] for row in doc_table("## Root attributes")} == attrs
    assert {row[0] for row in doc_table("## Datasets")} == datasets


def test_vocabulary_reads_back_byte_for_byte(tmp_path):
    # BPE tokens are arbitrary byte strings: empty, one half of a UTF-8 character, or several characters
    vocabulary = [bytes([i % 256]) * (i % 4) for i in range(MODEL_CONFIG["vocab_size"])]
    vocabulary[1] = "é".encode()[:1]
    records, output, golden = make_run(3, 2, 4, 3, 2)
    write_run(tmp_path / "bpe.h5", records, output, golden, block_size=4, budget=3, draft_topk=2,
              vocabulary=vocabulary)
    write_run(tmp_path / "byte.h5", records, output, golden, block_size=4, budget=3, draft_topk=2)
    with open_trace(tmp_path / "bpe.h5") as r:
        assert r.vocabulary() == vocabulary and r.metadata["tokenizer"] == "bpe"
    with open_trace(tmp_path / "byte.h5") as r:
        assert r.vocabulary() is None and r.metadata["tokenizer"] == "byte"


def test_traces_imports_neither_engine_nor_app():
    code = ("import sys, kdspec.traces, kdspec.traces.report; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('numba', 'textual') or m.split('.')[:2] in (['kdspec', 'engine'], ['kdspec', 'kdtree_tui'])]; "
            "print(bad); sys.exit(bool(bad))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stdout + result.stderr

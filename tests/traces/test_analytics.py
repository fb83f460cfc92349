"""traces.analytics / traces.budget against answers computed independently here: trees rebuilt at every budget by
the engine's reference build (engine.golden.ddtree) and walked with the test's own target, the pop order by
sorting every prefix of a small L x K space, histograms and calibration by plain loops; and the counterfactual
tau against real reference-backend recordings at smaller budgets."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from kdspec.engine.decode.records import StepOutcome, TargetReadout, step_record
from kdspec.engine.golden import ddtree
from kdspec.traces import RunMetadata, TraceWriter, open_trace
from kdspec.traces.analytics import BINS, analyze, folded_rank_histogram, near_tie_verdict, why_tau
from kdspec.traces.analytics_report import analytics_json, analytics_text, why_json, why_text
from kdspec.traces.budget import bench_cost_model, budget_taus, budget_to_include, chain_taus, fit_cost_model, pop_order

VOCAB = 50
TIMES = {"draft": 1e-3, "build": 2e-4, "verify": 3e-3, "accept": 1e-4, "compact": 1e-4}


class World:
    """A golden sequence and a target that follows it while the path so far is golden, else a hash of the path."""

    def __init__(self, seed: int, length: int = 400):
        self.golden = np.random.default_rng(seed).integers(VOCAB, size=length)

    def target(self, prefix: int, path: list) -> int:
        """The target's token after the root at position ``prefix`` and the drafted tokens ``path``."""
        if all(int(t) == int(self.golden[prefix + 1 + i]) for i, t in enumerate(path)):
            return int(self.golden[prefix + len(path) + 1])
        return (sum((i + 3) * int(t) for i, t in enumerate(path)) * 7 + prefix) % VOCAB


def draft(rng, world: World, prefix: int, depths: int, topk: int, ties: bool):
    """ids [L, K] distinct per row, the golden token at a random rank or absent; log-probs sorted descending,
    from a few values (many ties) or continuous."""
    ids = np.zeros((depths, topk), np.int32)
    for d in range(depths):
        golden = int(world.golden[prefix + d + 1])
        others = [t for t in rng.permutation(VOCAB).tolist() if t != golden][:topk]
        rank = int(rng.integers(topk + 1))  # topk: absent
        if rank < topk:
            others[rank] = golden
        ids[d] = others
    mags = rng.choice([0.25, 0.5, 1.0, 2.0], size=(depths, topk)) if ties else rng.exponential(size=(depths, topk))
    return ids, (-np.sort(mags, axis=1)).astype(np.float32)


def path_tokens(tree, node: int) -> list:
    out = []
    while node > 0:
        out.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return out[::-1]


def walk(world: World, prefix: int, tree) -> int:
    """tau of a tree under the world's target (the reference accept on choices made here)."""
    choice = np.array([world.target(prefix, path_tokens(tree, i)) for i in range(tree.num_nodes)])
    return len(ddtree.accept(tree.parents, tree.tokens, choice)[0])


def make_steps(seed: int, steps: int, depths: int, topk: int, budget: int, ties: bool, drafter=draft):
    """[(record, info)]: records as the engine builds them (reference build + accept + record builder)."""
    rng, world = np.random.default_rng(seed), World(seed)
    prefix, root = 3, int(world.golden[3])
    out = []
    for _ in range(steps):
        ids, lp = drafter(rng, world, prefix, depths, topk, ties)
        tree = ddtree.build_tree(lp, ids, root, budget, prefix)
        choice = np.array([world.target(prefix, path_tokens(tree, i)) for i in range(tree.num_nodes)], np.int32)
        accepted, bonus = ddtree.accept(tree.parents, tree.tokens, choice)
        tau, n = len(accepted), tree.num_nodes
        topk_ids = np.stack([(choice + k) % VOCAB for k in range(8)], axis=1).astype(np.int32)
        topk_logits = np.tile(np.linspace(5, 1, 8, dtype=np.float32), (n, 1))
        outcome = StepOutcome(prefix, root, tree, None, choice, accepted, bonus,
                              ddtree.compaction_moves(prefix, accepted), prefix + n, prefix + tau,
                              dict(TIMES), draft=(ids, lp))
        record = step_record(outcome, TargetReadout(topk_ids, topk_logits, topk_logits[:, 0] - topk_logits[:, 1]))
        record["golden_tokens"] = record["committed_tokens"].copy()
        out.append((record, dict(world=world, prefix=prefix, root=root, ids=ids, lp=lp, tree=tree)))
        prefix, root = prefix + tau, bonus
    return out


def write(path, steps, depths, topk, budget):
    meta = RunMetadata({"mode": "ddtree", "block_size": depths + 1, "budget": budget, "topk": topk, "seed": 0},
                       {"name": "test"}, backend="synthetic", device="none", prompt_tokens=[1, 2, 3, 4])
    with TraceWriter(path, meta) as writer:
        for record, _ in steps:
            writer.write_step(record)
    return path


SHAPES = [(3, 3, 6, True), (4, 2, 5, False), (2, 4, 9, True)]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: "L{}K{}B{}{}".format(*s[:3], "ties" * s[3]))
def run(request, tmp_path_factory):
    depths, topk, budget, ties = request.param
    steps = make_steps(11 + depths, 60, depths, topk, budget, ties)
    path = write(tmp_path_factory.mktemp("an") / "run.h5", steps, depths, topk, budget)
    with open_trace(path) as reader:
        yield dict(steps=steps, depths=depths, topk=topk, budget=budget, reader=reader, analytics=analyze(reader))


def brute_order(lp: np.ndarray) -> list:
    """Every prefix of the L x K space, sorted by (-float32 score, rank tuple): the best-first order by definition."""
    depths, topk = lp.shape
    keyed = []
    for length in range(1, depths + 1):
        for ranks in itertools.product(range(topk), repeat=length):
            score = np.float32(0.0)
            for d, r in enumerate(ranks):
                score = np.float32(score + lp[d, r])
            keyed.append((-float(score), ranks))
    return [()] + [r for _, r in sorted(keyed)]


@pytest.mark.parametrize("ties", [True, False])
def test_pop_order_is_the_sorted_prefix_space_and_the_reference_build(ties):
    rng = np.random.default_rng(5)
    world = World(5)
    for trial in range(20):
        ids, lp = draft(rng, world, 10 + trial, 3, 3, ties)
        expected = brute_order(lp)
        assert pop_order(lp, 10_000).ranks == expected
        for node in (1, 5, 17, len(expected) - 1):
            assert budget_to_include(lp, expected[node]) == node
        tree = ddtree.build_tree(lp, ids, 0, 12, 0)
        order = pop_order(lp, 12)
        assert order.parents == tree.parents.tolist()
        np.testing.assert_array_equal(np.asarray(order.scores, np.float32), tree.scores)
    assert budget_to_include(lp, (0, 0, 0, 0)) is None  # deeper than L


def test_budget_curve_equals_trees_rebuilt_at_every_budget(run):
    a = run["analytics"]
    budgets = range(run["budget"] + 1)
    taus = np.array([[walk(i["world"], i["prefix"], ddtree.build_tree(i["lp"], i["ids"], i["root"], b, i["prefix"]))
                      for b in budgets] for _, i in run["steps"]])
    np.testing.assert_allclose(a.curve.mean_tau, taus.mean(axis=0), rtol=0, atol=1e-12)
    assert a.curve.budgets == list(budgets) and a.curve.steps_not_best_first == 0
    assert a.curve.steps_checked == len(run["steps"])
    r = run["reader"]
    np.testing.assert_array_equal(budget_taus(r.column("tau"), r.field("accepted_nodes"), list(budgets)), taus)


def test_chain_equals_the_walked_chain_where_known(run):
    a, depths = run["analytics"], run["depths"]
    truth = []
    for _, i in run["steps"]:
        chain = [int(i["ids"][d, 0]) for d in range(depths)]
        tau = 1
        while tau <= depths and i["world"].target(i["prefix"], chain[:tau - 1]) == chain[tau - 1]:
            tau += 1
        truth.append(tau)

    r = run["reader"]
    got, known = chain_taus(r.column("tau"), r.field("tree_parents"), r.field("tree_ranks"),
                            r.field("target_choice"), r.field("draft_ids"), r.column("num_nodes"))
    truth = np.array(truth)
    np.testing.assert_array_equal(got[known], truth[known])
    assert (got[~known] <= truth[~known]).all()
    # known exactly when every chain node the walk needed a target choice at is in the tree
    for s, (_, i) in enumerate(run["steps"]):
        in_tree = {tuple(ranks) for ranks in _rank_tuples(i["tree"])}
        needed = [(0,) * k for k in range(1, min(truth[s], depths))]
        assert known[s] == all(t in in_tree for t in needed), s
    assert a.curve.chain_known_steps == int(known.sum())
    if known.any():
        assert a.curve.chain_mean_tau == pytest.approx(truth[known].mean())


def test_a_chain_node_missing_from_the_tree_gives_a_lower_bound_and_the_budget_that_holds_it(tmp_path):
    """Depth 1 is unsure (siblings pop first), depths 2-3 sure and golden at rank 0: budget 3 holds (0,), (1,),
    (2,) only; the walk accepts (0,) and stops at depth 2, whose node (0, 0) pops fourth."""
    def drafter(rng, world, prefix, depths, topk, ties):
        ids = np.array([[int(world.golden[prefix + d]), *[(int(world.golden[prefix + d]) + k) % VOCAB
                                                          for k in (1, 2)]] for d in (1, 2, 3)], np.int32)
        return ids, np.array([[-0.1, -0.2, -0.3], [-3, -4, -5], [-3, -4, -5]], np.float32)

    steps = make_steps(3, 4, 3, 3, 3, False, drafter)
    path = write(tmp_path / "chain.h5", steps, 3, 3, 3)
    with open_trace(path) as reader:
        a = analyze(reader)
        assert reader.column("tau").tolist() == [2, 2, 2, 2]
        assert a.curve.chain_known_steps == 0 and a.curve.chain_mean_tau is None
        assert a.curve.chain_lower_bound == 3.0  # the chain is accepted through (0,) and (0, 0) at least
        why = why_tau(reader.step(0), 3)
        assert (why.depth, why.rank, why.budget_needed, why.in_tree) == (2, 0, 4, False)
        assert why.logprob == pytest.approx(-3.0)
        assert "lacks a chain node" in analytics_text(a) or "unknown" in analytics_text(a)


def _rank_tuples(tree) -> list:
    out = [()]
    for node in range(1, tree.num_nodes):
        out.append(out[int(tree.parents[node])] + (int(tree.ranks[node]),))
    return out


def test_rank_histogram_calibration_and_ece_by_plain_loops(run):
    a, depths, topk = run["analytics"], run["depths"], run["topk"]
    hist = np.zeros((depths, topk + 1), int)
    cells = {}
    bins = [[0, 0.0, 0] for _ in range(BINS)]
    top1 = [[0, 0.0, 0] for _ in range(BINS)]
    for record, i in run["steps"]:
        tau = len(record["accepted_nodes"])
        for d in range(1, min(tau, depths) + 1):
            token = int(record["committed_tokens"][d - 1])
            row = i["ids"][d - 1].tolist()
            hist[d - 1, row.index(token) if token in row else topk] += 1
            for r in range(topk):
                p, hit = math.exp(float(i["lp"][d - 1, r])), row[r] == token
                n, s, h = cells.get((d, r), (0, 0.0, 0))
                cells[d, r] = (n + 1, s + p, h + hit)
                b = min(int(p * BINS), BINS - 1)
                bins[b] = [bins[b][0] + 1, bins[b][1] + p, bins[b][2] + hit]
                if r == 0:
                    top1[b] = [top1[b][0] + 1, top1[b][1] + p, top1[b][2] + hit]
    np.testing.assert_array_equal(a.rank_histogram, hist)
    for (d, r), (n, s, h) in cells.items():
        assert a.calibration.count[d - 1, r] == n
        assert a.calibration.stated[d - 1, r] == pytest.approx(s / n)
        assert a.calibration.measured[d - 1, r] == pytest.approx(h / n)
    total = sum(b[0] for b in bins)
    ece = sum(n / total * abs(h / n - s / n) for n, s, h in bins if n)
    assert a.calibration.ece == pytest.approx(ece)
    total1 = sum(b[0] for b in top1)
    assert total1 > 0 and a.calibration.top1_bin_count.tolist() == [b[0] for b in top1]
    assert a.calibration.ece_top1 == pytest.approx(sum(n / total1 * abs(h / n - s / n) for n, s, h in top1 if n))
    assert a.calibration.bin_count.tolist() == [b[0] for b in bins]
    taus = np.array([len(rec["accepted_nodes"]) for rec, _ in run["steps"]])
    np.testing.assert_allclose(a.reached, [(taus >= d + 1).mean() for d in range(1, depths + 1)])
    assert a.stops["block full"] == int((taus > depths).sum())
    assert sum(a.stops.values()) == len(taus)
    assert a.stops["not drafted"] == sum(1 for rec, i in run["steps"] if len(rec["accepted_nodes"]) <= depths and
                                         int(rec["bonus_token"]) not in i["ids"][len(rec["accepted_nodes"]) - 1])


def test_why_tau_matches_rebuilt_trees(run):
    depths, budget = run["depths"], run["budget"]
    reader = run["reader"]
    seen = set()
    for s, (record, i) in enumerate(run["steps"]):
        why = why_tau(reader.step(s), budget)
        tau = len(record["accepted_nodes"])
        assert why.tau == tau and why.best_first and not why.in_tree
        if tau > depths:
            assert why.depth is None
            seen.add("full")
            continue
        assert why.depth == tau and why.token == i["world"].target(i["prefix"], path_tokens(i["tree"], int(
            record["accepted_nodes"][-1])))
        row = i["ids"][tau - 1].tolist()
        if why.token not in row:
            assert why.rank is None and why.budget_needed is None
            seen.add("absent")
            continue
        assert why.rank == row.index(why.token) and why.logprob == float(i["lp"][tau - 1, why.rank])
        # the smallest budget whose reference tree passes depth tau along the same path
        bigger = next(b for b in range(budget + 1, 400) if walk(i["world"], i["prefix"], ddtree.build_tree(
            i["lp"], i["ids"], i["root"], b, i["prefix"])) > tau)
        assert why.budget_needed == bigger
        assert "budget" in why_text(why) and str(bigger) in why_text(why) and why_json(why)["budget_needed"] == bigger
        seen.add("budget")
    assert seen == {"full", "absent", "budget"} or len(seen) >= 2


def test_tokens_per_second_from_the_trace_times_and_from_a_bench_file(run):
    a = run["analytics"]
    overhead = TIMES["draft"] + TIMES["build"] + TIMES["accept"] + TIMES["compact"]
    expected = [t / (overhead + TIMES["verify"]) for t in a.curve.mean_tau]  # one tree size: flat verify
    np.testing.assert_allclose(a.curve.tokens_per_second, expected)
    assert a.curve.best_budget == int(np.argmax(expected))
    assert a.curve.cost.source == "trace (flat)"
    rows = [{"suite": "e2e", "metric": "DDTree noisy:0.7 B=2 tokens/s", "value": 10.0, "unit": "tok/s",
             "note": "tau 2.00; 9 ms/step (draft 1, build 0.2, verify 5, accept 0.1, compact 0.1 ms); 3/3 tokens = AR"},
            {"suite": "e2e", "metric": "DDTree verify step B=6 vs roofline", "value": 9.0, "unit": "ms"},
            {"suite": "e2e", "metric": "AR step vs roofline", "value": 4.0, "unit": "ms"}]
    b = analyze(run["reader"], bench_rows=rows)
    verify = np.interp([b + 1 for b in a.curve.budgets], [1, 3, 7], [4e-3, 5e-3, 9e-3])  # every tree is full
    np.testing.assert_allclose(b.curve.tokens_per_second, np.array(a.curve.mean_tau) / (overhead + verify))
    assert b.curve.cost.source == "bench"


def test_cost_model_fit_and_bench_rows():
    nodes = np.array([5, 5, 9, 9, 17, 17])
    model = fit_cost_model(nodes, 1e-3 + 2e-4 * nodes, 5e-4)
    np.testing.assert_allclose(model.verify_seconds([1, 33]), [1.2e-3, 1e-3 + 2e-4 * 17])  # clamped past 17
    np.testing.assert_allclose(model.step_seconds(9), 5e-4 + 1e-3 + 2e-4 * 9)
    assert fit_cost_model(nodes, np.full(6, np.nan), 0.0) is None
    assert bench_cost_model([{"metric": "build b=1 L=7 B=16", "value": 1.0, "unit": "ms"}], 0.0) is None


def test_json_and_text_reports(run):
    import json
    a = run["analytics"]
    data = analytics_json(a)
    json.dumps(data, allow_nan=False)
    assert data["budget_curve"]["best_budget"] == a.curve.best_budget
    assert data["rank_histogram"]["ranks"][-1] == "absent"
    text = analytics_text(a)
    assert "ECE" in text and "<- best" in text and "chain" in text


def test_folded_rank_histogram_keeps_every_count():
    rng = np.random.default_rng(3)
    histogram = rng.integers(0, 50, size=(7, 65))          # K = 64 ranks + absent
    labels, folded = folded_rank_histogram(histogram, 4)
    assert labels == ["r0", "r1", "r2", "r3", "r4+", "absent"]
    np.testing.assert_array_equal(folded[:, :4], histogram[:, :4])
    for d in range(7):   # by a loop: ranks 4..63 summed, absent last
        assert folded[d, 4] == sum(int(histogram[d, r]) for r in range(4, 64))
        assert folded[d, 5] == histogram[d, 64]
    labels, same = folded_rank_histogram(histogram[:, -6:], 4)   # K = 5: folding one rank saves nothing
    assert labels == ["r0", "r1", "r2", "r3", "r4", "absent"] and same.shape == (7, 6)


def test_info_text_stays_narrow_at_a_large_draft_top_k():
    # the shipped pycoder-mini sample drafts K = 64 candidates per depth: its report has no 300-column rows
    from importlib.resources import files
    with open_trace(str(files("kdspec.kdtree_tui") / "data" / "pycoder-mini-sample.h5")) as reader:
        a = analyze(reader)
    assert a.draft_topk == 64
    lines = analytics_text(a).splitlines()
    table = [line for line in lines if line.startswith(("  depth", "  d "))]
    assert len(table) == 1 + 7 and "r16+" in table[0] and max(map(len, table)) <= 120


def test_near_tie_verdict():
    ids, logits = [7, 3, 9, 1], [5.0, 5.0 - 1e-5, 4.0, 3.0]
    # a genuine near-tie: the golden token is the engine's runner-up, 1e-5 below
    v = near_tie_verdict(7, 3, ids, logits)
    assert v.kind == "near-tie" and v.gap == pytest.approx(1e-5)
    # the golden token outside the engine's top-k is never a near-tie, whatever the margin or |dlogit|
    v = near_tie_verdict(7, 42, [7, 3, 9, 1], [5.0, 4.99, 4.0, 3.0], dlogit=10.0)
    assert v.kind == "mismatch" and "outside" in v.reason
    # a gap within the measured error but above the precision's noise: the logits are off
    assert near_tie_verdict(7, 9, ids, logits, dlogit=0.6).kind == "logit error"
    assert near_tie_verdict(7, 9, ids, logits).kind == "mismatch"
    assert near_tie_verdict(7, 9, ids, logits, noise=1.5).kind == "near-tie"
    assert near_tie_verdict(7, 7, ids, logits).kind == "ok"
    assert near_tie_verdict(7, -1, ids, logits).kind == "no golden"


# ----------------------------------------------------------------------------- recordings at smaller budgets
@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    """Reference-backend traces of `tiny` (noisy drafter, the same top-K) at budgets 2, 4, 8, 16 for two seeds."""
    from kdspec.kdtree_tui.cli import main

    directory = tmp_path_factory.mktemp("cf")
    paths = {}
    for seed in (1, 2):
        for budget in (2, 4, 8, 16):
            path = directory / f"s{seed}b{budget}.h5"
            assert main(["record", "--model", "tiny", "--backend", "reference", "--mode", "ddtree", "--drafter",
                         "noisy:0.6", "--budget", str(budget), "--topk", "4", "--seed", str(seed),
                         "--max-new-tokens", "24", "--prompt", "The tree", "--out", str(path)]) == 0
            paths[seed, budget] = path
    return paths


def test_counterfactual_tau_equals_the_recorded_tau_at_smaller_budgets(recordings):
    shared = differs = checked_why = 0
    for seed in (1, 2):
        with open_trace(recordings[seed, 16]) as big:
            assert analyze(big).curve.steps_not_best_first == 0
            start = {int(p): i for i, p in enumerate(big.column("prefix_len"))}
            counterfactual = budget_taus(big.column("tau"), big.field("accepted_nodes"), list(range(17)))
            for small_budget in (2, 4, 8):   # three smaller budgets, each recorded
                with open_trace(recordings[seed, small_budget]) as small:
                    for j, (p, tau) in enumerate(zip(small.column("prefix_len"), small.column("tau"))):
                        if int(p) not in start:
                            continue
                        i = start[int(p)]
                        shared += 1
                        assert counterfactual[i, small_budget] == tau, (seed, small_budget, int(p))
                        differs += int(counterfactual[i, 16] != tau)
                        why = why_tau(small.step(j), small_budget)
                        if why.budget_needed is not None and why.budget_needed <= 16:
                            # the missing node arrives exactly at budget_needed in the bigger tree
                            assert counterfactual[i, why.budget_needed] > tau
                            assert counterfactual[i, why.budget_needed - 1] == tau
                            checked_why += 1
    assert shared >= 20 and differs >= 1 and checked_why >= 1, (shared, differs, checked_why)


def test_kdtree_info_step_and_whole_trace_analytics(recordings, tmp_path, capsys):
    import json

    from kdspec.kdtree_tui.cli import main

    path = str(recordings[1, 4])
    with open_trace(path) as reader:
        a = analyze(reader)
        why = why_tau(reader.step(0), 4)
    capsys.readouterr()
    assert main(["info", path, "--step", "0"]) == 0
    byte_text = lambda t: f"{t} ({chr(t)!r})" if 32 <= t < 127 else str(t)  # noqa: E731  (tiny is byte-level)
    assert capsys.readouterr().out.strip() == why_text(why, byte_text)
    assert main(["info", path, "--step", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(why_json(why)))
    assert main(["info", path, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["analytics"]["budget_curve"]["mean_tau"] == pytest.approx(a.curve.mean_tau)
    assert data["num_steps"] == a.num_steps  # the summary is still there
    assert main(["info", path]) == 0
    text = capsys.readouterr().out
    assert "mean tau" in text and "calibration ECE" in text and "budget" in text
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps([{"metric": "DDTree verify step B=4 vs roofline", "value": 2.0, "unit": "ms"}]))
    assert main(["info", path, "--bench", str(bench), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["analytics"]["budget_curve"]["cost_model"]["source"] == "bench"
    bench.write_text("{not json")
    assert main(["info", path, "--bench", str(bench)]) == 2
    assert main(["info", path, "--step", "999"]) == 2
    assert "out of range" in capsys.readouterr().err

"""`kdtree bench`: performance suites (tree, attention, moe, e2e, trace) on a GPU, each against a peer and the
ceilings measured in the same run. ``runner.run(suites, json)`` runs them; docs/benchmarks.md explains the rows."""

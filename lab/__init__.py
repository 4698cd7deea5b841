"""Lab tools: A/B comparisons used while developing shmcoll (not part of the product or of
the user-facing benchmarks in benchmarks/). Run from the repository root:

    python -m lab.ab --base <rev> -- --quick --backends shm     # two trees, benchmarks.bench
    python -m lab.ab_engine --base <rev>                        # two trees, engine level
    python -m lab.adapter_ab                                    # the torch adapter's paths
    python -m lab.hier_ab                                       # hierarchical variants
    python -m lab.one_node_ab                                   # one-node creator overhead
"""

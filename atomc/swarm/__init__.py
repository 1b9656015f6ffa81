"""SWARM parallelism (Ryabinin et al. 2023) on hivemind: stochastically wired, adaptively
rebalanced pipelines of unreliable, heterogeneous servers.
"""

"""Helpers that more than one test file uses, imported as `helpers.<module>` (tests/ is on
sys.path through tests/conftest.py). A test file imports helpers and fixtures, never another
test file (tests/test_imports.py checks it).

- `brute_force`: the best plan over every cut set, judged by the checker and timed by the
  simulator (test_partition, test_precision);
- `detached`: sub-models run as the runtimes run them, detached at every cut with the
  package's gradient flags: every equivalence check of sub-models against the model uses it;
- `model_chain`: the model cases profiled, partitioned and generated, and the checks run on
  each (test_models, test_families);
- `plain`: the unpartitioned model trained plainly, the reference swap runs are compared with
  (test_runtime, test_weights);
- `threaded`: layout stages trained on threads of one process, wired by queues
  (test_layout_swap, test_boundary_grads);
- `torchrun`: launching a layout's training script with torchrun on loopback, bounded in time
  (test_distributed, test_layouts_equal_plain_training).
"""

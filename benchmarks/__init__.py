"""nccl-tests-style benchmarks for torch.distributed backends (see benchmarks/README.md)."""

"""The torch.distributed backend: runs a plan's step graphs on real processes (gloo on CPU, NCCL on GPU)."""

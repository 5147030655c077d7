"""A fake of the cuda package for python/tests/test_vmm_ipc_cuda.py (no GPU needed)."""
